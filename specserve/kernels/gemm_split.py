"""Launch shapes for the quantized GEMMs, and the split-K reduction.

At decode sizes (few rows) a GEMM has too few output tiles to occupy every SM, and a weight
stream needs most SMs reading to approach the memory bandwidth: the K dimension is then split
over several programs writing fp32 partials [splits, M, N], summed in a fixed order by one more
launch (deterministic, unlike atomics).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import jit, tl, triton

PARTIALS_PER_SM = 2  # aim for this many programs per SM at decode sizes
MAX_SPLITS = 16


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small but non-trivial splits
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class GemmPlan:
    """Tile sizes, K splits and launch parameters of one quantized GEMM."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def k_per_split(self, k: int) -> tuple[int, int]:
        """(K elements per split, a multiple of block_k; the number of splits that remain)."""
        per = -(-k // (self.splits * self.block_k)) * self.block_k
        return per, -(-k // per)


def as_plan(plan: GemmPlan | tuple | None) -> GemmPlan | None:
    return GemmPlan(*plan) if isinstance(plan, tuple) else plan


def launch_plan(m: int, n: int, k: int, device: torch.device, max_block_k: int = 128) -> GemmPlan:
    """The default plan for an [m, k] x [k, n] product."""
    if m <= 16:
        bm, bn = 16, 64
    elif m <= 64:
        bm, bn = 64, 64
    else:
        bm, bn = 128, 128
    bk = min(max_block_k, 128)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    target = PARTIALS_PER_SM * num_sms(device)
    splits = 1
    if tiles < target:
        # at least 4 K steps per split so each program still pipelines its loads
        splits = max(1, min(triton.cdiv(target, tiles), steps // 4, MAX_SPLITS))
    return GemmPlan(bm, bn, bk, splits)


@jit
def _reduce_kernel(p_ptr, out_ptr, numel, splits, stride_s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(p_ptr + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def reduce_splits(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[splits, M, N] fp32 partial products -> [M, N] in out_dtype, summed in split order."""
    splits, m, n = partials.shape
    out = torch.empty(m, n, dtype=out_dtype, device=partials.device)
    numel = m * n
    if numel:
        block = 1024
        _reduce_kernel[(triton.cdiv(numel, block),)](
            partials, out, numel, splits, partials.stride(0), BLOCK=block
        )
    return out
