"""The dense Triton GEMM y = x W^T (+ b) under a launch plan, with split-K for few rows.

One kernel, two users: exact mode launches it with one fixed plan for every row count
(kernels/exact_gemm.py: a row's reduction independent of the batch), and the dense linear
layers launch it with a plan measured on this GPU model (kernels/plan_table.py, format "bf16" /
"fp16") at the decode row counts where it beat cuBLAS: at few rows a weight-streaming GEMM is
bound by how many bytes each SM keeps in flight, which split-K over every SM and a deeper
pipeline decide; cuBLAS's heuristic does not always pick that. Without a measured plan the
layers keep `F.linear`.

A plan's BLOCK_M of 16 or more accumulates on tensor cores (tl.dot); BLOCK_M 1 is a GEMV: the
fp32 products [BLOCK_K, BLOCK_N] add up in registers and are summed over K once, after the loop.
With splits > 1 each program accumulates one K chunk in ascending order and the tile's last
program to finish sums the chunks in chunk order (gemm_split.store_tile): deterministic.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, tl, triton
from specserve.kernels.gemm_split import GemmPlan, split_buffers, store_tile


@jit
def _dense_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, counter_ptr, M, N, K, k_per_split, splits,
    stride_xb, stride_xm, stride_wb, stride_wn, stride_wk, stride_yb, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # program (m tile, n tile, batch index or, with SPLIT, K chunk of the one product)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SPLIT:
        batch = 0
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    else:
        batch = tl.program_id(2).to(tl.int64)  # one product per batch index (exact_bmm)
        k_start = 0
        k_end = K
    x_ptr += batch * stride_xb
    w_ptr += batch * stride_wb
    y_ptr += batch * stride_yb
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:  # GEMV: products in registers, summed over K after the loop
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # ascending K blocks: the same for every M
        kk = k0 + rk
        w = tl.load(
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(rn < N)[None, :] & (kk < k_end)[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if BLOCK_M == 1:
            x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + kk, mask=kk < k_end, other=0.0)
            acc += x.to(tl.float32)[:, None] * w.to(tl.float32)
        else:
            x = tl.load(
                x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                mask=(rm < M)[:, None] & (kk < k_end)[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=0)[None, :]
    else:
        out = acc
    if HAS_BIAS:
        if k_start == 0:  # with SPLIT: the first chunk's partial, summed first
            out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    # stores out, or (SPLIT) the chunk's partial and, last to arrive, the chunks' ordered sum
    store_tile(out, y_ptr, p_ptr, counter_ptr, rm, rn, M, N, stride_ym, splits, SPLIT)


def launch(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, plan: GemmPlan
) -> None:
    """y[b] = x[b] @ w[b]^T (+ bias) for x [B, M, K] (unit K stride), w [B, N, K] (any
    strides), y [B, M, N] (unit N stride), one grid layer per b; plan.splits K chunks (B == 1
    only) of a multiple of plan.block_k each."""
    (nb, m, k), n = x.shape, w.shape[1]
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    splits = plan.splits if nb == 1 else 1
    per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, per)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), nb if splits == 1 else splits)
    partials, counters = split_buffers(m, n, grid[0] * grid[1], splits, x.device)
    _dense_gemm_kernel[grid](
        x, w, bias if bias is not None else w, y, partials, counters, m, n, k, per, splits,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip


def dense_gemm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, plan: GemmPlan
) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ bias [N]) with the Triton kernel under plan."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = x2.new_empty(x2.shape[0], w.shape[0])
    if x2.shape[0]:
        launch(x2[None], w[None], bias, y[None], plan)
    return y.reshape(*shape[:-1], w.shape[0])


def plan_format(dtype: torch.dtype) -> str | None:
    """The plan-table format of a dense weight dtype (None: no measured plans)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
