"""DeepSeek-V3 family: DeepseekV3ForCausalLM (DeepSeek-V3, Kimi K2), DeepseekV2ForCausalLM,
and KimiK25ForConditionalGeneration served text-only.

Each decoder layer is multi-head latent attention (layers/mla.py) and a feed-forward block
that is dense below first_k_dense_replace and DeepSeekMoE after (layers/moe.py): the shared
pre-norm decoder of models/decoder.py with those modules.

Checkpoint names are transformers' (`model.layers.L.self_attn.q_a_proj.weight`,
`model.layers.L.mlp.experts.E.gate_proj.weight`, ...). MTP / NextN layers, stored as extra
layers `model.layers.{num_hidden_layers + i}.*` (DeepSeek-V3: layer 61), are recognised and
skipped (one log line) until a drafter uses them (models/mtp.py).

GLM-4.7-Flash (Glm4MoeLiteForCausalLM) is this model: MLA (q_lora_rank 768, P 192, R 64,
V 256, interleaved rope) and the same sigmoid router with shared experts; its saved config
gives mlp_layer_types instead of first_k_dense_replace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.mla import MLAAttention, mla_rotary
from specserve.layers.moe import mlp_layers
from specserve.layers.quantization import QuantConfig
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.decoder import CausalLM, DecoderModel, quant_config

log = logging.getLogger(__name__)

# dense MLPs and shared experts fuse gate and up; routed experts load through expert_shards;
# the MLA projections load unchanged
STACKED_PARAMS = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


class DeepseekV3ForCausalLM(CausalLM):
    stacked = STACKED_PARAMS

    def __init__(self, config: ModelConfig, prefix: str = "") -> None:
        """`prefix`: what the checkpoint names put before `model.` (a wrapper's
        `language_model.`), for the quantization config's module names."""
        if config.mla is None:
            raise ValueError(
                f"{config.architecture}: config.json lacks the MLA fields (kv_lora_rank, "
                "qk_nope_head_dim, qk_rope_head_dim, v_head_dim)"
            )
        rotary = mla_rotary(config)
        quant = quant_config(config)
        model = DecoderModel(
            config, rotary, self.attention_layers(config, rotary, quant),
            mlp_layers(config, quant),
            prefix=f"{prefix}model",
        )  # fmt: skip
        super().__init__(config, model)

    @classmethod
    def attention_layers(
        cls, config: ModelConfig, rotary: RotaryEmbedding, quant: QuantConfig | None
    ) -> Callable[[int, str], nn.Module]:
        """(layer index, checkpoint name) -> its attention module (all share `rotary`)."""
        return lambda i, name: MLAAttention(config, i, rotary, reduce_output=False,
                                            quant_config=quant, prefix=name)  # fmt: skip


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2.5: the same decoder; the config selects softmax routing (greedy or
    group-limited) without a correction bias."""


class KimiK25ForConditionalGeneration(nn.Module):
    """Kimi K2.5, text only: the DeepseekV3 language model under `language_model`.

    Checkpoint names: `language_model.model.layers.*` (hub), `language_model.layers.*`
    (NVIDIA's NVFP4 exports: no `.model.`), `language_model.lm_head.weight`; the vision tower
    and projector (`vision_tower.*`, `mm_projector.*`) are skipped. It has no EAGLE-3 hooks:
    the drafter finds the decoder layers, the embedding and the LM head by structure
    (models/capture.py)."""

    SKIPPED = ("vision_tower.", "mm_projector.", "model.mm_projector.", "model.vision_tower.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.language_model = DeepseekV3ForCausalLM(config, prefix="language_model.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped: dict[str, int] = {}

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(self.SKIPPED):
                    kind = name.split(".")[1 if name.startswith("model.") else 0]
                    skipped[kind] = skipped.get(kind, 0) + 1
                    continue
                yield _text_name(name), tensor

        self.language_model.load_weights(text_weights())
        if skipped:
            log.info("text-only serving: skipped %s",
                     ", ".join(f"{n} {k} tensors" for k, n in sorted(skipped.items())))  # fmt: skip


def _text_name(name: str) -> str:
    """A wrapper checkpoint name -> the language model's own name (`model.*` / `lm_head.*`)."""
    if not name.startswith("language_model."):
        raise ValueError(
            f"unexpected tensor {name!r} in a KimiK25ForConditionalGeneration checkpoint: "
            "expected language_model.*, vision_tower.* or mm_projector.*"
        )
    inner = name[len("language_model.") :]
    if inner.startswith(("model.", "lm_head.")):
        return inner
    return "model." + inner  # language_model.layers.* (NVFP4 exports)
