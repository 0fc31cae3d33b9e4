"""The W4A16 GEMV (kernels/w4a16_gemm.py's plans below 16 rows, and the fused MoE's
one-pair-a-block form): the packed words [BLOCK_N, BLOCK_K / 8] kept as loaded, each nibble
read as fp16 bits and converted exactly to fp32 (no int-to-float conversion), decoded once for
all the rows and multiplied in fp32 without tensor cores."""

from __future__ import annotations

import os

from specserve.kernels.dispatch import jit, tl
from specserve.kernels.gemm_split import store_tile
from specserve.kernels.w4_decode import _scales


@jit
def w4_columns(x_rows, word, k_end, m_ok, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The step's activations (one 16-byte load a word) as the 8 columns of nibble j: [W]
    (BLOCK_M 1) or [BM, W]; past k_end (the next split's columns) or M: zeros. Column
    4a + 2b + c sits at [.., w, a, b, c]: each split takes the last axis."""
    kk = word[:, None] * 8 + tl.arange(0, 8)[None, :]  # [W, 8]
    if BLOCK_M == 1:
        xw = tl.load(x_rows + kk, mask=kk < k_end, other=0.0)
        shape: tl.constexpr = (BLOCK_K // 8, 2, 2, 2)
    else:
        xw = tl.load(x_rows[:, :, None] + kk[None, :, :],
                     mask=m_ok[:, None, None] & (kk < k_end)[None, :, :], other=0.0)
        shape: tl.constexpr = (BLOCK_M, BLOCK_K // 8, 2, 2, 2)
    even, odd = tl.split(tl.reshape(xw.to(tl.float32), shape))
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


NIBBLE = 15  # the `nibble` argument of the kernels whose INT4 decode is int4_code


@jit
def int4_code(low, high, nibble, J: tl.constexpr):
    """INT4 nibble J of the packed words (low: the words, uint32; high: low >> 12) as its value
    n - 8 in fp32, exactly, in one LOP3 and one FADD: the nibble stays at its place p (bits
    4J.., or 4J - 12 of high for J >= 5, so that it sits below bit 23) and is OR-ed under the
    fp32 exponent 150 - p, which gives bit p the weight 1: the float reads 2^(23 - p) + n;
    minus 2^(23 - p) + 8 it is n - 8 (all small integers: exact). nibble: 15, a kernel
    argument (see _w4_gemv_kernel)."""
    if J < 5:
        src = low
        P: tl.constexpr = 4 * J
    else:
        src = high
        P: tl.constexpr = 4 * J - 12
    bits = (src & (nibble << P)) | ((150 - P) << 23)
    return bits.to(tl.float32, bitcast=True) - ((1 << (23 - P)) + 8)


# Under the interpreter (CPU tests) no PTX: the halves are moved out in Triton ops instead.
# Compiled (a GPU, or the sm_90 compile-only check), one cvt.f32.f16 per half, reading it
# where it lies (sm_90: HADD2.F32 on .H0 / .H1; Triton's int16 casts emitted PRMT and IMAD
# moves first: 430 instructions a 64x128 one-row step, against INT4's 287).
HALVES_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1") if tl else None


@jit
def f16_halves(bits):
    """The two fp16 halves of 32-bit words as fp32 (low, high), exactly (fp16 subnormals
    are fp32 normals)."""
    if HALVES_PTX:
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r", [bits], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        low = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@jit
def e2m1_spread(packed):
    """The packed words with each nibble's sign set 6 bits above its magnitude's foot (where
    an fp16 half wants it, bit 15 over bit 9): (even, odd), the even nibbles' magnitudes at
    8i..8i+2 with their signs at 8i+6, the odd ones' at 8i+4.. with signs at 8i+10 (the
    other bits hold what e2m1_pair masks off). One shift and two LOP3s a word, shared by
    three of its four pairs."""
    p3 = packed << 3  # every sign 3 bits up: 6 above its own magnitude's foot
    even = (packed & 0x07070707) | (p3 & 0xF8F8F8F8)
    odd = (packed & 0x70707070) | (p3 & 0x8F8F8F8F)
    return even, odd


@jit
def e2m1_pair(packed, even, odd, J: tl.constexpr):
    """NVFP4 nibbles J and J + 4 (J < 4) of the packed words as fp32, each its e2m1 value times
    2^-14, exactly: both are placed at once as the two fp16 halves s.000e1e0.m of one word
    (magnitude bits e1e0m at 9..11 and 25..27, signs at 15 and 31: from e2m1_spread's words
    one shift and one AND; J = 3, whose nibble 7's sign left the word in the spread, from
    the packed word: a shift and a LOP3), each half then read as fp16 (e = 0 is fp16's
    subnormal: no select) and converted to fp32."""
    if J == 0:
        bits = (even << 9) & 0x8E008E00
    elif J == 1:
        bits = (odd << 5) & 0x8E008E00
    elif J == 2:
        bits = (even << 1) & 0x8E008E00
    else:
        bits = ((packed >> 3) & 0x0E000E00) | (packed & 0x80008000)
    return f16_halves(bits)


@jit
def _gemv_add(part, val, x, BLOCK_M: tl.constexpr):
    """part + the decoded values [BN, W] times one column's activations x ([W], or [BM, W])."""
    if BLOCK_M == 1:
        out = part + val * x[None, :]
    else:
        out = part + val[None, :, :] * x[:, None, :]
    return out


@jit
def w4_gemv_words(packed, xs, sc, nibble, FP4: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K step of the GEMV: per packed word (packed [BN, W] uint32) and row, the sum over
    its 8 nibbles of the decoded code times the row's activation (xs: w4_columns), in fp32,
    scaled by sc ([BN, 1] or [BN, W]): [BN, W], or [BM, BN, W]. No I2F: INT4's nibble j is
    decoded where it lies (int4_code: one LOP3 and one FADD, exact); NVFP4's nibbles two at a
    time as fp16 halves (e2m1_pair: each value times 2^-14, which rides on the scale)."""
    if BLOCK_M == 1:
        part = tl.zeros(packed.shape, dtype=tl.float32)
    else:
        part = tl.zeros((BLOCK_M, packed.shape[0], packed.shape[1]), dtype=tl.float32)
    if FP4:
        even, odd = e2m1_spread(packed)
        for j in tl.static_range(4):
            low, high = e2m1_pair(packed, even, odd, j)
            part = _gemv_add(part, low, xs[j], BLOCK_M)
            part = _gemv_add(part, high, xs[j + 4], BLOCK_M)
    else:
        high = packed >> 12  # nibbles 5..7 at bits 8..19 (int4_code)
        for j in tl.static_range(8):
            part = _gemv_add(part, int4_code(packed, high, nibble, j), xs[j], BLOCK_M)
    if FP4:
        sc = sc * 16384.0  # the decoded values' 2^-14 (exact)
    if BLOCK_M == 1:
        out = part * sc
    else:
        out = part * sc[None, :, :]
    return out


@jit
def w4_gemv_step(w_rows, s_rows, n_ok, k0, K, xs, nibble, GROUP: tl.constexpr,
                 PER_ROW_SCALE: tl.constexpr, FP4: tl.constexpr, SOFT_E4M3: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step of the GEMV over the packed words of columns k0 .. k0 + BLOCK_K - 1 of the
    rows w_rows / s_rows ([BN, 1] pointers; rows past n_ok and columns past K read as zero
    codes and scales): w4_gemv_words of them with the activations' columns xs."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    w_ok = n_ok[:, None] & (word * 8 < K)[None, :]
    if EVEN:
        packed = tl.load(w_rows + word[None, :])
    else:
        packed = tl.load(w_rows + word[None, :], mask=w_ok, other=0)  # [BN, W]
    packed = packed.to(tl.uint32, bitcast=True)  # logical shifts: no sign extension
    if PER_ROW_SCALE:
        sc = _scales(s_rows + k0 // GROUP, n_ok[:, None], SOFT_E4M3)  # [BN, 1]
    else:
        sc = _scales(s_rows + (word * 8 // GROUP)[None, :], w_ok, SOFT_E4M3)  # [BN, W]
    return w4_gemv_words(packed, xs, sc, nibble, FP4, BLOCK_M)


@jit
def _w4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, rs_ptr, c_ptr, p_ptr, counter_ptr, M, N, K, k_per_split, splits,
    stride_xm, stride_wn, stride_sn, stride_cm, nibble,
    GROUP: tl.constexpr, PER_ROW_SCALE: tl.constexpr, FP4: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr, SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    # a few activation rows (decode at small batch, a verify's rows), program (m tile, n tile,
    # K split). The weight tile stays [BN, BK / 8] packed words as memory holds them (K
    # contiguous), each word decoded once for all BLOCK_M rows and summed per word in fp32
    # (w4_gemv_words; GROUP a multiple of 8: a word lies in one group; PER_ROW_SCALE: the step
    # lies in one group); the words are summed once after the loop. No tensor cores and no
    # reshape of the weights: a few registers a thread, many loads in flight. One row keeps
    # 2-D tiles (sm_90: 260 instructions a 64x128 step; the 3-D form with a unit row axis
    # needs more). EVEN: N, K and the split's K range are multiples of the tiles: the weights
    # load without masks. nibble: 15, passed at run time: as a constant, ptxas rematerializes
    # the INT4 decode's masks (int4_code) before every use (sm_90: 320 instructions a 1x64x128
    # step; held in a register: 260). STAGES (the plan's num_stages): the weight tiles feed
    # no dot, so the compiler pipelines them only when asked: 3 keeps two steps' tiles in
    # flight through cp.async (sm_90: 287 instructions a step), 1 loads one and waits for it
    # at each step.
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    if BLOCK_M == 1:
        x_rows = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    else:
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    words = tl.arange(0, BLOCK_K // 8)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        xs = w4_columns(x_rows, k0 // 8 + words, k_end, m_ok, BLOCK_M, BLOCK_K)
        acc += w4_gemv_step(w_rows, s_rows, n_ok, k0, K, xs, nibble, GROUP, PER_ROW_SCALE, FP4,
                            SOFT_E4M3, BLOCK_M, BLOCK_K, EVEN)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_ROW_SCALE:
        out = out * tl.load(rs_ptr + rn, mask=n_ok, other=0.0)[None, :]
    store_tile(out, c_ptr, p_ptr, counter_ptr, rm, rn, M, N, stride_cm, splits, SPLIT)
