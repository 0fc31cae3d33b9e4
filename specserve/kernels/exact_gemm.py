"""M-invariant dense GEMM for exact mode: y = x W^T (+ b), a row's result independent of M.

cuBLAS (and torch's CPU matmul) pick their algorithm from the problem shape: a different tile,
a split-K for few rows, a GEMV for one row, each rounding the K reduction differently, so a row
computed with 1 other row and with 63 others can differ in its last bits. This kernel has one
configuration for every M (EXACT_TILE: BLOCK_M x BLOCK_N x BLOCK_K, warps, stages): each
output tile accumulates its K blocks in fp32 in ascending order, and a row's tile holds the same
row of x against the same W columns whatever M is. A 2-D product with few column tiles splits
K into a number of chunks chosen from N, K and the GPU (exact_splits), never from M: each chunk
accumulates in ascending order and the last program of a tile to finish sums the chunks in
chunk order (gemm_split.store_tile), so a one-row GEMM still occupies the SMs and a row's
reduction is still the same in any batch.

On the CPU, `exact_linear` computes one row at a time (`F.linear` of a [1, K] input, the same
call for every row whatever the batch): torch's CPU GEMM chooses its blocking and kernels from
M, so a batched product is not row-invariant there (tests/test_exact.py checks both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.dense_gemm import dense_gemm, launch
from specserve.kernels.dispatch import triton, use_triton
from specserve.kernels.gemm_split import MAX_SPLITS, PARTIALS_PER_SM, GemmPlan, num_sms

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the one launch of every exact GEMM
EXACT_TILE = (64, 32, 64, 4, 4)  # narrow N tiles: a one-row GEMM still fills the SMs
EXACT_MIN_K_BLOCKS = 8  # K blocks one split accumulates at least (its loads still pipeline)


def exact_splits(n: int, k: int, device: torch.device) -> int:
    """K chunks of a 2-D exact GEMM of N columns: enough programs for PARTIALS_PER_SM per SM
    when the column tiles alone are fewer, each chunk at least EXACT_MIN_K_BLOCKS blocks; a
    function of N, K and the device only (never M), so the reduction is batch-invariant."""
    bn, bk = EXACT_TILE[1], EXACT_TILE[2]
    tiles, target = triton.cdiv(n, bn), PARTIALS_PER_SM * num_sms(device)
    if tiles >= target:
        return 1
    return max(1, min(triton.cdiv(target, tiles), triton.cdiv(k, bk) // EXACT_MIN_K_BLOCKS,
                      MAX_SPLITS))


def exact_plan(n: int, k: int, batched: bool, device: torch.device) -> GemmPlan:
    """The EXACT_TILE launch of an N x K product (K chunks for one 2-D product only)."""
    bm, bn, bk, warps, stages = EXACT_TILE
    return GemmPlan(bm, bn, bk, 1 if batched else exact_splits(n, k, device), warps, stages)


def exact_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ bias [N]) with the fixed EXACT_TILE launch (Triton)."""
    return dense_gemm(x, w, bias, exact_plan(w.shape[0], x.shape[-1], False, x.device))


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
        launch(x.transpose(0, 1), w, None, y.transpose(0, 1),
               exact_plan(w.shape[1], x.shape[2], True, x.device))
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
