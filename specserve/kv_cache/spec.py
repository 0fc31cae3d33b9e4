"""What one attention layer keeps per token in the paged KV cache: its page layout.

Every attention kind declares a KVCacheSpec; the pool allocates from it, the planner sizes the
pool from it and the speculative KV compaction moves rows through it, never through head counts.

    MHA / GQA   k [page_size, num_kv_heads, head_dim] and v [page_size, num_kv_heads, head_dim_v]
    MLA         latent [page_size, kv_lora_rank + qk_rope_head_dim], one row [c_kv | k_pe] per
                token (DeepSeek-V3 / Kimi K2: 512 + 64 = 576 values, shared by every head)
    DSA         the MLA latent plus the indexer's key row index_k [page_size, index_head_dim]
                (GLM-5: 576 + 128 values per token and layer; layers/dsa.py)

A page is one page_size-token range of positions in EVERY layer: a request's page table serves
all its layers (draft layers included) whatever their kind, so page tables, slot mappings and
the CUDA-graph inputs built from them do not depend on the layout. Layers of different kinds
differ only in what one page of theirs holds. Torch-free (sizes in elements and bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer page layout: named tensors, each [page_size, *row] for one page."""

    kind: str  # "mha" (MHA/GQA, k + v), "mla" (one latent row) or "dsa" (latent + index key)
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (name, per-token row shape)

    @classmethod
    def mha(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None = None) -> KVCacheSpec:
        """k and v pages [page_size, num_kv_heads, head_dim(_v)] (heads local to the rank)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        return cls("mha", (("k", (num_kv_heads, head_dim)), ("v", (num_kv_heads, dv))))

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
        """One latent page [page_size, kv_lora_rank + qk_rope_head_dim]: [c_kv | k_pe] per token
        (the same on every TP rank: MLA's latent is one KV head shared by all heads)."""
        return cls("mla", (("latent", (kv_lora_rank + qk_rope_head_dim,)),))

    @classmethod
    def dsa(cls, kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int) -> KVCacheSpec:
        """The MLA latent page and the indexer's key page [page_size, index_head_dim] (both the
        same on every TP rank: the indexer is replicated)."""
        latent = cls.mla(kv_lora_rank, qk_rope_head_dim).tensors
        return cls("dsa", (*latent, ("index_k", (index_head_dim,))))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tensors)

    @property
    def elements_per_token(self) -> int:
        """Values one token costs in this layer, all tensors together."""
        return sum(math.prod(row) for _, row in self.tensors)

    def bytes_per_page(self, page_size: int, itemsize: int) -> int:
        return page_size * self.elements_per_token * itemsize

    def describe(self) -> str:
        """e.g. 'mha k [8, 128] + v [8, 128]' (for error messages)."""
        parts = " + ".join(f"{name} {list(row)}" for name, row in self.tensors)
        return f"{self.kind} {parts}"
