"""GLM-5 (GlmMoeDsaForCausalLM): the DeepSeek-V3 decoder (models/deepseek_v3.py) with
DeepSeek sparse attention in every layer (layers/dsa.py).

GLM-5 dims: MLA with q_lora_rank 2048, kv_lora_rank 512, P 192 / R 64 / V 256, 64 heads,
rope_theta 1e6 without scaling (softmax scale (P + R)^-0.5 = 0.0625), interleaved rope in the
MLA and in the indexer (index_topk 2048, index_head_dim 128, index_n_heads 32); 256 routed
experts, top 8, one shared, sigmoid router; the first 3 layers dense (mlp_layer_types). The
indexer's tensors are `model.layers.L.self_attn.indexer.{wq_b,wk,k_norm,weights_proj}.*`; the
MTP layer (`model.layers.78.*`) is recognised and skipped (models/mtp.py): the mtp drafter
builds it through this factory (index >= num_hidden_layers: a full DSA layer with its own
indexer and selection, models/mtp_layer.py).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from specserve.config import ModelConfig
from specserve.layers.dsa import DSAAttention, DSASelection
from specserve.layers.quantization import QuantConfig
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.deepseek_v3 import DeepseekV3ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def attention_layers(
        cls, config: ModelConfig, rotary: RotaryEmbedding, quant: QuantConfig | None
    ) -> Callable[[int, str], nn.Module]:
        if config.dsa is None:
            raise ValueError(
                f"{config.architecture}: config.json lacks the DSA indexer fields (index_topk, "
                "index_head_dim, index_n_heads)"
            )
        selection = DSASelection()  # one per model: shared layers read the full layer's slots

        def build(i: int, name: str) -> DSAAttention:
            if i >= config.num_layers:  # an MTP layer: its own forward, so its own indexer
                return DSAAttention(config, i, rotary, DSASelection(), reduce_output=False,
                                    quant_config=quant, prefix=name, full=True)  # fmt: skip
            return DSAAttention(config, i, rotary, selection, reduce_output=False,
                                quant_config=quant, prefix=name)  # fmt: skip

        return build
