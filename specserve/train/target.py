"""The frozen target of training and evaluation, as a transformers model: a checkpoint
directory through `from_pretrained`, or a GGUF file through specserve's GGUF reader (the same
dequantized weights the engine runs, so the head learns the model it will serve)."""

from __future__ import annotations

import torch

from specserve.models import gguf

# our architecture name -> transformers model_type
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}


def load_hf_target(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers causal LM at `path` in `dtype`, on the CPU, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not gguf.is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    cfg = gguf.hf_config(path)
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dict(gguf.iter_gguf_weights(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if cfg["tie_word_embeddings"] else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(
            f"{path}: tensors the transformers model lacks {unexpected}, "
            f"and missing {sorted(set(missing) - allowed)}"
        )
    model.tie_weights()
    return model.eval()
