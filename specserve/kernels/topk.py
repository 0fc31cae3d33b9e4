"""Top-k log-probabilities of a few long rows (the draft head's vocabulary), in two launches.

    stage 1, one program per (row, chunk of CHUNK columns): the chunk's max and sum of
             exp(x - max), and its k best (value, column) by k rounds of max + argmax
    stage 2, one program per row: log-sum-exp from the chunk statistics, the k best of the
             chunks' candidates, log p = logit - lse

A draft step asks this for a handful of rows over 32k-128k columns; torch.topk runs a radix
select of many small kernels there (plus softmax and reductions): ~45 us per call on the
H200, for work that is a few microseconds of memory traffic (a two-stage torch.topk over
column blocks still cost ~140 us per tree cycle). `top_log_probs_ref` is the torch form, used
on the CPU.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import host_launches, jit, next_power_of_2, tl, triton, use_triton

CHUNK = 1024  # columns per stage-1 program
MAX_K = 16  # k beyond this takes the torch path


@jit
def _chunk_topk_kernel(
    x_ptr, vals_ptr, cols_ptr, stat_ptr, num_cols, num_chunks, stride_x,
    K: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_COLS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, CHUNK_COLS)
    cols = chunk * CHUNK_COLS + offs
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < num_cols,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    m = tl.max(x, 0)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), 0)  # 0 for an all -inf chunk
    stat = stat_ptr + (row * num_chunks + chunk) * 2
    tl.store(stat, m)
    tl.store(stat + 1, s)
    kk = tl.arange(0, BLOCK_K)
    best_v = tl.full([BLOCK_K], float("-inf"), tl.float32)
    best_c = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(K):
        v = tl.max(x, 0)
        j = tl.argmax(x, 0)  # the lowest column among equal values
        best_v = tl.where(kk == i, v, best_v)
        best_c = tl.where(kk == i, chunk * CHUNK_COLS + j, best_c)
        x = tl.where(offs == j, float("-inf"), x)
    out = (row * num_chunks + chunk) * K + kk
    tl.store(vals_ptr + out, best_v, mask=kk < K)
    tl.store(cols_ptr + out, best_c, mask=kk < K)


@jit
def _merge_topk_kernel(
    vals_ptr, cols_ptr, stat_ptr, logp_ptr, ids_ptr, num_chunks,
    K: tl.constexpr, BLOCK_CAND: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_CHUNKS)
    c_ok = c < num_chunks
    stat = stat_ptr + (row * num_chunks + c) * 2
    m = tl.load(stat, mask=c_ok, other=float("-inf"))
    s = tl.load(stat + 1, mask=c_ok, other=0.0)
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(tl.where(s > 0, s * tl.exp(m - big), 0.0), 0))
    n = tl.arange(0, BLOCK_CAND)
    n_ok = n < num_chunks * K
    v = tl.load(vals_ptr + row * num_chunks * K + n, mask=n_ok, other=float("-inf"))
    col = tl.load(cols_ptr + row * num_chunks * K + n, mask=n_ok, other=0)
    # candidates come chunk by chunk, each chunk's equal values in column order, so the lowest
    # index among equal values is the lowest column: ties go to the lower token id
    for i in tl.static_range(K):
        best = tl.max(v, 0)
        j = tl.argmax(v, 0)
        pick = tl.sum(tl.where(n == j, col, 0), 0)
        tl.store(logp_ptr + row * K + i, best - lse)
        tl.store(ids_ptr + row * K + i, pick.to(tl.int64))
        v = tl.where(n == j, float("-inf"), v)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, V] logits -> the k best log-probs [rows, k] float32 (descending) and their
    token ids [rows, k] int64. Two Triton launches on CUDA (and under TRITON_INTERPRET), else
    `top_log_probs_ref`."""
    rows, v = logits.shape
    if not (use_triton(logits) or host_launches()) or not 1 <= k <= min(MAX_K, v) or rows == 0:
        return top_log_probs_ref(logits, k)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_chunks = triton.cdiv(v, CHUNK)
    dev = logits.device
    vals = torch.empty(rows, num_chunks * k, dtype=torch.float32, device=dev)
    cols = torch.empty(rows, num_chunks * k, dtype=torch.int32, device=dev)
    stats = torch.empty(rows, num_chunks, 2, dtype=torch.float32, device=dev)
    logp = torch.empty(rows, k, dtype=torch.float32, device=dev)
    ids = torch.empty(rows, k, dtype=torch.int64, device=dev)
    block_k = next_power_of_2(k)
    _chunk_topk_kernel[(rows, num_chunks)](
        logits, vals, cols, stats, v, num_chunks, logits.stride(0),
        K=k, BLOCK_K=block_k, CHUNK_COLS=CHUNK,
    )  # fmt: skip
    _merge_topk_kernel[(rows,)](
        vals, cols, stats, logp, ids, num_chunks,
        K=k, BLOCK_CAND=next_power_of_2(num_chunks * k),
        BLOCK_CHUNKS=next_power_of_2(num_chunks),
    )  # fmt: skip
    return logp, ids


def top_log_probs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of `top_log_probs` (and the CPU path)."""
    return logits.float().log_softmax(dim=-1).topk(k, dim=-1)
