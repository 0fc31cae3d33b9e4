"""M-invariant dense GEMM for exact mode: y = x W^T (+ b), a row's result independent of M.

cuBLAS (and torch's CPU matmul) pick their algorithm from the problem shape: a different tile,
a split-K for few rows, a GEMV for one row, each rounding the K reduction differently, so a row
computed with 1 other row and with 63 others can differ in its last bits. This kernel has one
configuration for every M (EXACT_TILE: BLOCK_M x BLOCK_N x BLOCK_K, warps, stages) and no
split-K: each output tile accumulates its K blocks in fp32 in ascending order, one program per
tile, and a row's tile holds the same row of x against the same W columns whatever M is.

On the CPU, `exact_linear` computes one row at a time (`F.linear` of a [1, K] input, the same
call for every row whatever the batch): torch's CPU GEMM chooses its blocking and kernels from
M, so a batched product is not row-invariant there (tests/test_exact.py checks both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.dispatch import jit, tl, triton, use_triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the one launch of every exact GEMM
EXACT_TILE = (64, 32, 64, 4, 4)  # narrow N tiles: a one-row GEMM still fills the SMs


@jit
def _exact_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending K blocks: the same order for every M
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
            mask=(rm < M)[:, None] & (kk < K)[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None],
            mask=(rn < N)[None, :] & (kk < K)[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def exact_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ bias [N]) with the fixed EXACT_TILE launch (Triton)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = x2.new_empty(m, n)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    bm, bn, bk, warps, stages = EXACT_TILE
    _exact_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, w, bias if bias is not None else w, y, m, n, k,
        x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y.reshape(*shape[:-1], n)


def exact_gemm_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, block_k: int = 64
) -> torch.Tensor:
    """Reference of exact_gemm: fp32 accumulation over K blocks in ascending order, then bias,
    then one rounding to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    acc = torch.zeros(x2.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for k0 in range(0, x2.shape[1], block_k):
        acc += x2[:, k0 : k0 + block_k] @ w[:, k0 : k0 + block_k].float().T
    if bias is not None:
        acc += bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def rowwise_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear one row at a time: every row goes through the same [1, K] call."""
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.new_empty(x2.shape[0], w.shape[0])
    for i in range(x2.shape[0]):
        y[i] = F.linear(x2[i : i + 1].clone(), w, bias)[0]
    return y.reshape(*x.shape[:-1], w.shape[0])


def exact_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The M-invariant linear of exact mode: the Triton kernel on CUDA, row at a time else."""
    if use_triton(x, w):
        return exact_gemm(x, w, bias)
    return rowwise_linear(x, w, bias)
