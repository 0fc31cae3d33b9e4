"""FP8 (e4m3) W8A8 GEMM: dynamic activation quantization and a scaled matmul on FP8 operands.

    x [M, K] -> x_q fp8 [M, K], x_s fp32 [M, ceil(K / group)]   per row and group of `group`
                s = max|x| / 448 over the group, x_q = clamp(x / s) rounded to nearest even
    y [M, N] = sum over K steps of (x_q . w_q^T) * x_s[m, k / gk] * w_s[n / gn, k / gk]

`w_s` is indexed through its strides, so one kernel serves 128x128 block scales
([ceil(N/128), ceil(K/128)]), per-channel ([N, 1], stride 0 along K) and per-tensor scales
(strides 0), and per-token activation scales (group = K). The dot runs on FP8 operands with
fp32 accumulation (FP8 tensor cores on Hopper); scales that are constant along K are applied
once after the K loop. The torch functions here are the CPU path and define the numerics.
"""

from __future__ import annotations

import torch

from specserve.kernels import gemm_split, plan_table
from specserve.kernels.dispatch import EXACT, jit, next_power_of_2, tl, triton
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

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
AMAX_EPS = 1e-10  # an all-zero group gets a tiny scale instead of a division by zero


# -- activation quantization ------------------------------------------------------------------


