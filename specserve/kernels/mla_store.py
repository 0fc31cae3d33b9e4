"""Writing new tokens into the MLA latent cache, with RoPE on the rope part: a Triton kernel
and its torch reference (the kv_store / rotary_store_kv analogue for KVCacheSpec.mla).

Per token t at position p: q_pe[t] [N, R] is rotated in place, and the row
[c_kv[t] (L) | rot(k_pe[t]) (R)] goes to latent_cache [num_pages, page_size, L + R] at slot
slot_mapping[t] = page * page_size + offset (-1: no write). Rope pair i, rotated by the angle
of frequency i, is (x[2i], x[2i + 1]) for checkpoints laid out interleaved (DeepSeek, Kimi,
GLM-5) or (x[i], x[i + R/2]) for rotate-half layouts; it stays where it is. cos/sin come from
a [positions, R] fp32 table [cos | sin] (layers/rotary.py; yarn's attention factor included).
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl


@jit
def _rope_pair_offsets(d, half, INTERLEAVED: tl.constexpr):
    """Offsets of the two elements of rope pair d: (2d, 2d + 1) or (d, d + half)."""
    if INTERLEAVED:
        return 2 * d, 2 * d + 1
    return d, d + half


@jit
def _mla_store_kernel(
    q_pe_ptr, c_kv_ptr, k_pe_ptr, cos_sin_ptr, pos_ptr, slot_ptr, cache_ptr,
    stride_qt, stride_qh, stride_ct, stride_kt, stride_cs, stride_cp, stride_cslot,
    num_heads, rank, half,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    # one program per token: q_pe rotated in place, [c_kv | rot(k_pe)] to the token's slot
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d_ok, other=0.0)
    i1, i2 = _rope_pair_offsets(d, half, INTERLEAVED)
    h = tl.arange(0, BLOCK_H)[:, None]
    ok = (h < num_heads) & d_ok[None, :]
    q1_ptr = q_pe_ptr + t * stride_qt + h * stride_qh + i1[None, :]
    q2_ptr = q_pe_ptr + t * stride_qt + h * stride_qh + i2[None, :]
    x1 = tl.load(q1_ptr, mask=ok, other=0.0)
    x2 = tl.load(q2_ptr, mask=ok, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(q1_ptr, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=ok)
    tl.store(q2_ptr, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=ok)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    rank_end = tl.where(slot >= 0, rank, 0)  # slot -1: nothing is written
    half_end = tl.where(slot >= 0, half, 0)
    row = cache_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cslot
    dt = cache_ptr.dtype.element_ty
    dl = tl.arange(0, BLOCK_L)
    c = tl.load(c_kv_ptr + t * stride_ct + dl, mask=dl < rank, other=0.0)
    tl.store(row + dl, c.to(dt), mask=dl < rank_end)
    k1 = tl.load(k_pe_ptr + t * stride_kt + i1, mask=d_ok, other=0.0)
    k2 = tl.load(k_pe_ptr + t * stride_kt + i2, mask=d_ok, other=0.0)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    # rounded to k_pe's dtype first, as the reference rotates in the activation dtype
    tl.store(row + rank + i1, (k1f * cos - k2f * sin).to(k1.dtype).to(dt), mask=d < half_end)
    tl.store(row + rank + i2, (k2f * cos + k1f * sin).to(k1.dtype).to(dt), mask=d < half_end)


def mla_store(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos_sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
) -> None:
    """Rotate q_pe [T, N, R] in place and write [c_kv [T, L] | rot(k_pe) [T, R]] to
    latent_cache [pages, page_size, L + R] at slot_mapping (-1: skip); cos_sin [P, R] fp32.
    One launch."""
    t, num_heads, rope = q_pe.shape
    rank = c_kv.shape[-1]
    assert latent_cache.shape[-1] == rank + rope and rope % 2 == 0
    assert q_pe.stride(-1) == 1 and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    assert latent_cache.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if t == 0:
        return
    _mla_store_kernel[(t,)](
        q_pe, c_kv, k_pe, cos_sin, positions.contiguous(), slot_mapping, latent_cache,
        q_pe.stride(0), q_pe.stride(1), c_kv.stride(0), k_pe.stride(0), cos_sin.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), num_heads, rank, rope // 2,
        PAGE_SIZE=latent_cache.shape[1], BLOCK_H=next_power_of_2(num_heads),
        BLOCK_L=next_power_of_2(rank), BLOCK_HALF=next_power_of_2(rope // 2),
        INTERLEAVED=interleaved,
    )  # fmt: skip


def rotate_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, heads, R] rotated by per-token cos/sin [T, R/2] (fp32 math, x's dtype out).
    Pair i is (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2]); it stays in place."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        return torch.stack((y1, y2), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


def mla_store_ref(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos_sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
) -> None:
    """Reference for `mla_store`: q_pe [T, N, R] rotated in place; latent_cache.flat[slot[t]] =
    [c_kv[t] | rot(k_pe[t])] for every t with slot[t] >= 0. c_kv [T, L], k_pe [T, R]."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, R/2] each
    q_pe.copy_(rotate_rope(q_pe, cos, sin, interleaved))
    k_rot = rotate_rope(k_pe[:, None, :], cos, sin, interleaved)[:, 0]
    rows = torch.cat([c_kv, k_rot], dim=-1).to(latent_cache.dtype)  # [T, L + R]
    valid = slot_mapping >= 0
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    flat.index_copy_(0, slot_mapping[valid].long(), rows[valid])
