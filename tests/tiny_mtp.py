"""Tiny DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash / GLM-5 checkpoints carrying an MTP layer, and a
plain-torch reference of the MTP drafting math (independent of specserve).

The checkpoint is a 4-layer transformers model saved with num_hidden_layers 3 and
num_nextn_predict_layers 1, so `model.layers.3.*` is a full decoder block of the target's
kind (MoE: layer 3 is past first_k_dense_replace), written by transformers itself (GLM-5: with
its indexer, `self_attn.indexer.*`, the names the real checkpoint's layer 78 has); per-layer
config lists (mlp_layer_types, indexer_types) are cut to the 3 target layers. The NextN
parts (enorm, hnorm, eh_proj, shared_head.norm, optionally shared_head.head and embed_tokens
copies) are added by hand. The reference runs the block through transformers' own decoder
layer (`hf4.model.layers[3]`; GLM-5's scores the positions its additive causal mask leaves
visible with its indexer and attends over the top index_topk, all of them when fewer) and
writes the rest in plain torch.
"""

from __future__ import annotations

import functools
import json
import os

import torch
from safetensors.torch import load_file, save_file
from tiny_models import _add_tokenizer, make_hf_model

PREFIX = "model.layers.3."


def make_mtp_checkpoint(path: str, family: str = "deepseek_v3", seed: int = 0,
                        own_head: bool = False, drop: str | None = None,
                        **overrides: object) -> tuple[str, torch.nn.Module]:
    """(checkpoint directory, the 4-layer transformers model whose layer 3 is the MTP block).
    own_head: also store shared_head.head (random, unlike the target's lm_head) and an
    embed_tokens copy equal to the target's; drop: leave this MTP tensor out."""
    hf4 = make_hf_model(family, seed, vocab_size=512, num_hidden_layers=4, **overrides)
    hf4.save_pretrained(path)
    _add_tokenizer(path, 512)
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    for key, value in list(config.items()):  # per-layer lists describe the 3 target layers
        if isinstance(value, list) and len(value) == 4:
            config[key] = value[:3]
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    config.pop("num_mtp_layers", None)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    h = hf4.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 100)
    extra = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(h, generator=gen),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(h, generator=gen),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5,
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(h, generator=gen),
    }
    if own_head:
        extra["shared_head.head.weight"] = torch.randn(512, h, generator=gen) / h**0.5
        extra["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update({PREFIX + k: v.contiguous() for k, v in extra.items()})
    if drop is not None:
        del tensors[PREFIX + drop]
    save_file(tensors, file, metadata={"format": "pt"})
    return path, hf4


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@functools.cache
def _hf_target(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_chain(path: str, hf4: torch.nn.Module, tokens: list[int], k: int) -> torch.Tensor:
    """The k chained draft logits [k, V] of a cycle whose root token is tokens[-1] at position
    P = len(tokens) - 1: the target's final (post-norm) hidden states h_0..h_{P-1} over
    tokens[:P]; MTP inputs (h_i, t_{i+1}) at positions 0..P-1 give logits 1; step s feeds the
    layer its own output at position P + s - 2 with the drafted token, at position P + s - 1.
    Every position is recomputed causally from scratch (no KV cache)."""
    target = _hf_target(path)
    mtp = {n[len(PREFIX):]: t for n, t in load_file(os.path.join(path, "model.safetensors")).items()
           if n.startswith(PREFIX)}
    eps = hf4.config.rms_norm_eps
    head_w = mtp.get("shared_head.head.weight", target.lm_head.weight)
    embed_w = mtp.get("embed_tokens.weight", target.model.embed_tokens.weight)
    block, rotary = hf4.model.layers[3], hf4.model.rotary_emb
    if hasattr(block.self_attn, "indexer"):  # GLM-5: the MTP block selects on its own
        assert block.self_attn.indexer is not None
    p = len(tokens) - 1
    ids = torch.tensor([tokens[:p]])
    hidden = target(ids, output_hidden_states=True).hidden_states[-1][0]  # [P, H], post-norm
    assert torch.allclose(hidden, target.model(ids).last_hidden_state[0])
    feats, toks = list(hidden), list(tokens[1:])  # (h_i, t_{i+1}) per draft position
    out = []
    for _ in range(k):
        n = len(toks)
        e = _rms(embed_w[torch.tensor(toks)], mtp["enorm.weight"], eps)
        g = _rms(torch.stack(feats), mtp["hnorm.weight"], eps)
        x = (torch.cat([e, g], dim=-1) @ mtp["eh_proj.weight"].T)[None]  # embedding first
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = block(x, attention_mask=mask, position_ids=pos,
                  position_embeddings=rotary(x, pos))
        y = (y[0] if isinstance(y, tuple) else y)[0]  # [n, H]
        logits = _rms(y[-1], mtp["shared_head.norm.weight"], eps) @ head_w.T
        out.append(logits)
        feats.append(y[-1])
        toks.append(int(logits.argmax()))
    return torch.stack(out)
