"""Tree-speculation KV compaction: for the first `layers` layers, cache slot dst[b, j] takes the
old content of slot src[b, j] (slot = page * page_size + offset), as if every source were read
before any destination is written (a source can be another pair's destination: accepted nodes
[0, 2, 5] move 0 <- 0, 1 <- 2, 2 <- 5). A Triton kernel with its torch reference beside it.

Why a kernel: the torch form (one advanced-index gather + scatter over [layers, slots, ...]) is
split by PyTorch into 16 sub-kernels each once the pool passes 2^31 elements, ~64 launches per
cycle; the kernel is one launch for k and v together.
"""

from __future__ import annotations

import os

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl, triton, use_triton

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
    k_ptr, v_ptr, src_ptr, dst_ptr, w, stride_b, num_features_k, num_features_v,
    stride_kl, stride_kp, stride_ks, stride_vl, stride_vp, stride_vs,
    PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    # one program per (request row, layer, feature tile), k and v both: a row's slots belong
    # to no other row, so each (slot, layer, feature) is read and written by one program only
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)  # int64 offsets: the pool exceeds 2^31 elements
    f0 = tl.program_id(2) * BLOCK_F
    _move_rows(k_ptr, layer * stride_kl, src_ptr, dst_ptr, b, w, f0, num_features_k,
               stride_b, stride_kp, stride_ks, PAGE_SIZE, BLOCK_W, BLOCK_F)
    _move_rows(v_ptr, layer * stride_vl, src_ptr, dst_ptr, b, w, f0, num_features_v,
               stride_b, stride_vp, stride_vs, PAGE_SIZE, BLOCK_W, BLOCK_F)


def _interpreting() -> bool:
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, layers: int,
               src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move slot src[b, j] to slot dst[b, j] in layers [0, layers) of both caches, in place.

    k_cache [L, pages, page_size, kv_heads, head_dim], v_cache likewise (head_dim may differ);
    src, dst: int [bs, W] slots, dst distinct, no slot shared between rows except by pairs with
    src == dst (padding). One Triton launch on CUDA (and under TRITON_INTERPRET), else
    `compact_kv_ref`."""
    if not (use_triton(k_cache) or _interpreting()):
        compact_kv_ref(k_cache, v_cache, layers, src, dst)
        return
    bs, w = src.shape
    assert dst.shape == src.shape and k_cache.shape[:3] == v_cache.shape[:3]
    for cache in (k_cache, v_cache):  # each slot's [kv_heads, head_dim] is one contiguous row
        assert cache.stride(-1) == 1 and cache.stride(-2) == cache.shape[-1]
    if bs == 0 or w == 0 or layers == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()
    fk, fv = k_cache.shape[-2] * k_cache.shape[-1], v_cache.shape[-2] * v_cache.shape[-1]
    block_f = min(next_power_of_2(max(fk, fv)), BLOCK_F_MAX)
    grid = (bs, layers, triton.cdiv(max(fk, fv), block_f))
    _compact_kv_kernel[grid](
        k_cache, v_cache, src, dst, w, src.stride(0), fk, fv,
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        PAGE_SIZE=k_cache.shape[2], BLOCK_W=next_power_of_2(w), BLOCK_F=block_f,
    )  # fmt: skip


def compact_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, layers: int,
                   src: torch.Tensor, dst: torch.Tensor) -> None:
    """Reference for `compact_kv` (and the CPU path): one gather, then one scatter, per cache
    over a [layers, slots, kv_heads, head_dim] view."""
    src, dst = src.flatten().long(), dst.flatten().long()
    for cache in (k_cache, v_cache):
        flat = cache[:layers].flatten(1, 2)
        flat[:, dst] = flat[:, src]
