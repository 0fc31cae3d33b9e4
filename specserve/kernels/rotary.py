"""Rotary position embedding applied in place to q and k in one launch (neox half-split layout).

    x = [x1 | x2 | x_pass] (x1, x2: halves of the rotary dims r <= head_dim)
    out = [x1 cos - x2 sin | x2 cos + x1 sin | x_pass]
with cos/sin read from a [max_positions, r] fp32 table (cos in the first half, sin in the
second) at each token's position: the table's width sets r, so a partial rotary (GLM-4.5:
r = head_dim / 2) rotates the first r dims of each head and leaves the rest where they are.
One program per token handles every q and k head.

`rotary_store_kv` is the same pass fused with the KV-cache write of attention: the rotated k
(its pass-through dims too) and the v of each token go to its cache slot from registers (slot
-1: no write), saving a launch and a re-read of k and v per layer.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl


@jit
def _cos_sin(cos_sin_ptr, pos_ptr, t, stride_cs, half, BLOCK_D: tl.constexpr):
    """Token t's cos and sin rows, [1, BLOCK_D] fp32 each (0 past half)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < half, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d < half, other=0.0)[None, :]
    return cos, sin


@jit
def _rotate_in_place(base, t, stride_t, stride_h, heads, half, cos, sin,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Rotate heads [0, heads) of token t in place; returns the rotated halves [BLOCK_H,
    BLOCK_D] in the input dtype."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < heads) & (d < half)
    p1 = base + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + half, mask=ok, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (x1f * cos - x2f * sin).to(x1.dtype)
    y2 = (x2f * cos + x1f * sin).to(x1.dtype)
    tl.store(p1, y1, mask=ok)
    tl.store(p1 + half, y2, mask=ok)
    return y1, y2


@jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, pos_ptr, t, stride_cs, half, BLOCK_D)
    _rotate_in_place(q_ptr, t, stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_H,
                     BLOCK_D)
    _rotate_in_place(k_ptr, t, stride_kt, stride_kh, num_k_heads, half, cos, sin, BLOCK_H,
                     BLOCK_D)


@jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    num_q_heads, num_k_heads, half, head_dim, head_dim_v,
    PAGE_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, pos_ptr, t, stride_cs, half, BLOCK_D)
    _rotate_in_place(q_ptr, t, stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_HQ,
                     BLOCK_D)
    y1, y2 = _rotate_in_place(k_ptr, t, stride_kt, stride_kh, num_k_heads, half, cos, sin,
                              BLOCK_HK, BLOCK_D)
    # the rotated k and the v go to the token's cache slot (slot -1: nothing is written)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads_written = tl.where(slot >= 0, num_k_heads, 0)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok_cache = (hk < heads_written) & (d < half)
    dst = k_cache_ptr + page * stride_kcp + offset * stride_kcs + hk * stride_kch + d
    tl.store(dst, y1, mask=ok_cache)
    tl.store(dst + half, y2, mask=ok_cache)
    if BLOCK_P > 0:  # partial rotary: k's dims [2 * half, head_dim) are copied unrotated
        p = 2 * half + tl.arange(0, BLOCK_P)[None, :]
        k_pass = tl.load(k_ptr + t * stride_kt + hk * stride_kh + p,
                         mask=(hk < num_k_heads) & (p < head_dim), other=0.0)
        dst_p = k_cache_ptr + page * stride_kcp + offset * stride_kcs + hk * stride_kch + p
        tl.store(dst_p, k_pass, mask=(hk < heads_written) & (p < head_dim))
    dv = tl.arange(0, BLOCK_DV)[None, :]
    v = tl.load(v_ptr + t * stride_vt + hk * stride_vh + dv,
                mask=(hk < num_k_heads) & (dv < head_dim_v), other=0.0)
    dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + hk * stride_vch + dv
    tl.store(dst, v, mask=(hk < heads_written) & (dv < head_dim_v))


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """rotary_inplace(positions, q, k, cos_sin), then store_kv(k, v, caches, slot_mapping), in
    one launch. q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv]; caches [pages, page_size, Hk, D];
    cos_sin [P, r], r <= D."""
    t, hq, d = q.shape
    hk, dv = k.shape[1], v.shape[2]
    half = _rotary_half(cos_sin, d)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert cos_sin.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dtype == k.dtype and v_cache.dtype == v.dtype
    if t == 0:
        return
    positions = positions.contiguous()
    _rotary_store_kv_kernel[(t,)](
        q, k, v, cos_sin, positions, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        hq, hk, half, d, dv,
        PAGE_SIZE=k_cache.shape[1], BLOCK_HQ=next_power_of_2(hq), BLOCK_HK=next_power_of_2(hk),
        BLOCK_D=next_power_of_2(half), BLOCK_DV=next_power_of_2(dv),
        BLOCK_P=next_power_of_2(d - 2 * half) if d > 2 * half else 0,
    )  # fmt: skip


def rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cos_sin: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hk, D] (last dim contiguous): their first r dims rotated in place;
    cos_sin [P, r] fp32, r <= D."""
    t, hq, d = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    half = _rotary_half(cos_sin, d)
    if t == 0:
        return
    positions = positions.contiguous()  # an expanded [1, k] reshape is a stride-0 view
    _rotary_kernel[(t,)](
        q, k, cos_sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        hq, k.shape[1], half,
        BLOCK_H=next_power_of_2(max(hq, k.shape[1])), BLOCK_D=next_power_of_2(half),
    )  # fmt: skip


def _rotary_half(cos_sin: torch.Tensor, head_dim: int) -> int:
    """Rotary pairs per head: half the table's width (which may be below head_dim)."""
    rot = cos_sin.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim, (rot, head_dim)
    return rot // 2


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference in fp32 math, rounded to the input dtype; dims past the table's
    width pass through."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, r/2] each
    rot = cos_sin.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
        return torch.cat([rotated, x[..., rot:]], dim=-1)

    return rotate(q), rotate(k)
