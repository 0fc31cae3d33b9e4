"""Attention over the paged KV cache: the modules models hold, and the backend protocol.

The module owns no math: it reshapes q/k/v to heads and hands them, with its layer's cache,
to the backend of the current forward context (torch reference, Triton, ...). Every module
that keeps a paged cache derives from CachedAttention and declares its page layout
(`kv_spec`, kv_cache/spec.py): `Attention` (MHA/GQA) here, `MLAAttention` in layers/mla.py.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention_metadata import (
    AttentionMetadata,
    SplitMetadata,
    get_forward_context,
)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim] (already rotated)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at md.slot_mapping (skip -1 slots), then attend (causal or custom mask).
        A backend with `fuses_rope = True` also takes rope=(positions, cos_sin table) and
        rotates q/k itself, in its KV-write launch."""
        ...


class CachedAttention(nn.Module):
    """Base of the attention modules that keep a paged KV cache.

    A subclass sets `layer_idx`, declares `kv_spec` and starts with an empty tensor attribute
    `<name>_cache` per tensor of its spec; `KVPool.bind` replaces those by its layer's views
    ([num_pages, page_size, *row]; plain attributes, not parameters or buffers). Before that
    (no pool) the backend attends over the new tokens only.
    """

    layer_idx: int

    @property
    def kv_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def bind_kv_cache(self, caches: dict[str, torch.Tensor]) -> None:
        assert tuple(caches) == self.kv_spec.names, (tuple(caches), self.kv_spec)
        for name, tensor in caches.items():
            setattr(self, f"{name}_cache", tensor)


class Attention(CachedAttention):
    """One layer's MHA/GQA attention (heads local to this TP rank); caches `k_cache` and
    `v_cache` [num_pages, page_size, num_kv_heads, head_dim]."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    takes_split = True  # SplitMetadata: a forward whose token ranges attend differently

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec.mha(self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None, rotary: nn.Module | None = None
                ) -> torch.Tensor:
        """q [T, num_heads * head_dim] (or [T, num_heads, head_dim]); k, v likewise with kv
        heads. With `rotary` (a RotaryEmbedding) q and k are rotated at `positions` first: by
        the backend, fused with its KV write, where it can (`fuses_rope`), else here."""
        ctx = get_forward_context()
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        fused_rope = False
        if rotary is not None:
            if getattr(ctx.backend, "fuses_rope", False) and rotary.fusable(q, k):
                fused_rope = True
            else:
                q, k = rotary(positions, q, k)
        md = ctx.metadata
        parts = md.parts if isinstance(md, SplitMetadata) else [(0, q.shape[0], md)]
        outs = []
        for a, b, part in parts:
            extra = {"rope": (positions[a:b], rotary.table())} if fused_rope else {}
            outs.append(ctx.backend.forward(q[a:b], k[a:b], v[a:b], self.k_cache, self.v_cache,
                                            part, self.scale, **extra))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(-1, self.num_heads * self.head_dim)  # [T, num_heads * head_dim]


def attention_modules(model: nn.Module) -> list[CachedAttention]:
    """The model's cached attention modules (any kind) in registration order (layer 0 first):
    the layers of its KV pool."""
    return [m for m in model.modules() if isinstance(m, CachedAttention)]
