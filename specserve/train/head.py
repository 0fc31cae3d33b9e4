"""The training-time EAGLE-3 head: plain torch modules named like the public checkpoint.

Same computation as specserve.models.eagle3 (see the formula there), for padded batches
[B, L] instead of the engine's packed, paged layout, and with the training-time-test (TTT)
attention: in unrolled step i the query at index t sees the step-0 keys of indices 0..t
(causal, real target features) plus its OWN index's keys from steps 1..i. RoPE position of
step i at index t is t + i, exactly the position inference gives that draft token.

state_dict() holds exactly the exported tensors: fc, midlayer.*, norm, lm_head, d2t, t2d.
The target's embedding table is a frozen, non-persistent buffer (never exported).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.rotary import apply_rotary, compute_inv_freq


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in fp32 (as layers/norm.py computes
    it). Plain torch on purpose: the inference norm dispatches to a fused kernel on CUDA that
    has no backward, which would silently cut the gradient to everything below it."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class StepCache:
    """Keys/values of earlier TTT steps: step 0 over all indices, steps 1..i at own index."""

    k0: torch.Tensor  # [B, kv_heads, L, hd] (RoPE applied)
    v0: torch.Tensor  # [B, kv_heads, L, hd]
    k_diag: list[torch.Tensor]  # per later step: [B, kv_heads, L, hd]
    v_diag: list[torch.Tensor]


class TTTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: StepCache | None) -> tuple[torch.Tensor, StepCache]:
        # x [B, L, 2H]; cos/sin [L, hd/2] for this step's positions
        b, n, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(b, n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
        if cache is None:  # step 0: plain causal attention over real features
            cache = StepCache(k, v, [], [])
            out = F.scaled_dot_product_attention(q, *self._expand(k, v), is_causal=True)
        else:
            cache.k_diag.append(k)
            cache.v_diag.append(v)
            out = self._ttt_attention(q, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), cache

    def _expand(self, *kv: torch.Tensor) -> list[torch.Tensor]:
        rep = self.num_heads // self.num_kv_heads  # GQA: each kv head serves `rep` q heads
        return [t.repeat_interleave(rep, dim=1) for t in kv]

    def _ttt_attention(self, q: torch.Tensor, cache: StepCache) -> torch.Tensor:
        # q [B, heads, L, hd]; scores over L causal step-0 keys plus one key per later step
        scale = self.head_dim**-0.5
        k0, v0 = self._expand(cache.k0, cache.v0)
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s0 = (q @ k0.transpose(-1, -2)).float() * scale  # [B, heads, L, L]
        s0 = s0.masked_fill(~causal, float("-inf"))
        kd = self._expand(*cache.k_diag)
        vd = self._expand(*cache.v_diag)
        sd = torch.stack([(q * k).sum(-1).float() * scale for k in kd], dim=-1)  # [B, h, L, i]
        probs = torch.cat([s0, sd], dim=-1).softmax(-1).to(q.dtype)
        out = probs[..., :n] @ v0  # [B, heads, L, hd]
        for j, v in enumerate(vd):
            out = out + probs[..., n + j, None] * v
        return out


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = TTTAttention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, emb: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: StepCache | None) -> tuple[torch.Tensor, StepCache]:
        # emb, g [B, L, H] -> out [B, L, H]; embedding first in the 2H input
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)
        a, cache = self.self_attn(x, cos, sin, cache)
        r = g + a  # the residual is the un-normed g
        return r + self.mlp(self.post_attention_layernorm(r)), cache


class Eagle3TrainHead(nn.Module):
    """cfg: the head's ModelConfig (hidden size, heads, rope, draft_vocab_size);
    target_hidden: Ht; embed_weight [V, H]: the target's table (frozen, not exported)."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, embed_weight: torch.Tensor) -> None:
        super().__init__()
        assert cfg.draft_vocab_size, "the training head always has its own draft vocabulary"
        h = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        inv_freq, self.attention_factor = compute_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary (target_id = i + d2t[i])."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rope(self, num: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin [num, hd/2] for positions offset .. offset + num - 1
        pos = torch.arange(offset, offset + num, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def step(self, input_ids: torch.Tensor, g: torch.Tensor, step: int,
             cache: StepCache | None) -> tuple[torch.Tensor, StepCache]:
        """One unrolled TTT step. input_ids [B, L]; g [B, L, 3Ht] at step 0 (target
        features, fused by fc) or [B, L, H] (the previous step's out). Returns out [B, L, H]."""
        assert (step == 0) == (cache is None)
        if step == 0:
            g = self.fc(g)
        emb = F.embedding(input_ids, self.embed_weight).to(g.dtype)
        cos, sin = self.rope(input_ids.shape[1], step)
        return self.midlayer(emb, g, cos, sin, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        # [B, L, H] -> [B, L, Vd] float32
        return self.lm_head(self.norm(out)).float()


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target ids (ties: lower id first), sorted.

    counts [V] -> (d2t int64 [Vd] with target_id = i + d2t[i], t2d bool [V] membership).
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab}] (the target's vocabulary)"
                         f", got {draft_vocab_size}")
    ids = torch.arange(vocab)
    # stable sort on descending counts keeps ascending ids among equal counts
    order = torch.sort(-counts.long(), stable=True).indices
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.isin(ids, chosen)
    return d2t, t2d


def head_config_json(cfg: ModelConfig, dtype: str, target_num_layers: int) -> dict:
    """config.json of the public format. rope_theta is always explicit (heads without it are
    read as 10000). The capture ids are written only when they differ from the default
    (2, N//2, N-3): engines disagree on what the listed ids mean, not on the default."""
    from specserve.models.capture import default_aux_layer_ids

    out = {
        "architectures": [cfg.architecture], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None,
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    aux = tuple(cfg.aux_layer_ids or ())
    if aux and aux != default_aux_layer_ids(target_num_layers):
        # our convention: the residual stream ENTERING each listed target layer
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux),
                               "use_aux_hidden_state": True}
    return out


def export_head(head: Eagle3TrainHead, out_dir: str, dtype: str, target_num_layers: int) -> None:
    """Write model.safetensors + config.json (no embed_tokens: the target's is shared)."""
    from safetensors.torch import save_file

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    tensors = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu()
        tensors[name] = t.to(torch_dtype).contiguous() if t.is_floating_point() else t
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(head_config_json(head.config, dtype, target_num_layers), fh, indent=2)
