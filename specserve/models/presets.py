"""Well-known model shapes, for benchmarking with random weights (`--load-format dummy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the shapes are read by the CLI before torch is imported
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

# Kimi K2 (0905 / Thinking / K2.5 text) per-layer dimensions, 3 layers: the dense first layer
# and two MoE layers (384 routed experts, top 8, one shared); ~74 GB of bf16 weights
_KIMI_K2_3L = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 3, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0, "rope_scaling": {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163585,
}
# Kimi K2 at full depth (61 layers: one dense, 60 MoE) with 16 routed experts per layer
# instead of 384: a token reads what it reads in the real model (attention, the top 8 routed
# experts, the shared expert, ~32B parameters), so at batch 1 the target step and a draft
# head's cost relative to it are the real model's (the 3-layer preset makes any head look as
# heavy as the target); larger batches touch fewer distinct experts than the real model's.
# ~108 GB of bf16 weights
_KIMI_K2_61L_E16 = {**_KIMI_K2_3L, "num_hidden_layers": 61, "n_routed_experts": 16}
# DeepSeek-V3 per-layer dimensions (Kimi K2's but 128 heads, 256 routed experts in 8 groups
# of which 4 are kept, its rope and vocabulary), 4 layers: one dense and three MoE; ~74 GB
_DEEPSEEK_V3_4L = {
    **_KIMI_K2_3L, "model_type": "deepseek_v3", "vocab_size": 129280, "num_hidden_layers": 4,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 163840, "bos_token_id": 0, "eos_token_id": 1,
}

# GLM-4.5-Air per-layer dimensions, 4 layers: the dense first layer and three MoE layers (GQA
# 96 q / 8 kv heads of 128, q/k/v bias, RoPE on 64 of 128 dims, 128 routed experts, top 8, one
# shared, routed_scaling_factor 1); ~16 GB of bf16 weights
_GLM_45_AIR_4L = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
    "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 4, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": [151329, 151336, 151338],
}
# GLM-5 per-layer dimensions, 3 layers: one dense and two MoE (GLM-5 has 3 dense of 78).
# MLA q_lora 2048 / kv_lora 512, P 192 / R 64 / V 256, 64 heads; the DSA indexer (32 heads of
# 128, top 2048 tokens); 256 routed experts, top 8, one shared; ~43 GB of bf16 weights
_GLM_5_3L = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
    "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "rope_interleave": True,
    "indexer_rope_interleave": True, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "max_position_embeddings": 202752, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829],
}
# GLM-5 with index_topk past its context: every query selects every token, so the layers run
# dense MLA (the sparse attention's baseline, same weights and cache)
_GLM_5_3L_DENSE = {**_GLM_5_3L, "index_topk": _GLM_5_3L["max_position_embeddings"]}

# how a preset's released checkpoints quantize, per --quantization family (random weights in
# that format); a family not listed gets layers/quantization's generic preset
_KIMI_K25_INT4 = {  # Kimi K2.5 / K2 Thinking: INT4 routed experts only, groups of 32
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
_KIMI_K25_NVFP4 = {  # nvidia/Kimi-K2.5-NVFP4 (ModelOpt): NVFP4 routed experts only
    "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
    "ignore": ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate_proj", "*mlp.up_proj",
               "*mlp.down_proj"],
}
_KIMI_FORMATS = {"w4a16": _KIMI_K25_INT4, "nvfp4": _KIMI_K25_NVFP4}
PRESET_FORMATS: dict[str, dict[str, dict]] = {"kimi-k2-3l": _KIMI_FORMATS,
                                              "kimi-k2-61l-e16": _KIMI_FORMATS}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    "qwen3-8b": _QWEN3_8B,
    "tiny-llama": _TINY_LLAMA,
    "kimi-k2-3l": _KIMI_K2_3L,
    "kimi-k2-61l-e16": _KIMI_K2_61L_E16,
    "deepseek-v3-4l": _DEEPSEEK_V3_4L,
    "glm-4.5-air-4l": _GLM_45_AIR_4L,
    "glm-5-3l": _GLM_5_3L,
    "glm-5-3l-dense": _GLM_5_3L_DENSE,
    # with the MTP layer the released checkpoints ship (random weights: speculative method mtp)
    "deepseek-v3-4l-mtp": {**_DEEPSEEK_V3_4L, "num_nextn_predict_layers": 1},
    "glm-4.5-air-4l-mtp": {**_GLM_45_AIR_4L, "num_nextn_predict_layers": 1},
    "glm-5-3l-mtp": {**_GLM_5_3L, "num_nextn_predict_layers": 1},  # a full DSA MTP layer
}


def random_init(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for cost benchmarks: N(0, std) matrices, ones for norm scales; a
    quantized linear (or routed-expert block) gets random codes in its format whose values are
    ~N(0, std), then the post-loading step a checkpoint's weights would get."""
    import torch

    from specserve.layers.quantization import process_weights_after_loading, quant_modules

    gens: dict[torch.device, torch.Generator] = {}

    def gen_for(device: torch.device) -> torch.Generator:
        return gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))

    quantized = [m for m in quant_modules(model) if m.quant_method.family is not None]
    owned = {id(p) for m in quantized for name, p in m.named_parameters(recurse=False)
             if name != "bias"}
    with torch.no_grad():
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