def quant_fp8_torch(
    x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q fp8 [M, K], scales fp32 [M, ceil(K / group)]); static_scale (a
    scalar tensor) replaces the dynamic per-group scales."""
    m, k = x.shape
    xf = x.float()
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1).expand(m, 1)
        return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.contiguous()
    groups = -(-k // group)
    pad = groups * group - k
    xg = torch.nn.functional.pad(xf, (0, pad)).view(m, groups, group)
    s = xg.abs().amax(-1).clamp(min=AMAX_EPS) / FP8_MAX  # [M, groups]
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, groups * group)[:, :k], s


@jit
def _round_to_e4m3(v):
    # v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as an fp32 that the
    # cast to fp8 then takes exactly (Triton's interpreter cast does not round correctly); the
    # sign is v's, so a negative value that rounds to zero is -0 (code 0x80) as torch's cast
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(v) * ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)  # |v| / ulp, exact
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer (RNE)
    mag = ((y + magic) - magic) * ulp
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@jit
def quant_rows_e4m3(x, fp8_max, eps):
    # x fp32 [R, G] -> (x / s rounded to e4m3 values (fp32) [R, G], s [R]): s = max|x| / 448
    # per row, as quant_fp8 over one group of G columns
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), eps), fp8_max)  # IEEE, as torch
    q = tl.clamp(tl.math.div_rn(x, s[:, None]), -fp8_max, fp8_max)
    return _round_to_e4m3(q), s


@jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, stride_s, fp8_max, eps,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
):  # fmt: skip
    # program (row, group): one scale, GROUP quantized elements
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), eps), fp8_max)  # IEEE, as torch
        tl.store(s_ptr + row * stride_s + g, s)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, s), -fp8_max, fp8_max))
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def quant_fp8(
    x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_fp8_torch on the GPU (same numerics: true division, round to nearest even)."""
    m, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1).expand(m, 1)
        groups, group = 1, k
    else:
        groups = -(-k // group)
        s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        block = next_power_of_2(group)
        _quant_fp8_kernel[(m, groups)](
            x, q, s, static_scale if static_scale is not None else s, k, x.stride(0),
            q.stride(0), s.stride(0), FP8_MAX, AMAX_EPS, GROUP=group, BLOCK=block,
            STATIC=static_scale is not None, num_warps=4 if block >= 1024 else 1,
        )  # fmt: skip
    return q, s


# -- the scaled matmul ------------------------------------------------------------------------


def _scale_index(k: int, group: int, n: int) -> torch.Tensor:
    return torch.arange(k) // group if n > 1 else torch.zeros(k, dtype=torch.long)


def expand_scale(
    scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int
) -> torch.Tensor:
    """A [ceil(rows/br), ceil(cols/bc)] (or broadcastable) scale grid as a [rows, cols] tensor."""
    s = scale.float().reshape(scale.shape[0] if scale.dim() else 1, -1)
    r = _scale_index(rows, block_rows, s.shape[0]).to(s.device)
    c = _scale_index(cols, block_cols, s.shape[1]).to(s.device)
    return s[r][:, c]


def fp8_mm_torch(
    xq: torch.Tensor,
    xs: torch.Tensor,
    act_group: int,
    w: torch.Tensor,
    ws: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The CPU path: dequantize both operands in fp32, one fp32 matmul."""
    m, k = xq.shape
    x = xq.float() * expand_scale(xs, m, k, 1, act_group)
    wf = w.float() * expand_scale(ws, w.shape[0], k, block_n, block_k)
    if EXACT.on:  # one row at a time: torch's fp32 CPU GEMM is not M-invariant
        return rowwise_linear(x, wf).to(out_dtype)
    return (x @ wf.t()).to(out_dtype)


# how the kernel gets its FP8 activations: given (quantized by quant_fp8), quantized in the K
# loop per row and BLOCK_K group (dynamic; BLOCK_K = the group), or with a static scale
GIVEN, DYNAMIC, STATIC = 0, 1, 2
# the same values as constexpr globals: @jit code may read only constexpr module globals
GEMV_STAGES = tl.constexpr(3) if tl is not None else 3  # weight tiles of a GEMV step pipelined
GIVEN_C, DYNAMIC_C, STATIC_C = (
    (tl.constexpr(v) if tl is not None else v) for v in (GIVEN, DYNAMIC, STATIC))


@jit
def _fp8_mm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, p_ptr, counter_ptr, M, N, K, k_per_split, splits,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm,
    fp8_max, eps,
    QUANT_A: tl.constexpr, A_GROUP: tl.constexpr, B_GROUP_N: tl.constexpr,
    B_GROUP_K: tl.constexpr, SCALE_AT_END: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr = False,
):  # fmt: skip
    # program (m tile, n tile, K split): acc [BM, BN] over K in [split * kps, (split+1) * kps);
    # EVEN: N and K are multiples of BLOCK_N and BLOCK_K (each split a whole number of steps):
    # the weight tiles load without a mask
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_bn
    as_rows = as_ptr + rm * stride_asm
    bs_rows = bs_ptr + (rn // B_GROUP_N) * stride_bsn
    acc = acc_init(BLOCK_M, BLOCK_N, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # a GEMV plan's weight tiles feed no dot, so the compiler pipelines them only when asked:
    # then two steps' tiles are in flight (cp.async) while a program computes on a third,
    # instead of one tile loaded and waited for at each step (sm_90: 473 instead of 346
    # instructions a thread a step; at 3 programs an SM the one-tile loop is latency-bound)
    LOOP_STAGES: tl.constexpr = GEMV_STAGES if BLOCK_M < 16 else None
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        k = k0 + rk
        k_ok = k < k_end
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT_A == DYNAMIC_C:  # as quant_fp8 over this row's group of BLOCK_K columns
            q, a_s = quant_rows_e4m3(a.to(tl.float32), fp8_max, eps)
            a = q.to(b_ptr.dtype.element_ty)
        elif QUANT_A == STATIC_C:
            a_s = tl.load(as_rows, mask=m_ok, other=0.0)
            q = tl.clamp(tl.math.div_rn(a.to(tl.float32), a_s[:, None]), -fp8_max, fp8_max)
            a = _round_to_e4m3(q).to(b_ptr.dtype.element_ty)
        if EVEN:
            b = tl.load(b_rows + k[None, :])
        else:
            b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE_AT_END:
            acc = acc_add(acc, a, b, BLOCK_M)
        else:
            if QUANT_A == GIVEN_C:
                a_s = tl.load(as_rows + (k0 // A_GROUP) * stride_ask, mask=m_ok, other=0.0)
            b_s = tl.load(bs_rows + (k0 // B_GROUP_K) * stride_bsk, mask=n_ok, other=0.0)
            acc = acc_add_scaled(acc, a, b, a_s, b_s, BLOCK_M)
    acc = acc_result(acc, BLOCK_M)
    if SCALE_AT_END:
        a_s = tl.load(as_rows, mask=m_ok, other=0.0)
        b_s = tl.load(bs_rows, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    store_tile(acc, c_ptr, p_ptr, counter_ptr, rm, rn, M, N, stride_cm, splits, SPLIT)


def _scale_strides(s: torch.Tensor) -> tuple[int, int]:
    """(row, col) strides of a scale grid; 0 along an axis of extent 1 (broadcast)."""
    s2 = s.reshape(s.shape[0] if s.dim() else 1, -1)
    return (s2.stride(0) if s2.shape[0] > 1 else 0), (s2.stride(1) if s2.shape[1] > 1 else 0)


def rule_plan(m: int, n: int, k: int, device: torch.device, max_block_k: int = 128,
              a_bytes: int = 1) -> GemmPlan:
    """The plan without a measured one (plan_table); a_bytes: 2 where the GEMM quantizes bf16
    rows in its loop (a GEMV plan), 1 on FP8 rows."""
    return launch_plan(m, n, k, device, max_block_k=max_block_k, a_bytes=a_bytes, b_bytes=1)


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    quant: int,
    act_group: int,
    w: torch.Tensor,
    ws: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
    plan: GemmPlan | tuple | None,
) -> torch.Tensor:
    m, k = a.shape
    n = w.shape[0]
    assert a.stride(1) == 1 and w.stride(1) == 1
    sam, sak = _scale_strides(a_scale) if quant != DYNAMIC else (0, 1)
    sbn, sbk = _scale_strides(ws)
    scale_at_end = sak == 0 and sbk == 0
    groups_k = [g for g, stride in ((act_group, sak), (block_k, sbk)) if stride]
    plan = as_plan(plan) or rule_plan(m, n, k, a.device, min(groups_k or [128]),
                                      a.element_size())  # fmt: skip
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    assert all(g % bk == 0 for g in groups_k), "BLOCK_K must divide the scale groups along K"
    assert quant != DYNAMIC or bk == act_group, "in-loop quantization: BLOCK_K = the group"
    k_per_split, splits = plan.k_per_split(k)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    partials, counters = split_buffers(m, n, grid[0] * grid[1], splits, a.device)
    if m:
        _fp8_mm_kernel[grid](
            a, a_scale, w, ws, out, partials, counters, m, n, k, k_per_split, splits,
            a.stride(0), sam, sak, w.stride(0), sbn, sbk, out.stride(0), FP8_MAX, AMAX_EPS,
            QUANT_A=quant, A_GROUP=act_group if sak else 1, B_GROUP_N=block_n if sbn else 1,
            B_GROUP_K=block_k if sbk else 1, SCALE_AT_END=scale_at_end, SPLIT=splits > 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=n % bn == 0 and k % bk == 0,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )  # fmt: skip
    return out


def fp8_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    act_group: int,
    w: torch.Tensor,
    ws: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
    plan: GemmPlan | tuple | None = None,
) -> torch.Tensor:
    """fp8_mm_torch on the GPU. xq [M, K], w [N, K] fp8 (K contiguous); xs [M, groups] or
    [M, 1]; ws [ceil(N/bn), ceil(K/bk)], [N, 1] or [1]. plan: a GemmPlan (or its fields)."""
    return _launch(xq, xs, GIVEN, act_group, w, ws, block_n, block_k, out_dtype, plan)


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    block_n: int,
    block_k: int,
    act_group: int,
    static_scale: torch.Tensor | None = None,
    plan: GemmPlan | tuple | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x W^T in x's dtype with x quantized as quant_fp8(x, act_group, static_scale): inside
    the GEMM's K loop for a GEMV plan (one row; 128-groups or a static scale), else by quant_fp8
    first (one launch more). Quantizing in the loop repeats the work in every column tile's
    program: on sm_90 a 16-row tensor-core step took 733 instructions a thread with it and 183
    on pre-quantized rows (2171 and 265 at 64 rows, where the dot also runs on FP8 wgmma), while
    the one-row GEMV step differs little (473 and 417). The same numerics either way. Without
    a plan, 128x128-block weights take this GPU's measured plan (kernels/plan_table.py) if
    there is one. rows: quant_fp8(x, act_group) already made (by the kernel that wrote x:
    kernels/fused_ops.py), read instead of quantizing x (its launch, or a GEMV's loop)."""
    m, k = x.shape
    plan = as_plan(plan)
    if plan is None and static_scale is None and act_group == block_n == block_k == 128:
        plan = plan_table.tuned_plan("fp8", m, w.shape[0], k, x.device)
    gemv = plan.block_m < 16 if plan is not None else (
        not EXACT.on and 0 < m <= gemm_split.GEMV_MAX_ROWS)
    if gemv and static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(m, 1)
        return _launch(x, scale, STATIC, k, w, ws, block_n, block_k, x.dtype, plan)
    if rows is not None and static_scale is None:  # any plan reads them (GEMV: 1-byte rows)
        xq, xs = rows
    elif gemv and act_group <= 128:
        return _launch(x, x, DYNAMIC, act_group, w, ws, block_n, block_k, x.dtype, plan)
    else:
        xq, xs = quant_fp8(x, act_group, static_scale)
    group = k if static_scale is not None else act_group
    return _launch(xq, xs, GIVEN, group, w, ws, block_n, block_k, x.dtype, plan)
