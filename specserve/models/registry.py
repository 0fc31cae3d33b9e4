"""config.json `architectures[0]` -> model class."""

from __future__ import annotations

from torch import nn

from specserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported architectures: "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[architecture]
