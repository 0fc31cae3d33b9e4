"""Well-known model shapes, for benchmarking with random weights (`--load-format dummy`)."""

from __future__ import annotations

import torch
from torch import nn

_LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
}
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "torch_dtype": "float32", "eos_token_id": 2,
}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    "qwen3-8b": _QWEN3_8B,
    "tiny-llama": _TINY_LLAMA,
}


@torch.no_grad()
def random_init(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for cost benchmarks: N(0, std) matrices, ones for norm scales; a
    quantized linear gets random codes in its format whose values are ~N(0, std), then the
    post-loading step a checkpoint's weights would get."""
    from specserve.layers.quantization import linear_modules, process_weights_after_loading
    from specserve.layers.quantization.unquantized import UnquantizedLinearMethod

    gens: dict[torch.device, torch.Generator] = {}

    def gen_for(device: torch.device) -> torch.Generator:
        return gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))

    quantized = [m for m in linear_modules(model)
                 if not isinstance(m.quant_method, UnquantizedLinearMethod)]
    owned = {id(p) for m in quantized for name, p in m.named_parameters(recurse=False)
             if name != "bias"}
    for param in model.parameters():
        if id(param) in owned:
            continue
        if param.dim() >= 2:
            param.data.normal_(0.0, std, generator=gen_for(param.device))
        else:
            param.data.fill_(1.0)
    for module in quantized:
        device = next(module.parameters()).device
        module.quant_method.random_init(module, gen_for(device), std)
    process_weights_after_loading(model)
