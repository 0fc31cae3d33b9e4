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
    stride_xb, stride_xm, stride_wb, stride_wn, stride_wk, stride_yb, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)  # one product per batch index (exact_bmm)
    x_ptr += batch * stride_xb
    w_ptr += batch * stride_wb
    y_ptr += batch * stride_yb
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
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None] * stride_wk,
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
    _launch(x2[None], w[None], bias, y[None])
    return y.reshape(*shape[:-1], n)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            y: torch.Tensor) -> None:
    """y[b] = x[b] @ w[b]^T (+ bias) for x [B, M, K] (unit K stride), w [B, N, K] (any
    strides), y [B, M, N] (unit N stride): the EXACT_TILE launch, one grid layer per b."""
    (nb, m, k), n = x.shape, w.shape[1]
    bm, bn, bk, warps, stages = EXACT_TILE
    _exact_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), nb)](
        x, w, bias if bias is not None else w, y, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def exact_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h: x[:, h] @ w[h]^T for x [T, H, K], w [H, N, K] (any strides) -> [T, H, N],
    each (row, head) through the same reduction whatever T is: the M-invariant form of MLA's
    per-head W_UK / W_UV products. Triton on CUDA (exact_bgemm); one row at a time elsewhere."""
    return exact_bgemm(x, w) if use_triton(x, w) else rowwise_bmm(x, w)


def exact_bgemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """exact_bmm with the EXACT_TILE launch, one grid layer per head (Triton)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = x.new_empty(x.shape[0], x.shape[1], w.shape[1])
    if x.shape[0]:
        _launch(x.transpose(0, 1), w, None, y.transpose(0, 1))
    return y


def rowwise_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """exact_bmm's CPU form: each row t through the same [H, 1, K] x [H, K, N] call."""
    y = x.new_empty(x.shape[0], x.shape[1], w.shape[1])
    wt = w.transpose(1, 2)
    for t in range(x.shape[0]):
        y[t] = torch.bmm(x[t][:, None], wt)[:, 0]
    return y


def exact_bmm_ref(x: torch.Tensor, w: torch.Tensor, block_k: int = 64) -> torch.Tensor:
    """Reference of exact_bgemm: exact_gemm_ref per head."""
    return torch.stack([exact_gemm_ref(x[:, h], w[h], None, block_k) for h in range(x.shape[1])],
                       dim=1)


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
