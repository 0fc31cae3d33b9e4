"""Flash-decoding split helpers for the paged-attention kernel (kernels/paged_attention.py).

The attention launch cuts each tile's KV range into `num_splits` chunks; each split writes a
partial output and its log-sum-exp, and `_combine_splits_kernel` merges them (or, with
`fused_combine`, the last split of each tile does, through the arrival counters kept here).
`default_num_splits` picks the split count from the grid alone, so captured CUDA graphs keep a
valid one. `split_buffers` and `combine_splits` are the launchers' side of it (paged MHA, MLA,
sparse MLA).
"""

from __future__ import annotations

import functools

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl

MAX_SPLITS = 16  # upper bound on KV splits per (request, query block, kv head)
SPLIT_BLOCK = 32  # the fused combine's split vector: counts up to it in one compiled kernel
MIN_COUNTERS = 4096  # smallest arrival-counter buffer (int32 entries, one per tile)


@jit
def _combine_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse); one program per (t, h).
    # The split count stays a constant here (a small kernel, a compile per power of two): all
    # splits in one [BLOCK_S, BLOCK_DV] load. Read at run time, one split a step cost +1.5 us
    # a call at 32 splits, 16 splits a step +2.5 us at 2 (H100, Llama-3.1-8B heads).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(
        mid_lse_ptr + t * stride_mlt + h * stride_mlh + s,
        mask=s < NUM_SPLITS,
        other=float("-inf"),
    )  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    o = tl.load(
        mid_o_ptr + t * stride_mot + h * stride_moh + s[:, None] * stride_mos + dv[None, :],
        mask=(s[:, None] < NUM_SPLITS) & (w[:, None] > 0) & (dv[None, :] < HEAD_DIM_V),
        other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    total = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dv, o.to(out_ptr.dtype.element_ty),
             mask=dv < HEAD_DIM_V)  # fmt: skip


def split_block(num_splits: int) -> int:
    """The split vector a kernel combining num_splits partials holds: SPLIT_BLOCK for every
    count the default plans take (one compiled kernel for all of them), larger only for an
    exact mode's fixed count past it."""
    return max(SPLIT_BLOCK, next_power_of_2(num_splits))


_unused: dict[torch.device, torch.Tensor] = {}  # device -> the one-split launches' fp32 dummies


def split_buffers(
    out: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(partial outputs [T, N, S, D] fp32, their log2-sum-exps [T, N, S] fp32, the five strides
    a kernel takes: o's t, n, s and lse's t, n) of a launch into out [T, N, D] whose tiles
    split their KV num_splits ways. One split: two one-element fp32 buffers and zero strides
    (unused: the kernel writes out itself; fp32 as the split buffers, so a kernel compiled for
    several splits serves one split too)."""
    if num_splits == 1:
        unused = _unused.get(out.device)
        if unused is None:  # kept for the process: no allocation a launch
            unused = _unused[out.device] = torch.empty(8, dtype=torch.float32, device=out.device)
        return unused[:1], unused[4:5], (0, 0, 0, 0, 0)  # both 16-byte aligned, as a split's
    t, n, d = out.shape
    mid_o = out.new_empty(t, n, num_splits, d, dtype=torch.float32)
    # the split axis padded to 16 entries: the strides stay multiples of 16 whatever the count
    # (Triton specializes integer arguments on divisibility by 16: one compile, not two)
    mid_lse = out.new_empty(t, n, -(-num_splits // 16) * 16, dtype=torch.float32)
    return mid_o, mid_lse, (*mid_o.stride()[:3], *mid_lse.stride()[:2])


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """The combine launch: out [T, N, D] <- the splits' partial outputs merged by weight."""
    num_tokens, num_heads, head_dim_v = out.shape
    num_splits = mid_o.shape[2]
    _combine_splits_kernel[(num_tokens, num_heads)](
        mid_o, mid_lse, out,
        *mid_o.stride()[:3], *mid_lse.stride()[:2], out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=next_power_of_2(head_dim_v),
    )  # fmt: skip


_split_counters: dict[torch.device, torch.Tensor] = {}  # device -> zeroed int32 counters
_kept_counters: list[torch.Tensor] = []  # buffers a captured CUDA graph may still point at


def split_counters(size: int, device: torch.device) -> torch.Tensor:
    """The device's arrival-counter buffer (int32, all zeros between launches), >= size entries.

    Allocated once and reused: every fused launch resets the counters it used, so the buffer is
    zeroed again when the launch ends, and a CUDA graph that captured it finds it zeroed at each
    replay. It only grows (never shrinks) and a replaced buffer is kept alive, since a captured
    graph may still use it. Growing while a CUDA graph is being captured allocates a buffer of
    that graph's own (its zero-fill is captured and runs at every replay), kept alive but not
    cached: outside the graph its contents were never written. Launches sharing the buffer must
    not overlap (one stream at a time).
    """
    buf = _split_counters.get(device)
    if buf is not None and buf.numel() >= size:
        return buf
    size = max(size, MIN_COUNTERS, 2 * buf.numel() if buf is not None else 0)
    new = torch.zeros(size, dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _kept_counters.append(new)
        return new
    if buf is not None:
        _kept_counters.append(buf)
    _split_counters[device] = new
    return new


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_programs: int, device: torch.device,
                       max_splits: int = MAX_SPLITS) -> int:
    """KV splits so that about two waves of programs cover the GPU, rounded down to a power
    of two.

    Depends only on the grid (batch size, heads, query blocks), never on sequence lengths, so a
    captured CUDA graph keeps a valid split count; splits past a short sequence exit at once.
    The attention kernels read the split count from their grid at run time (it once was a
    constant: every distinct value compiled the kernel again, 1-2 s inside a serving step,
    whenever an eager step met a new one); powers of two are what the plans were measured with.
    """
    splits = max(1, min(max_splits, 2 * _num_sms(device) // max(num_programs, 1)))
    return 1 << (splits.bit_length() - 1)
