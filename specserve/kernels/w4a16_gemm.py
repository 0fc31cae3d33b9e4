"""Weight-only 4-bit GEMM (W4A16): INT4 (compressed-tensors pack-quantized) and NVFP4 (e2m1).

Both formats reach the kernel in one layout: packed int32 [N, ceil(K/8)] holding weight
element 8c + i in bits 4i..4i+3 of word c (NVFP4's uint8 pairs, low nibble first, are the same
bytes read as int32), and group scales [N, ceil(K/G)].

    INT4:  w[n, k] = (nibble - 8) * scale[n, k // G]                     (symmetric, G 32/128)
    NVFP4: w[n, k] = e2m1(nibble) * scale_fp8[n, k // 16] * row_scale[n]  (row_scale: the
           per-tensor global scale of the fused shard row n belongs to)

Each K step loads the packed words of a [BLOCK_N, BLOCK_K] tile once, decodes the nibbles in
registers, scales them in fp32, rounds the tile to the activation dtype and runs tl.dot with
the activation tile (fp32 accumulation). The row scale is applied once after the K loop.
Decode sizes (few rows) use 16-row tiles and split K over more programs (gemm_split), or a
measured GEMV plan (kernels/w4_gemv.py); prefill sizes use larger tiles. The torch functions
are the CPU path.
"""

from __future__ import annotations

import torch

from specserve.kernels import gemm_split, plan_table
from specserve.kernels.dispatch import EXACT, jit, tl, triton
from specserve.kernels.exact_gemm import rowwise_linear
from specserve.kernels.gemm_split import (
    GemmPlan,
    acc_add,
    acc_add_scaled,
    acc_init,
    acc_result,
    as_plan,
    launch_plan,
    split_buffers,
    store_tile,
)
from specserve.kernels.w4_decode import (
    FP4_UNBIAS_BF16,
    FP4_UNBIAS_FP16,
    OFFSET_BF16,
    OFFSET_FP16,
    _decode_e2m1,
    _packed_words,
    _scales,
    w4_codes16,
)
from specserve.kernels.w4_gemv import NIBBLE, _w4_gemv_kernel

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> nibbles int32 [N, K] (element 8c + i = bits 4i of word c)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed[:, :, None] >> shifts) & 0xF
    return nib.reshape(packed.shape[0], -1)[:, :k]


def decode_nibbles(nib: torch.Tensor, fp4: bool) -> torch.Tensor:
    """Nibbles -> fp32 code values: nibble - 8 (INT4) or the signed e2m1 value (NVFP4)."""
    if not fp4:
        return (nib - 8).float()
    table = torch.tensor(E2M1_VALUES, device=nib.device)
    mag = table[(nib & 7).long()]
    return torch.where((nib & 8) != 0, -mag, mag)


def dequantize_w4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    k: int,
    fp4: bool,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [N, K] fp32 weight of either format."""
    w = decode_nibbles(unpack_nibbles(packed, k), fp4)
    idx = torch.arange(k, device=packed.device) // group
    w = w * scales.float()[:, idx]
    if row_scale is not None:
        w = w * row_scale.float()[:, None]
    return w


def w4a16_mm_torch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    fp4: bool,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU path: dequantize to fp32, one fp32 matmul, rounded to x's dtype."""
    w = dequantize_w4(packed, scales, group, x.shape[-1], fp4, row_scale)
    if EXACT.on:  # one row at a time: torch's fp32 CPU GEMM is not M-invariant
        return rowwise_linear(x.float(), w).to(x.dtype)
    return (x.float() @ w.t()).to(x.dtype)


# how a K step of BLOCK_K columns finds its scales (see scale_mode)
PER_STEP, PER_GROUP, PER_COLUMN = 0, 1, 2
# the same values as constexpr globals: @jit code may read only constexpr module globals
PER_STEP_C, PER_GROUP_C, PER_COLUMN_C = (
    (tl.constexpr(v) if tl is not None else v) for v in (PER_STEP, PER_GROUP, PER_COLUMN))


def scale_mode(group: int, block_k: int) -> int:
    if group % block_k == 0:
        return PER_STEP
    if block_k % group == 0:
        return PER_GROUP
    return PER_COLUMN


