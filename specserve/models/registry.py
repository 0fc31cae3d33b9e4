"""config.json `architectures[0]` -> model class and config adapter.

The adapter turns the architecture's config.json into the flat text-model config that
`ModelConfig.from_hf` normalises (a wrapper served text-only hands over its text_config);
MLA and MoE fields are read into ModelConfig.mla / .moe wherever a config carries them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from specserve.config import config_adapter
from specserve.models.deepseek_v3 import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    KimiK25ForConditionalGeneration,
)
from specserve.models.glm4_moe import Glm4MoeForCausalLM
from specserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from specserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelEntry:
    model_class: type[nn.Module]
    config_adapter: Callable[[dict[str, Any]], dict[str, Any]]


def _entry(architecture: str, model_class: type[nn.Module]) -> ModelEntry:
    return ModelEntry(model_class, config_adapter(architecture))


_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # DeepSeek-V3, Kimi K2 (model_type kimi_k2)
    "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
    "Kimi_K25ForConditionalGeneration": KimiK25ForConditionalGeneration,  # transformers' name
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,  # GLM-4.5 / 4.6 / 4.7 (GQA)
    "Glm4MoeLiteForCausalLM": DeepseekV3ForCausalLM,  # GLM-4.7-Flash (MLA)
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,  # GLM-5 (MLA + sparse attention)
}
MODEL_REGISTRY: dict[str, ModelEntry] = {a: _entry(a, c) for a, c in _CLASSES.items()}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported architectures: "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[architecture].model_class
