"""Launch shapes for the quantized GEMMs, and the split-K reduction.

At decode sizes (few rows) a GEMM has too few output tiles to occupy every SM, and a weight
stream needs most SMs reading to approach the memory bandwidth: the K dimension is then split
over several programs writing fp32 partials [splits, M, N]; the last program of each output
tile to finish sums them in split order (deterministic, unlike atomic adds) and stores the tile,
in the same launch (arrival counters shared with attention: kernels/split_kv.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import EXACT, jit, tl, triton
from specserve.kernels.split_kv import split_counters

PARTIALS_PER_SM = 2  # aim for this many programs per SM at decode sizes
MAX_SPLITS = 16
# up to this many rows an FP8 GEMM's default plan is a GEMV (acc_add without tensor cores):
# on the H200 it halved the Llama-3.1-8B FP8 decode step at bs 1 (11.2 -> 5.6 ms); the W4A16
# GEMV kernel did not beat the tensor-core tiles there (10.6 vs 10.0 ms), so W4A16 asks for
# none. SPECSERVE_GEMV_MAX_ROWS=0 keeps every launch on tensor-core tiles (A/B runs).
GEMV_MAX_ROWS = int(os.environ.get("SPECSERVE_GEMV_MAX_ROWS", "1"))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small but non-trivial splits
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _max_shared(device_index: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use (the opt-in maximum: 227 KB on Hopper and
    B200, 99 KB on sm_89 and RTX Blackwell); unbounded for the interpreter."""
    if device.type != "cuda":
        return 1 << 30
    return _max_shared(device.index if device.index is not None else torch.cuda.current_device())


def fp8_native(device: torch.device) -> bool:
    """Whether Triton has the e4m3 type on this device (compute capability 8.9 or later: Ada,
    Hopper, Blackwell); True off CUDA (the interpreter emulates it)."""
    if device.type != "cuda":
        return True
    return _has_e4m3(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_e4m3(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


# shared memory beyond the staged operand tiles (epilogue layout conversions, barriers): what
# Triton's compiled GEMMs here used on top of stages x tile bytes, rounded up
SHARED_ALLOWANCE = 32 * 1024


def fit_shared(bm: int, bn: int, bk: int, stages: int, a_bytes: float, b_bytes: float,
               device: torch.device, shrink_m: bool = True) -> tuple[int, int, int]:
    """(block_m, block_n, stages) whose staged A and B tiles fit the device's shared memory:
    fewer stages down to 2, then a narrower M tile (down to 64, if shrink_m) and N tile (down
    to 32), then one stage. On the H200 every default plan fits as it is."""
    limit = max_shared_memory(device) - SHARED_ALLOWANCE

    def need(m: int, n: int, s: int) -> float:
        return s * bk * (m * a_bytes + n * b_bytes)

    while need(bm, bn, stages) > limit:
        if stages > 2:
            stages -= 1
        elif shrink_m and bm > 64:
            bm //= 2
        elif bn > 32:
            bn //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return bm, bn, stages


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


def launch_plan(m: int, n: int, k: int, device: torch.device, max_block_k: int = 128,
                a_bytes: float = 2, b_bytes: float = 1,
                gemv_rows: int | None = None) -> GemmPlan:
    """The default plan for an [m, k] x [k, n] product whose A and B elements take a_bytes and
    b_bytes in shared memory, fitted to the device's shared memory. In exact mode one plan for
    every m (64 x 64 tiles, no split-K): a row's K reduction is the same whatever the batch.
    gemv_rows: up to this many rows a GEMV plan (default GEMV_MAX_ROWS)."""
    if EXACT.on:
        return GemmPlan(64, 64, min(max_block_k, 64), 1, num_warps=4)
    if 0 < m <= (GEMV_MAX_ROWS if gemv_rows is None else gemv_rows):  # GEMV: the rows padded to a power of 2, 64 row-columns a step
        bm = triton.next_power_of_2(m)
        bn = max(16, 64 // bm)
    elif m <= 16:
        bm, bn = 16, 64
    elif m <= 64:
        bm, bn = 64, 64
    else:
        bm, bn = 128, 128
    bk = min(max_block_k, 128)
    bm, bn, stages = fit_shared(bm, bn, bk, 3, a_bytes, b_bytes, device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    target = PARTIALS_PER_SM * num_sms(device)
    splits = 1
    if tiles < target:
        # at least 4 K steps per split so each program still pipelines its loads
        splits = max(1, min(triton.cdiv(target, tiles), steps // 4, MAX_SPLITS))
    # a 128 x 128 fp32 accumulator (and a decoded weight tile) wants 8 warps' registers
    return GemmPlan(bm, bn, bk, splits, num_warps=8 if bm * bn >= 128 * 128 else 4,
                    num_stages=stages)


# The K loop's accumulator: tensor cores (tl.dot, [BM, BN]) from 16 rows up; below, a GEMV
# plan (one to a few decode rows) keeps fp32 products [BM, BN, BK] in registers, adds one FMA
# per weight element per row and sums over K once after the loop: no tile padded to 16 rows,
# no cross-thread reduction in the loop. (Constexpr branches without early returns: only the
# taken one is built.)


@jit
def acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if BLOCK_M >= 16:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:  # one row: [BN, BK], the row's activations broadcast over it
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@jit
def acc_add(acc, a, b, BLOCK_M: tl.constexpr):
    """acc + a [BM, BK] . b [BN, BK]^T"""
    if BLOCK_M >= 16:
        acc += tl.dot(a, tl.trans(b))
    elif BLOCK_M == 1:
        acc += a.to(tl.float32) * b.to(tl.float32)
    else:
        acc += a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :]
    return acc


@jit
def acc_add_scaled(acc, a, b, a_s, b_s, BLOCK_M: tl.constexpr):
    """acc + (a . b^T) * a_s [BM] (x) b_s [BN]: a K step of one scale group"""
    if BLOCK_M >= 16:
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    else:
        a = a.to(tl.float32) * a_s[:, None]
        b = b.to(tl.float32) * b_s[:, None]
        if BLOCK_M == 1:
            acc += a * b
        else:
            acc += a[:, None, :] * b[None, :, :]
    return acc


@jit
def acc_result(acc, BLOCK_M: tl.constexpr):
    """The [BM, BN] fp32 product of an accumulator after the K loop."""
    if BLOCK_M >= 16:
        out = acc
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@jit
def store_tile(acc, c_ptr, p_ptr, counter_ptr, rm, rn, M, N, stride_cm, splits,
               SPLIT: tl.constexpr):  # fmt: skip
    """Epilogue of a split-K GEMM program (m tile, n tile, split): without SPLIT, store acc;
    with it, store the fp32 partial, count the arrival, and the tile's last split to arrive
    sums every split's partial in split order (deterministic) and stores the result."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        tile = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mn = tl.full((), M, tl.int64) * N  # 64-bit: exact mode also splits prefill sizes
        tl.store(p_ptr + tl.program_id(2) * mn + tile, acc, mask=mask)
        # the barrier orders the CTA's stores before the one thread's release of the counter
        tl.debug_barrier()
        counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, splits):  # .cg: other SMs wrote these during this launch
                total += tl.load(p_ptr + s * mn + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(
                c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
                total.to(c_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    else:
        tl.store(
            c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=mask,
        )


def split_buffers(
    m: int, n: int, tiles: int, splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [splits, m, n], zeroed arrival counters >= tiles) of a split launch;
    placeholders (never read) without splits."""
    if splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=device)
    return partials, split_counters(tiles, device)
