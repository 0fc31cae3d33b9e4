"""Writing new tokens' K/V into the paged cache (slot = page * page_size + offset; slot -1:
no write), as a Triton kernel with its torch reference beside it. Attention backends call it
before attending; `kernels.rotary.rotary_store_kv` fuses it with RoPE.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # one program per (token, kv head); slot -1 means "do not write"
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    d = tl.arange(0, BLOCK_D)
    d_end = tl.where(slot >= 0, HEAD_DIM, 0)  # nothing is written for slot -1
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=d < HEAD_DIM)
    dst = k_cache_ptr + page * stride_kcp + offset * stride_kcs + h * stride_kch + d
    tl.store(dst, k, mask=d < d_end)
    dv = tl.arange(0, BLOCK_DV)
    dv_end = tl.where(slot >= 0, HEAD_DIM_V, 0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=dv < HEAD_DIM_V)
    dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + h * stride_vch + dv
    tl.store(dst, v, mask=dv < dv_end)


def store_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim_v]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
) -> None:
    """Write the new tokens' K/V into their cache slots."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dtype == k.dtype and v_cache.dtype == v.dtype
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_V=v.shape[2],
        BLOCK_D=next_power_of_2(head_dim), BLOCK_DV=next_power_of_2(v.shape[2]),
    )  # fmt: skip


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference for `store_kv` (and the torch backend's KV write): cache.flat[slot[t]] = k[t]
    for every t with slot[t] >= 0, through a [num_slots, heads, dim] view of the cache."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))
