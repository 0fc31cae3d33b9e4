"""Tree-speculation KV compaction: for the first `layers` layers of a KV-pool group (MHA k and
v, or an MLA latent), cache slot dst[b, j] takes the old content of slot src[b, j] (slot =
page * page_size + offset), as if every source were read before any destination is written (a
source can be another pair's destination: accepted nodes [0, 2, 5] move 0 <- 0, 1 <- 2,
2 <- 5). A Triton kernel with its torch reference beside it.

Why a kernel: the torch form (one advanced-index gather + scatter over [layers, slots, ...]) is
split by PyTorch into 16 sub-kernels each once the pool passes 2^31 elements, ~64 launches per
cycle; the kernel is one launch for a group's tensors together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specserve.kernels.dispatch import host_launches, jit, next_power_of_2, tl, triton, use_triton

BLOCK_F_MAX = 256  # features per program: small tiles give a batch-1 cycle enough programs


@jit
def _move_rows(cache_ptr, layer_off, src_ptr, dst_ptr, b, w, f0, num_features,
               stride_b, stride_p, stride_s,
               PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr):  # fmt: skip
    """Request b's W path rows of one layer, features [f0, f0 + BLOCK_F): load every source
    row, barrier, then store every destination row (pairs with src == dst are skipped)."""
    j = tl.arange(0, BLOCK_W)
    src = tl.load(src_ptr + b * stride_b + j, mask=j < w, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + b * stride_b + j, mask=j < w, other=0).to(tl.int64)
    move = ((j < w) & (src != dst))[:, None]
    f = f0 + tl.arange(0, BLOCK_F)[None, :]
    ok = move & (f < num_features)
    base = cache_ptr + layer_off
    src_off = (src // PAGE_SIZE) * stride_p + (src % PAGE_SIZE) * stride_s
    dst_off = (dst // PAGE_SIZE) * stride_p + (dst % PAGE_SIZE) * stride_s
    rows = tl.load(base + src_off[:, None] + f, mask=ok)  # [BLOCK_W, BLOCK_F]
    # the tile's rows live in different threads: no store may land before every load is done
    tl.debug_barrier()
    tl.store(base + dst_off[:, None] + f, rows, mask=ok)


@jit
def _compact_kv_kernel(
    a_ptr, b_ptr, src_ptr, dst_ptr, w, stride_b, num_features_a, num_features_b,
    stride_al, stride_ap, stride_as, stride_bl, stride_bp, stride_bs,
    PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    # one program per (request row, layer, feature tile), every tensor of the group (k and v,
    # or an MLA latent alone): a row's slots belong to no other row, so each (slot, layer,
    # feature) is read and written by one program only
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)  # int64 offsets: the pool exceeds 2^31 elements
    f0 = tl.program_id(2) * BLOCK_F
    _move_rows(a_ptr, layer * stride_al, src_ptr, dst_ptr, b, w, f0, num_features_a,
               stride_b, stride_ap, stride_as, PAGE_SIZE, BLOCK_W, BLOCK_F)
    if HAS_B:
        _move_rows(b_ptr, layer * stride_bl, src_ptr, dst_ptr, b, w, f0, num_features_b,
                   stride_b, stride_bp, stride_bs, PAGE_SIZE, BLOCK_W, BLOCK_F)


def _row_features(cache: torch.Tensor) -> int:
    """Values per slot of a [L, pages, page_size, *row] cache, asserting each slot's row is one
    contiguous run."""
    assert cache[0, 0, 0].is_contiguous()
    return math.prod(cache.shape[3:])


def compact_kv(caches: Sequence[torch.Tensor], layers: int, src: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Move slot src[b, j] to slot dst[b, j] in layers [0, layers) of every cache, in place.

    caches: one KV-pool group's tensors (kv_cache/pool.py), each [L, pages, page_size, *row]
    with the same pages and page size: MHA k and v ([kv_heads, head_dim], head dims may
    differ) or an MLA latent ([kv_lora_rank + rope_dim]). src, dst: int [bs, W] slots, dst
    distinct, no slot shared between rows except by pairs with src == dst (padding). One
    Triton launch on CUDA (and under TRITON_INTERPRET) for up to two caches, else
    `compact_kv_ref`."""
    assert 1 <= len(caches) <= 2 and all(c.shape[:3] == caches[0].shape[:3] for c in caches)
    if not (use_triton(caches[0]) or host_launches()):
        compact_kv_ref(caches, layers, src, dst)
        return
    bs, w = src.shape
    assert dst.shape == src.shape
    features = [_row_features(c) for c in caches]
    if bs == 0 or w == 0 or layers == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()
    a, b = caches[0], caches[-1]
    fa, fb = features[0], features[-1]
    block_f = min(next_power_of_2(max(fa, fb)), BLOCK_F_MAX)
    grid = (bs, layers, triton.cdiv(max(fa, fb), block_f))
    _compact_kv_kernel[grid](
        a, b, src, dst, w, src.stride(0), fa, fb, *a.stride()[:3], *b.stride()[:3],
        PAGE_SIZE=a.shape[2], BLOCK_W=next_power_of_2(w), BLOCK_F=block_f,
        HAS_B=len(caches) == 2,
    )  # fmt: skip


def compact_kv_ref(caches: Sequence[torch.Tensor], layers: int, src: torch.Tensor,
                   dst: torch.Tensor) -> None:
    """Reference for `compact_kv` (and the CPU path): one gather, then one scatter, per cache
    over a [layers, slots, *row] view."""
    src, dst = src.flatten().long(), dst.flatten().long()
    for cache in caches:
        flat = cache[:layers].flatten(1, 2)
        flat[:, dst] = flat[:, src]
