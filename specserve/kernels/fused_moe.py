"""Fused mixture-of-experts: token-expert alignment + grouped GEMM (Triton), torch reference.

    x [M, H], topk_ids / topk_weights [M, k], w13 [E, 2I, H] (gate rows | up rows), w2 [E, H, I]
    y[m] = sum_j topk_weights[m, j] * w2[e] @ (silu(w13[e, :I] @ x[m]) * w13[e, I:] @ x[m]),
           e = topk_ids[m, j]

The M*k (token, expert) pairs are numbered p = m*k + j. Alignment sorts them by expert and
pads each expert's run to a multiple of BLOCK_M with the sentinel M*k, so every BLOCK_M-row
block of `sorted_ids` belongs to one expert (an expert with no pair owns no block):

    sorted_ids    [ 4 9 2 - | 0 3 7 8 | 11 - - - | 1 5 - - | - - - - ... ]   ("-" = M*k)
    block_expert  [ 0       | 2       | 2        | 5       | -1 ... ]

The buffers have a static size, M*k + E*(BLOCK_M - 1) rows rounded up to whole blocks (no host
sync; CUDA-graph safe): programs of blocks at or past `num_padded` return at once. When the
pairs are few against the experts (M*k*4 <= E, decode), block b holds pair b alone instead:
no sort, and no grid of empty blocks.

GEMM 1, one program per (block, BLOCK_N columns of I): gathers x rows p // k, computes the gate
and up tiles of the block's expert and writes silu(gate) * up to act [M*k, I] at row p.
GEMM 2: act row p times w2[e]^T, times topk_weights[p], to out [M*k, H]; then a sum over k.
Rounding follows the transformers experts: projections, SiLU and each expert's output are
rounded to the activation dtype; the k-sum is done in fp32.

Quantized experts (`ExpertWeights`) are dequantized inside the K loop of both GEMMs:
    FP8_BLOCK  W8A8: fp8 weights with [bn x bk] block scales; activation rows quantized per
               row and group of bk = 128 once before each GEMM (quant_fp8, as the dense FP8
               linear), tl.dot on FP8 operands per K step (BLOCK_K = bk), scaled by both
    INT4       W4A16: int4 nibbles packed 8 per int32 along K with group scales (compressed-
               tensors pack-quantized), decoded and scaled in registers, tl.dot in the
               activation dtype
    NVFP4      W4A16: e2m1 nibbles in the same packed layout, e4m3 scales per 16 along K
               (decoded from their bits where the GPU has no e4m3 type), decoded like INT4;
               each (expert, part) has a global scale, applied to the accumulator after the
               K loop (gate and up apart), as the dense NVFP4 GEMM applies its row scale
A gate_up weight holds its two parts' scales apart: the up part's scale rows start at
`rows_per_part` (a ragged last block of the gate part never covers up rows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import gemm_split
from specserve.kernels.dispatch import EXACT, jit, next_power_of_2, tl, triton
from specserve.kernels.exact_gemm import rowwise_linear
from specserve.kernels.fp8_gemm import expand_scale, quant_fp8, quant_fp8_torch
from specserve.kernels.gemm_split import fit_shared
from specserve.kernels.moe_align import MoEAlignment, align_pairs
from specserve.kernels.w4_gemv import NIBBLE, w4_columns, w4_gemv_step
from specserve.kernels.w4a16_gemm import PER_STEP_C, dequantize_w4, scale_mode, w4_tile

# weight formats of the grouped GEMMs
DENSE, FP8_BLOCK, INT4, NVFP4 = 0, 1, 2, 3
# the same values as constexpr globals: @jit code may read only constexpr module globals
DENSE_C, FP8_BLOCK_C, INT4_C, NVFP4_C = (
    (tl.constexpr(v) if tl is not None else v) for v in (DENSE, FP8_BLOCK, INT4, NVFP4))


@dataclass(frozen=True)
class ExpertWeights:
    """One grouped GEMM's stacked expert matrices [E, N, K] in their stored format.

    weight  DENSE [E, N, K] (activation dtype); FP8_BLOCK [E, N, K] float8_e4m3fn; INT4
            [E, N, ceil(K/8)] int32 (element 8c + i in bits 4i of word c, nibble = q + 8);
            NVFP4 [E, N, K/8] int32, the same layout holding e2m1 codes (sign bit 3), i.e.
            ModelOpt's uint8 [E, N, K/2] (low nibble first) viewed as int32
    scale   FP8_BLOCK [E, parts * ceil(N/parts/group_n), ceil(K/group_k)] fp32; INT4
            [E, N, ceil(K/group_k)]; NVFP4 [E, N, K/16] float8_e4m3fn; DENSE None
    parts   row parts with scales of their own (gate_up: 2, down: 1)
    global_scale  NVFP4 only: [E, parts] fp32, w = e2m1 * scale * global_scale[e, part]
    """

    format: int
    weight: torch.Tensor
    scale: torch.Tensor | None
    in_features: int
    group_n: int = 1
    group_k: int = 1
    parts: int = 1
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format == NVFP4:
            e, n = self.weight.shape[:2]
            assert self.group_k == 16 and self.in_features % 16 == 0, "NVFP4: K in groups of 16"
            assert self.global_scale is not None and self.global_scale.shape == (e, self.parts)
            assert n % self.parts == 0

    @property
    def rows_per_part(self) -> int:
        """Scale rows of one part (the up part's scale rows start here)."""
        part = self.weight.shape[1] // self.parts
        return -(-part // self.group_n)

    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s [N, K] weight in fp32 (DENSE: as stored)."""
        w = self.weight[expert]
        if self.format == DENSE:
            return w
        if self.format == INT4:
            return dequantize_w4(w, self.scale[expert], self.group_k, self.in_features, False)
        if self.format == NVFP4:  # each part's rows times that part's global scale
            rows = self.global_scale[expert].float().repeat_interleave(w.shape[0] // self.parts)
            return dequantize_w4(w, self.scale[expert], self.group_k, self.in_features, True,
                                 rows)  # fmt: skip
        n, k = w.shape
        part = n // self.parts
        rows = torch.arange(n, device=w.device)
        scale_rows = (rows // part) * self.rows_per_part + (rows % part) // self.group_n
        grid = self.scale[expert].float()[scale_rows]  # [N, ceil(K/bk)]
        return w.float() * expand_scale(grid, n, k, 1, self.group_k)

    def apply(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, K] @ W_e^T in x's dtype: dense in x's dtype; quantized in fp32 on the
        dequantized weight (W8A8: x fake-quantized per row and group first)."""
        w = self.dequantize(expert)
        linear = rowwise_linear if EXACT.on else F.linear  # exact: a row's result never
        if self.format == DENSE:  # depends on how many rows the expert got
            return linear(x, w)
        xf = x.float()
        if self.format == FP8_BLOCK:
            xq, xs = quant_fp8_torch(xf, self.group_k)
            xf = xq.float() * expand_scale(xs, *xf.shape, 1, self.group_k)
        return linear(xf, w).to(x.dtype)


def expert_weights(w: torch.Tensor | ExpertWeights, parts: int) -> ExpertWeights:
    """A dense stacked weight as ExpertWeights (quantized ones pass through)."""
    if isinstance(w, ExpertWeights):
        return w
    return ExpertWeights(DENSE, w, None, w.shape[2], parts=parts)


@dataclass(frozen=True)
class MoELaunch:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # M-blocks per L2 group (consecutive programs reuse one weight tile)
    num_warps: int
    num_stages: int


def moe_launch_config(num_tokens: int, n: int, k: int, num_experts: int, top_k: int,
                      dtype: torch.dtype, weights: ExpertWeights | None = None
                      ) -> MoELaunch:  # fmt: skip
    """Block sizes for one grouped GEMM of output width `n` and depth `k`.

    Rows per expert (M*k/E) pick BLOCK_M: decode has ~1 row per hit expert (BLOCK_M 16, the
    smallest MMA tile; the GEMM is a weight stream, so narrow BLOCK_N gives more programs),
    prefill fills whole tiles (BLOCK_M up to 128, BLOCK_N 128, GROUP_M 8 for L2 reuse).
    FP8 block weights step K by their block (the activations' scale groups).
    Exact mode (kernels/dispatch.py) takes one config whatever num_tokens is.
    """
    rows = num_tokens * top_k / max(num_experts, 1)
    four_bit = (weights is not None and weights.format in (INT4, NVFP4)
                and weights.group_k % 8 == 0)  # the GEMV scales whole packed words
    if EXACT.on:  # exact mode: one tile config for every M (a row's K order never changes)
        bm, bn, bk, group, warps, stages = 32, 64, 64, 8, 4, 3
    elif four_bit and rows <= 1 and MOE_GEMV:  # one pair a block, no tensor cores
        return MoELaunch(1, 64, 128 if k >= 128 else max(16, next_power_of_2(k)), 1, 4, 3)
    elif rows <= 16:
        bm, bn, bk, group, warps, stages = 16, 64, 128, 1, 4, 4
    elif rows <= 48:
        bm, bn, bk, group, warps, stages = 32, 64, 128, 8, 4, 4
    elif rows <= 128:
        bm, bn, bk, group, warps, stages = 64, 128, 64, 8, 8, 3
    else:
        bm, bn, bk, group, warps, stages = 128, 128, 64, 8, 8, 3
    if dtype == torch.float32:  # twice the bytes per element: halve the K tile
        bk //= 2
    bn = max(16, min(bn, next_power_of_2(n)))
    bk = max(16, min(bk, next_power_of_2(k)))
    if weights is not None and weights.format == FP8_BLOCK:
        bk = weights.group_k
    if weights is not None:  # fit the device's shared memory (block_m is shared by both GEMMs)
        w_bytes = 0.5 if weights.format in (INT4, NVFP4) else weights.weight.element_size()
        a_bytes = dtype.itemsize
        _, bn, stages = fit_shared(bm, bn, bk, stages, a_bytes, w_bytes, weights.weight.device,
                                   shrink_m=False)
    return MoELaunch(bm, bn, bk, group, warps, stages)


# SPECSERVE_MOE_GEMV=1: 4-bit experts at decode (at most one row per expert on average) run
# the GEMV form (one pair a block, each word decoded once, no 16-row padded MMA tile). Off
# by default until a GPU measures it against the MMA tiles (gpu_suite's quant step: A/B).
MOE_GEMV = os.environ.get("SPECSERVE_MOE_GEMV", "0") == "1"


@jit
def _moe_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, gs_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    num_padded_ptr, n, k, num_pairs, num_rows, stride_am, stride_asm, stride_be, stride_bn,
    stride_bse, stride_bsn, stride_gse, stride_cm, up_offset, up_scale_row, nibble,
    A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    WEIGHTS: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SCALES: tl.constexpr,
    SOFT_E4M3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN: tl.constexpr = False,
):  # fmt: skip
    # EVEN: n and k are multiples of BLOCK_N and BLOCK_K (4-bit weights load without masks)
    # c[p, cols] = f(a[p // A_ROW_DIV] @ b[e, cols]^T) for the BLOCK_M pairs p of this block
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)  # GROUP_M M-blocks sweep one column tile in turn
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BLOCK_M] pair ids, num_pairs = padding
    row_ok = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WEIGHTS == FP8_BLOCK_C:  # scale rows of the gate (or only) part and of the up part
        s_gate = bs_ptr + expert * stride_bse + (cols // GROUP_N).to(tl.int64) * stride_bsn
        s_up = s_gate + up_scale_row * stride_bsn
    if WEIGHTS == INT4_C or WEIGHTS == NVFP4_C:  # per-row packed words and group scales
        w_rows = b_ptr + expert * stride_be + cols.to(tl.int64)[:, None] * stride_bn
        s_rows = bs_ptr + expert * stride_bse + cols.to(tl.int64)[:, None] * stride_bsn
    # 4-bit weights with one pair a block (decode: ~1 row per hit expert): the GEMV form,
    # each packed word decoded once and multiplied in fp32 without tensor cores or a 16-row
    # padded tile (w4a16_gemm.w4_gemv_step); acc / acc_up [1, BN] after the loop
    GEMV: tl.constexpr = BLOCK_M == 1 and (WEIGHTS == INT4_C or WEIGHTS == NVFP4_C)
    if GEMV:
        x_row = a_ptr + tl.where(row_ok, a_row, 0) * stride_am  # [1]: the pair's row
        words = tl.arange(0, BLOCK_K // 8)
        g = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        u = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            xs = w4_columns(x_row, k0 // 8 + words, k, row_ok, 1, BLOCK_K)
            g += w4_gemv_step(w_rows, s_rows, col_ok, k0, k, xs, nibble, GROUP_K,
                              SCALES == PER_STEP_C, WEIGHTS == NVFP4_C, SOFT_E4M3, 1, BLOCK_K,
                              EVEN)
            if SILU_MUL:
                u += w4_gemv_step(w_rows + up_offset * stride_bn,
                                  s_rows + up_scale_row * stride_bsn, col_ok, k0, k, xs, nibble,
                                  GROUP_K, SCALES == PER_STEP_C, WEIGHTS == NVFP4_C,
                                  SOFT_E4M3, 1, BLOCK_K, EVEN)  # fmt: skip
        acc = tl.sum(g, axis=1)[None, :]
        acc_up = tl.sum(u, axis=1)[None, :]
    else:
        for k0 in range(0, k, BLOCK_K):
            k_ok = offs_k < k - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & col_ok[None, :]
            if WEIGHTS == FP8_BLOCK_C:  # W8A8: rows quantized per group of BLOCK_K = GROUP_K
                a8 = a  # fp8 (quant_fp8 before the launch)
                a_s = tl.load(as_ptr + a_row * stride_asm + k0 // GROUP_K, mask=row_ok, other=0.0)
                b = tl.load(b_ptrs, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N] fp8
                b_s = tl.load(s_gate + k0 // GROUP_K, mask=col_ok, other=0.0)
                acc += tl.dot(a8, b) * a_s[:, None] * b_s[None, :]
                if SILU_MUL:
                    b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=b_mask, other=0.0)
                    bu_s = tl.load(s_up + k0 // GROUP_K, mask=col_ok, other=0.0)
                    acc_up += tl.dot(a8, b_up) * a_s[:, None] * bu_s[None, :]
            elif WEIGHTS == INT4_C or WEIGHTS == NVFP4_C:  # W4A16: decoded and scaled in registers
                fp4: tl.constexpr = WEIGHTS == NVFP4_C
                w = w4_tile(w_rows, s_rows, col_ok, k0, k, GROUP_K, SCALES, fp4, BLOCK_N, BLOCK_K,
                            SOFT_E4M3, DTYPE=a_ptr.dtype.element_ty, EVEN=EVEN)  # fmt: skip
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
                if SILU_MUL:
                    w_up = w4_tile(w_rows + up_offset * stride_bn, s_rows + up_scale_row * stride_bsn,
                                   col_ok, k0, k, GROUP_K, SCALES, fp4, BLOCK_N, BLOCK_K,
                                   SOFT_E4M3, DTYPE=a_ptr.dtype.element_ty, EVEN=EVEN)  # fmt: skip
                    acc_up = tl.dot(a, tl.trans(w_up.to(a.dtype)), acc_up,
                                    input_precision=DOT_PRECISION)  # fmt: skip
            else:
                b = tl.load(b_ptrs, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                if SILU_MUL:
                    b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=b_mask, other=0.0)
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if WEIGHTS == NVFP4_C:  # the global scales of the expert's gate (or only) and up parts
        acc = acc * tl.load(gs_ptr + expert * stride_gse)
        if SILU_MUL:
            acc_up = acc_up * tl.load(gs_ptr + expert * stride_gse + 1)
    out_ty = c_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32)
    if SILU_MUL:  # round gate and up, round silu(gate), then the product
        y = (y / (1.0 + tl.exp(-y))).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(tl.float32)
    if MUL_WEIGHT:
        y = y * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, y.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor, b: ExpertWeights, out: torch.Tensor, topk_weights: torch.Tensor | None,
    align: MoEAlignment, n: int, a_row_div: int, silu_mul: bool, launch: MoELaunch,
    soft_e4m3: bool | None = None,
) -> None:  # fmt: skip
    k = a.shape[1]
    w, scale = b.weight, b.scale if b.scale is not None else b.weight
    glob = b.global_scale if b.global_scale is not None else scale
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1 and scale.stride(-1) == 1
    assert b.format != FP8_BLOCK or launch.block_k == b.group_k, "W8A8: BLOCK_K = the group"
    assert b.format != NVFP4 or (glob.dtype == torch.float32 and glob.stride(1) == 1)
    # NVFP4's e4m3 scales are read as bytes and decoded in the kernel where the GPU has no
    # e4m3 type (soft_e4m3 forces either way)
    soft = b.format == NVFP4 and (
        not gemm_split.fp8_native(a.device) if soft_e4m3 is None else soft_e4m3)
    if soft:
        scale = scale.view(torch.uint8)
    num_rows = align.sorted_ids.shape[0]
    grid = (triton.cdiv(num_rows, launch.block_m) * triton.cdiv(n, launch.block_n),)
    precision = "ieee" if a.dtype == torch.float32 else None
    a_scale = scale  # unused unless W8A8
    if b.format == FP8_BLOCK:  # the rows quantized once, per group of bk (= BLOCK_K)
        a, a_scale = quant_fp8(a, b.group_k)
    _moe_gemm_kernel[grid](
        a, a_scale, w, scale, glob, out, topk_weights if topk_weights is not None else a,
        align.sorted_ids, align.block_expert, align.num_padded, n, k, out.shape[0], num_rows,
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), scale.stride(0),
        scale.stride(1), glob.stride(0), out.stride(0), n, b.rows_per_part, NIBBLE,
        A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, MUL_WEIGHT=topk_weights is not None,
        WEIGHTS=b.format, GROUP_N=b.group_n, GROUP_K=b.group_k,
        SCALES=scale_mode(b.group_k, launch.block_k), SOFT_E4M3=soft,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        GROUP_M=launch.group_m, DOT_PRECISION=precision,
        EVEN=n % launch.block_n == 0 and k % launch.block_k == 0,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor | ExpertWeights, w2: torch.Tensor | ExpertWeights,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    launch: tuple[MoELaunch, MoELaunch] | None = None, soft_e4m3: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Routed-expert output [M, H] (Triton). w13 [E, 2I, H], w2 [E, H, I] (dense tensors, or
    ExpertWeights in a quantized format); topk_* [M, k].

    `launch`: (gate_up config, down config); None picks them from the shapes. `soft_e4m3`:
    NVFP4 scales decoded from their bits (True) or read as e4m3 (False); None: as the GPU
    allows (bits below compute capability 8.9).
    """
    w13, w2 = expert_weights(w13, 2), expert_weights(w2, 1)
    m, hidden = x.shape
    num_experts, two_inter = w13.weight.shape[:2]
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w13.in_features == hidden and w2.in_features == inter
    assert w2.weight.shape[:2] == (num_experts, hidden) and topk_weights.shape == topk_ids.shape
    if m == 0:
        return x.new_zeros(0, hidden)
    if launch is None:
        launch = (
            moe_launch_config(m, inter, hidden, num_experts, top_k, x.dtype, w13),
            moe_launch_config(m, hidden, inter, num_experts, top_k, x.dtype, w2),
        )
    assert launch[0].block_m == launch[1].block_m, "both GEMMs walk one alignment"
    align = align_pairs(topk_ids, launch[0].block_m, num_experts)
    weights = topk_weights.float().contiguous().view(-1)
    act = x.new_empty(m * top_k, inter)
    _grouped_gemm(x.contiguous(), w13, act, None, align, inter, top_k, True, launch[0],
                  soft_e4m3)  # fmt: skip
    out = x.new_empty(m * top_k, hidden)
    _grouped_gemm(act, w2, out, weights, align, hidden, 1, False, launch[1], soft_e4m3)
    return out.view(m, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor | ExpertWeights, w2: torch.Tensor | ExpertWeights,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Torch form of `fused_moe` (one batched matmul per hit expert; the CPU path). Dense
    weights compute in x's dtype; quantized ones are dequantized to fp32 per hit expert and
    multiply in fp32 (W8A8: the inputs of both GEMMs fake-quantized per row and group, as the
    kernel quantizes them), with the kernel's roundings to x's dtype."""
    w13, w2 = expert_weights(w13, 2), expert_weights(w2, 1)
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    out = x.new_empty(m * top_k, hidden)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().flatten()  # pair p = token p // k, slot p % k
        gate, up = w13.apply(x[pairs // top_k], e).chunk(2, dim=-1)
        y = w2.apply(F.silu(gate) * up, e)  # [pairs, H] in x.dtype
        out[pairs] = (y * topk_weights.flatten()[pairs, None].float()).to(x.dtype)
    return out.view(m, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
