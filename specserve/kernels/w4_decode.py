"""4-bit weight decoding inside the kernels (kernels/w4a16_gemm.py, kernels/fused_moe.py): the
packed words of a tile, their nibbles as 16-bit float bits (INT4 by the magic number, NVFP4's
e2m1 built from its bits), and the fp32 decodes of e2m1 codes and e4m3 scales. No int-to-float
conversion in any of them; every value exact."""

from __future__ import annotations

from specserve.kernels.dispatch import jit, tl


@jit
def _decode_e2m1(nib):
    # the fp32 value built from its bits: e2m1 s.e1e0.m is 2^(e - 1) * (1 + m / 2) for e > 0
    # (fp32 exponent e + 126, mantissa's top bit m) and m / 2 for e = 0 (0.5: exponent 126);
    # the sign to bit 31
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@jit
def _decode_e4m3(bits):
    """float8 e4m3 codes (uint8) -> fp32, exactly, without the GPU's e4m3 type (Ampere lacks
    it): normals 2^(e - 7) * (1 + m / 8) built as fp32 bits, subnormals m * 2^-9."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -mag, mag)


# INT4 by the magic number: the 16-bit float whose mantissa's last ulp is 1 (bf16: 128, 7
# mantissa bits; fp16: 1024, 10 bits): (nibble | its bits) is it + nibble exactly; subtracting
# the offset (it + INT4's zero point 8) leaves the code's value, exactly. constexpr globals
# (@jit code reads only those)
MAGIC_BF16, MAGIC_FP16, OFFSET_BF16, OFFSET_FP16 = (
    (tl.constexpr(v) if tl is not None else v) for v in (0x4300, 0x6400, 136.0, 1032.0))
# NVFP4 codes set at the 16-bit exponent's foot are e2m1 * 2^-126 (bf16) / 2^-14 (fp16)
FP4_UNBIAS_BF16, FP4_UNBIAS_FP16 = (
    (tl.constexpr(v) if tl is not None else v) for v in (2.0**126, 2.0**14))


@jit
def _packed_words(w_rows, n_ok, k0, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The [BN, BK/8] packed words of columns k0 .. k0 + BLOCK_K - 1 (0 past N or K, masked
    unless EVEN: sm_90 code of a 16-row INT4 step 389 -> 325 instructions without the mask)."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if EVEN:
        packed = tl.load(w_rows + word[None, :])
    else:
        packed = tl.load(w_rows + word[None, :], mask=n_ok[:, None] & (word * 8 < K)[None, :],
                         other=0)  # fmt: skip
    return packed


@jit
def _shift(x, s: tl.constexpr):
    # x << s for s >= 0, x >> -s otherwise (bits the callers mask away may be sign copies)
    if s >= 0:
        return x << s
    else:
        return x >> (-s)


@jit
def _code_pair_bits(packed, SHIFT: tl.constexpr, FP4: tl.constexpr, BF16: tl.constexpr):
    """The nibbles at SHIFT and SHIFT + 16 of packed words as two 16-bit float bit patterns in
    one int32 (low half, high half): two codes a shift and a mask or two. INT4: magic + nibble
    (MAGIC_*). NVFP4: the code's bits e1e0m set at the exponent's foot (its mantissa's top bit
    at m), the sign at bit 15: the 16-bit float e2m1 * 2^-126 (bf16) or * 2^-14 (fp16) for
    every code, 0.5 (e = 0) a subnormal, so FP4_UNBIAS_* times it is the value, exactly."""
    if FP4:
        foot: tl.constexpr = 6 if BF16 else 9  # the mantissa's top bit
        mag = _shift(packed, foot - SHIFT) & (0x01C001C0 if BF16 else 0x0E000E00)
        return mag | (_shift(packed, 12 - SHIFT) & -0x7FFF8000)  # & 0x80008000: the signs
    else:
        return ((packed >> SHIFT) & 0x000F000F) | (0x43004300 if BF16 else 0x64006400)


@jit
def _pair_halves(pair):
    return tl.join(pair.to(tl.int16), (pair >> 16).to(tl.int16))


@jit
def w4_codes16(
    w_rows, n_ok, k0, K, FP4: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False,
):  # fmt: skip
    """The codes of columns k0 .. k0 + BLOCK_K - 1 as the bits [BLOCK_N, BLOCK_K] int16 of 16-bit
    floats (bf16 or fp16; _code_pair_bits): INT4 code + offset (MAGIC_* / OFFSET_*: bitcast and
    subtract the offset in that type), NVFP4 the value / FP4_UNBIAS_* (bitcast and multiply):
    one packed HADD2 / HMUL2 per two values on sm_90, exactly. No int-to-float conversion;
    word-wide bit operations decode two codes at once, and each word's eight values stay in
    one thread (joined, not broadcast and reshaped through shared memory). Rows past n_ok and
    columns past K decode as nibble 0 (zero scales or activations meet them)."""
    packed = _packed_words(w_rows, n_ok, k0, K, BLOCK_K, EVEN)  # [BN, BK/8]
    # join adds its axis last, so three joins index nibble 4i + 2j + k at [.., i, j, k]: the
    # innermost pairs are nibbles (0, 4), (2, 6), (1, 5), (3, 7), each one word's halves
    a = tl.join(_pair_halves(_code_pair_bits(packed, 0, FP4, BF16)),
                _pair_halves(_code_pair_bits(packed, 8, FP4, BF16)))
    b = tl.join(_pair_halves(_code_pair_bits(packed, 4, FP4, BF16)),
                _pair_halves(_code_pair_bits(packed, 12, FP4, BF16)))
    return tl.reshape(tl.join(a, b), (BLOCK_N, BLOCK_K))  # word-major, nibble 0 first


@jit
def _scales(ptrs, mask, SOFT_E4M3: tl.constexpr, FAST: tl.constexpr = False,
            DTYPE: tl.constexpr = None):
    """Scales as fp32, or with FAST in DTYPE (where w4_tile guarantees the conversion exact)."""
    if SOFT_E4M3:  # e4m3 scales read as bytes
        sc = _decode_e4m3(tl.load(ptrs, mask=mask, other=0))
    else:
        sc = tl.load(ptrs, mask=mask, other=0.0)
    if FAST:
        sc = sc.to(DTYPE)
    else:
        sc = sc.to(tl.float32)
    return sc
