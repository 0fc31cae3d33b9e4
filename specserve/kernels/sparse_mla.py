"""DeepSeek sparse attention (DSA), the attention half: absorbed-form MLA of each query over
the cache slots its indexer selected (kernels/dsa_index.py), a Triton kernel and its torch
reference.

Per query token t and head n, over the selected slots S_t (slot -1: nothing):
    s_j   = (q_lat[t, n] . c_j + q_pe[t, n] . k_pe_j) * scale      j in S_t
    o_lat = sum_j softmax(s)_j c_j                                 [L]
with the latent cache [num_pages, page_size, L + R] of layers/mla.py (rows [c_kv | k_pe]).
Unlike dense MLA no two queries share their KV rows, so a program owns one token, a block of
heads and a split of its k selected slots; splits merge through kernels/split_kv.py's combine.
Launch shapes depend on (T, N, k) only: decode and verify launches are CUDA-graph capturable;
in exact mode the split count depends on k alone (a token's result never on its batch).
"""

from __future__ import annotations

import torch

from specserve.kernels.attention_tiles import _normalize, _softmax_step
from specserve.kernels.dispatch import EXACT, jit, next_power_of_2, tl
from specserve.kernels.split_kv import combine_splits, default_num_splits, split_buffers

MIN_DOT = 16
LOG2E = 1.4426950408889634
REF_CHUNK_VALUES = 1 << 24  # the torch path gathers [tokens, k, L + R] rows per chunk


def sparse_mla_ref(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch form of `sparse_mla_attention`, fp32 math: q_lat [T, N, L], q_pe [T, N, R],
    slots [T, k] int64 -> o_lat [T, N, L]; a token with no slot outputs 0. Graph-safe."""
    rank = q_lat.shape[-1]
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    out = torch.empty_like(q_lat)
    chunk = max(1, REF_CHUNK_VALUES // (slots.shape[1] * flat.shape[-1]))
    for a in range(0, q_lat.shape[0], chunk):  # host ints only: the same launches every replay
        sl = slots[a : a + chunk]
        rows = flat[sl.clamp(min=0)].float()  # [c, k, L + R]
        c, pe = rows[..., :rank], rows[..., rank:]
        scores = (
            torch.einsum("tnl,tkl->tnk", q_lat[a : a + chunk].float(), c)
            + torch.einsum("tnr,tkr->tnk", q_pe[a : a + chunk].float(), pe)
        ) * scale
        scores = scores.masked_fill((sl < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(-1).nan_to_num(0.0)
        out[a : a + chunk] = torch.einsum("tnk,tkl->tnl", probs, c).to(out.dtype)
    return out


@jit
def _sparse_mla_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, slots_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, num_heads, rank, rope, topk,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_cp, stride_cs, stride_st,
    stride_ot, stride_oh, stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # a program owns (token, block of BLOCK_H heads, split of the token's k slots)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2) if SPLIT else 1  # at run time: a new count compiles nothing
    h_ok = head < num_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    q_lat = tl.load(
        q_lat_ptr + t * stride_qt + head[:, None] * stride_qh + dl[None, :],
        mask=h_ok[:, None] & (dl[None, :] < rank),
        other=0.0,
    )  # [BLOCK_H, BLOCK_L]
    q_pe = tl.load(
        q_pe_ptr + t * stride_pt + head[:, None] * stride_ph + dr[None, :],
        mask=h_ok[:, None] & (dr[None, :] < rope),
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    split_len = tl.cdiv(tl.cdiv(topk, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, topk)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + t * stride_st + j, mask=j < hi, other=-1).to(tl.int64)
        ok = slot >= 0
        base = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs  # [BLOCK_N]
        c = tl.load(
            cache_ptr + base[:, None] + dl[None, :],
            mask=ok[:, None] & (dl[None, :] < rank),
            other=0.0,
        )  # [BLOCK_N, BLOCK_L]
        pe = tl.load(
            cache_ptr + base[:, None] + rank + dr[None, :],
            mask=ok[:, None] & (dr[None, :] < rope),
            other=0.0,
        )
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        qk += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        qk = tl.where(ok[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        p, alpha, l_i, m_i = _softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    o, lse = _normalize(acc, m_i, l_i)  # a head that saw no slot outputs 0
    o_mask = h_ok[:, None] & (dl[None, :] < rank)
    if not SPLIT:
        dst = out_ptr + t * stride_ot + head[:, None] * stride_oh + dl[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        mid = t * stride_mot + head * stride_moh
        tl.store(mid_o_ptr + mid[:, None] + split * stride_mos + dl[None, :], o, mask=o_mask)
        tl.store(mid_lse_ptr + t * stride_mlt + head * stride_mlh + split, lse, mask=h_ok)


def sparse_mla_attention(
    q_lat: torch.Tensor,  # [T, N, L]
    q_pe: torch.Tensor,  # [T, N, R] (rotated)
    latent_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    slots: torch.Tensor,  # [T, k] int64, -1: no slot
    scale: float,
    num_splits: int | None = None,
    block_n: int = 32,
    block_h: int = 16,
) -> torch.Tensor:
    """Absorbed-form attention of each token over its selected slots (module docstring):
    -> o_lat [T, N, L]. One launch, plus the combine when the slots are split."""
    num_tokens, num_heads, rank = q_lat.shape
    rope, topk = q_pe.shape[-1], slots.shape[1]
    assert latent_cache.shape[-1] == rank + rope and slots.shape[0] == num_tokens
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.stride(-1) == 1
    out = q_lat.new_empty(num_tokens, num_heads, rank)
    if num_tokens == 0:
        return out
    slots = slots.contiguous()
    block_h = max(min(block_h, next_power_of_2(num_heads)), MIN_DOT)
    head_blocks = -(-num_heads // block_h)
    if num_splits is None and EXACT.attention:  # a token's splits never depend on the batch
        num_splits = -(-topk // EXACT.kv_split_tokens)
    if num_splits is None:
        num_splits = default_num_splits(num_tokens * head_blocks, q_lat.device)
    num_splits = max(1, min(num_splits, -(-topk // block_n)))
    mid_o, mid_lse, mid_strides = split_buffers(out, num_splits)
    _sparse_mla_kernel[(num_tokens, head_blocks, num_splits)](
        q_lat, q_pe, latent_cache, slots, out, mid_o, mid_lse,
        scale * LOG2E, num_heads, rank, rope, topk,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), slots.stride(0),
        out.stride(0), out.stride(1),
        *mid_strides,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_L=max(next_power_of_2(rank), MIN_DOT),
        BLOCK_R=max(next_power_of_2(rope), MIN_DOT), PAGE_SIZE=latent_cache.shape[1],
        SPLIT=num_splits > 1, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else None,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits(mid_o, mid_lse, out)
    return out
