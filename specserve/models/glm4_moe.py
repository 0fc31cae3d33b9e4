"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): GQA attention and DeepSeek-style MoE.

Each decoder layer is
    attention  GQA (96 q / 8 kv heads at 355B, head_dim 128 given explicitly: 5120 / 96 is not
               an integer), q/k/v with bias and o_proj without (attention_bias), per-head
               RMSNorm of q and k before RoPE (use_qk_norm: the 355B models, not Air), RoPE on
               the first head_dim * partial_rotary_factor dims (0.5: 64 of 128), rotate-half
               layout within them, the rest passing through
    mlp        a dense SwiGLU below first_k_dense_replace, after it the sigmoid router
               (e_score_correction_bias for the selection only, weights renormalised and scaled
               by routed_scaling_factor) over the routed experts plus one shared expert
on the shared pre-norm decoder (models/decoder.py): `LlamaAttention` (models/llama.py) with
these flags and `make_mlp` (layers/moe.py). Checkpoint names are transformers'
(`model.layers.L.self_attn.q_proj.{weight,bias}`, `...q_norm.weight`,
`model.layers.L.mlp.experts.E.gate_proj.weight`, `...mlp.shared_experts.*`); the MTP layer
(`model.layers.92.*`, Air 46) is recognised and skipped (models/mtp.py).

partial_rotary_factor is read top-level (hub config.json) or inside rope_parameters
(transformers' saved configs); ModelConfig.from_hf takes either.
"""

from __future__ import annotations

from specserve.config import ModelConfig
from specserve.layers.moe import mlp_layers
from specserve.models.decoder import CausalLM, DecoderModel, quant_config
from specserve.models.llama import STACKED_PARAMS, LlamaAttention, llama_rotary


class Glm4MoeForCausalLM(CausalLM):
    stacked = STACKED_PARAMS

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ValueError(
                f"{config.architecture}: config.json lacks the MoE fields (n_routed_experts, "
                "num_experts_per_tok, moe_intermediate_size)"
            )
        rotary = llama_rotary(config)
        quant = quant_config(config)
        model = DecoderModel(
            config, rotary, lambda i, name: LlamaAttention(config, i, rotary, quant, name),
            mlp_layers(config, quant),
        )  # fmt: skip
        super().__init__(config, model)