@jit
def w4_tile(
    w_rows, s_rows, n_ok, k0, K, GROUP: tl.constexpr, SCALES: tl.constexpr, FP4: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_E4M3: tl.constexpr = False,
    APPLY_SCALE: tl.constexpr = True, DTYPE: tl.constexpr = None, EVEN: tl.constexpr = False,
):  # fmt: skip
    """The weight tile [BLOCK_N, BLOCK_K] (fp32, or DTYPE) of columns k0 .. k0 + BLOCK_K - 1
    (k0 a multiple of 8): w_rows / s_rows [BLOCK_N, 1] point at each row's packed words and
    scales; rows past n_ok and columns past K decode as zero codes (their scales are not read).
    SOFT_E4M3: the scales are e4m3 bytes decoded here (NVFP4 on GPUs without the e4m3 type).
    Without APPLY_SCALE the codes' values alone (the caller scales a PER_STEP tile's product). DTYPE
    (the activations' 16-bit float type): the codes decoded straight to it (w4_codes16) and
    scaled in it, for NVFP4 and for INT4 with scales of that type; the same values as the fp32
    tile rounded to DTYPE (an NVFP4 value times its e4m3 scale is exact in 16 bits; an INT4
    code times a 16-bit scale is exact in fp32, rounded once either way). EVEN: every row of
    the tile is below the matrix's N and every column below K (the caller knows from N %
    BLOCK_N and K % BLOCK_K): the packed words load without a mask."""
    k = k0 + tl.arange(0, BLOCK_K)
    FAST: tl.constexpr = (DTYPE is not None and (DTYPE == tl.bfloat16 or DTYPE == tl.float16)
                          and (FP4 or not APPLY_SCALE or s_rows.dtype.element_ty == DTYPE))
    if FAST:
        bf16: tl.constexpr = DTYPE == tl.bfloat16
        val = w4_codes16(w_rows, n_ok, k0, K, FP4, bf16, BLOCK_N, BLOCK_K, EVEN)
        val = val.to(DTYPE, bitcast=True)
        if FP4:
            unbias: tl.constexpr = FP4_UNBIAS_BF16 if bf16 else FP4_UNBIAS_FP16
            val = val * tl.full((1, 1), unbias, DTYPE)  # exact (0.5 from a subnormal)
        else:
            offset: tl.constexpr = OFFSET_BF16 if bf16 else OFFSET_FP16
            val = val - tl.full((1, 1), offset, DTYPE)  # exact
    else:
        packed = _packed_words(w_rows, n_ok, k0, K, BLOCK_K, EVEN)  # [BN, BK/8]
        nib = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        nib = tl.reshape(nib, (BLOCK_N, BLOCK_K))  # [BN, BK/8, 8] -> [BN, BK]
        if FP4:
            val = _decode_e2m1(nib)
        else:
            val = (nib - 8).to(tl.float32)
    if not APPLY_SCALE:
        w = val
    elif SCALES == PER_STEP_C:  # the step lies in one group: one scale per row
        sc = _scales(s_rows + k0 // GROUP, n_ok[:, None], SOFT_E4M3, FAST, DTYPE)
        w = val * sc
    elif SCALES == PER_GROUP_C:  # BLOCK_K // GROUP whole groups: scale each group's slice
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sc = _scales(s_rows + g[None, :], n_ok[:, None] & (g * GROUP < K)[None, :],
                     SOFT_E4M3, FAST, DTYPE)  # [BN, BK / GROUP]
        w = tl.reshape(
            tl.reshape(val, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * sc[:, :, None],
            (BLOCK_N, BLOCK_K),
        )
    else:  # groups that do not tile the step: each column's scale
        sc = _scales(s_rows + (k // GROUP)[None, :], n_ok[:, None] & (k < K)[None, :],
                     SOFT_E4M3, FAST, DTYPE)  # fmt: skip
        w = val * sc
    return w


@jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, rs_ptr, c_ptr, p_ptr, counter_ptr, M, N, K, k_per_split, splits,
    stride_xm, stride_wn, stride_sn, stride_cm,
    GROUP: tl.constexpr, SCALES: tl.constexpr, FP4: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr, SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    # program (m tile, n tile, K split); BLOCK_K is a multiple of 8 (whole packed words); EVEN:
    # N and K are multiples of BLOCK_N and BLOCK_K
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    # tensor cores (16 rows and up) over a step inside one scale group: the codes tile is the
    # dot's first operand, the accumulator [BN, BM] takes the row scales after each step's dot
    # (sm_90 code: a wgmma, and about 30% fewer instructions a step than scaling the tile as the
    # second operand; with several groups a step that form stays, being the shorter one there);
    # fewer rows: acc_add's GEMV
    TRANSPOSED: tl.constexpr = BLOCK_M >= 16 and SCALES == PER_STEP_C
    # INT4 with 16-bit activations (and scales of their type) decodes by the magic number
    # (w4_tile's DTYPE): sm_90 code of a step inside one group at M 16 (BN 64, BK 128): 389
    # instead of 581 SASS instructions a thread, no I2F, 8 instead of 64 shared stores
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if TRANSPOSED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = acc_init(BLOCK_M, BLOCK_N, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # columns past k_end (the next split's) meet zero activations
        if SCALES == PER_STEP_C:  # one scale per row: applied to the step's product
            # ([BN] scales in the accumulator's layout, not broadcast over the decoded tile; the
            # codes' values are exact in the activation dtype)
            w = w4_tile(w_rows, s_rows, n_ok, k0, K, GROUP, SCALES, FP4, BLOCK_N, BLOCK_K,
                        SOFT_E4M3, APPLY_SCALE=False, DTYPE=DTYPE, EVEN=EVEN).to(x.dtype)
            sc = _scales(s_ptr + rn.to(tl.int64) * stride_sn + k0 // GROUP, n_ok, SOFT_E4M3)
            if TRANSPOSED:
                acc += tl.dot(w, tl.trans(x)) * sc[:, None]
            else:
                acc = acc_add_scaled(acc, x, w, tl.full((BLOCK_M,), 1.0, tl.float32), sc,
                                     BLOCK_M)
        else:
            w = w4_tile(w_rows, s_rows, n_ok, k0, K, GROUP, SCALES, FP4, BLOCK_N, BLOCK_K,
                        SOFT_E4M3, DTYPE=DTYPE, EVEN=EVEN).to(x.dtype)
            acc = acc_add(acc, x, w, BLOCK_M)
    if TRANSPOSED:
        acc = tl.trans(acc)
    else:
        acc = acc_result(acc, BLOCK_M)
    if HAS_ROW_SCALE:
        acc = acc * tl.load(rs_ptr + rn, mask=n_ok, other=0.0)[None, :]
    store_tile(acc, c_ptr, p_ptr, counter_ptr, rm, rn, M, N, stride_cm, splits, SPLIT)


def rule_plan(m: int, n: int, k: int, device: torch.device, x_bytes: int = 2) -> GemmPlan:
    """The plan without a measured one (plan_table): tensor-core tiles at every row count."""
    return launch_plan(m, n, k, device, max_block_k=128 if m <= 64 else 64, a_bytes=x_bytes,
                       b_bytes=0.5, gemv_rows=0)  # fmt: skip


def w4a16_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    fp4: bool,
    row_scale: torch.Tensor | None = None,
    plan: GemmPlan | tuple | None = None,
    soft_e4m3: bool | None = None,
) -> torch.Tensor:
    """w4a16_mm_torch on the GPU: x [M, K] (K contiguous) -> [M, N] in x's dtype.
    plan: a GemmPlan (or its fields); BLOCK_K a multiple of 8. NVFP4's e4m3 scales are decoded
    from their bits in the kernel where the GPU has no e4m3 type (Ampere; soft_e4m3 forces
    either way), so NVFP4 runs wherever INT4 does."""
    m, k = x.shape
    n = packed.shape[0]
    assert x.stride(1) == 1 and packed.stride(1) == 1 and scales.stride(1) == 1
    # prefill tiles decode 64 columns per step: the decoded tile stays in registers
    # (the GEMV kernel runs for a plan with block_m below 16, i.e. a measured one from the
    # plan table: the rule of thumb keeps tensor-core tiles)
    plan = (as_plan(plan) or plan_table.tuned_plan(plan_table.w4_format(group, fp4), m, n, k,
                                                   x.device)
            or rule_plan(m, n, k, x.device, x.element_size()))  # fmt: skip
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    assert bk % 8 == 0
    k_per_split, splits = plan.k_per_split(k)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    partials, counters = split_buffers(m, n, grid[0] * grid[1], splits, x.device)
    soft = scales.dtype == torch.float8_e4m3fn and (
        not gemm_split.fp8_native(x.device) if soft_e4m3 is None else soft_e4m3)
    if soft:
        scales = scales.view(torch.uint8)
    if m and bm < 16 and group % 8 == 0:  # a GEMV plan (rows below the tensor cores' 16)
        _w4_gemv_kernel[grid](
            x, packed, scales, row_scale if row_scale is not None else scales, out, partials,
            counters, m, n, k, k_per_split, splits, x.stride(0), packed.stride(0),
            scales.stride(0), out.stride(0), NIBBLE, GROUP=group, PER_ROW_SCALE=group % bk == 0,
            FP4=fp4, HAS_ROW_SCALE=row_scale is not None, SPLIT=splits > 1, SOFT_E4M3=soft,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            EVEN=n % bn == 0 and k_per_split % bk == 0 and k % k_per_split == 0,
            STAGES=plan.num_stages, num_warps=plan.num_warps, num_stages=plan.num_stages,
        )  # fmt: skip
    elif m:
        _w4a16_kernel[grid](
            x, packed, scales, row_scale if row_scale is not None else scales, out, partials,
            counters, m, n, k, k_per_split, splits, x.stride(0), packed.stride(0),
            scales.stride(0), out.stride(0), GROUP=group, SCALES=scale_mode(group, bk), FP4=fp4,
            HAS_ROW_SCALE=row_scale is not None, SPLIT=splits > 1, SOFT_E4M3=soft, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, EVEN=n % bn == 0 and k % bk == 0, num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )  # fmt: skip
    return out
