"""Write tiny random EAGLE-3 heads in the public checkpoint formats (for tests)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def make_tiny_eagle3_head(path: str, target_dir: str, draft_vocab_size: int | None = 64,
                          layout: str = "official", seed: int = 0, scale: float = 0.5,
                          with_embed: bool = False, fc_bias: bool = False,
                          use_bin: bool = False) -> str:
    """A random head for the target at `target_dir`.

    layout "official": `midlayer.*`, `d2t` offsets, `t2d`; "layers0": the speculators variant
    (`layers.0.*`). draft_vocab_size None: no lm_head / d2t (the target's lm_head is used).
    The draft vocabulary is every other target id starting at 1 (so d2t[i] = i + 1).
    """
    with open(os.path.join(target_dir, "config.json")) as fh:
        tcfg = json.load(fh)
    h = tcfg["hidden_size"]
    heads = tcfg["num_attention_heads"]
    kv_heads = tcfg.get("num_key_value_heads", heads)
    hd = tcfg.get("head_dim") or h // heads
    inter = tcfg["intermediate_size"]
    vocab = tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5).contiguous()

    prefix = "midlayer." if layout == "official" else "layers.0."
    w = {
        "fc.weight": rnd(h, 3 * h),
        prefix + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        prefix + "self_attn.k_proj.weight": rnd(kv_heads * hd, 2 * h),
        prefix + "self_attn.v_proj.weight": rnd(kv_heads * hd, 2 * h),
        prefix + "self_attn.o_proj.weight": rnd(h, heads * hd),
        prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "mlp.gate_proj.weight": rnd(inter, h),
        prefix + "mlp.up_proj.weight": rnd(inter, h),
        prefix + "mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
    }
    if fc_bias:
        w["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    if with_embed:
        w["embed_tokens.weight"] = torch.randn(vocab, h, generator=g)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if layout != "official" else "LlamaForCausalLM"],
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "num_hidden_layers": 1,
        "vocab_size": vocab, "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
        "torch_dtype": "float32",
    }
    if draft_vocab_size is not None:
        ids = torch.arange(draft_vocab_size) * 2 + 1  # draft id i <-> target id 2i + 1
        assert ids[-1] < vocab
        w["lm_head.weight"] = rnd(draft_vocab_size, h)
        w["d2t"] = ids - torch.arange(draft_vocab_size)
        w["t2d"] = torch.isin(torch.arange(vocab), ids)
        cfg["draft_vocab_size"] = draft_vocab_size
    os.makedirs(path, exist_ok=True)
    if use_bin:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path
