"""The FP8 and W4A16 Triton kernels against torch references written here (per-group loops,
bit-by-bit unpacking), under the interpreter on the CPU (tiny fp32 shapes, one subprocess:
`python tests/test_quant_kernels.py` prints a JSON line) and on CUDA (gpu marker, bf16,
Llama-3.1-8B shapes). Shapes include K and N that are not multiples of the tiles or blocks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import compiling, interpreter_test, report  # noqa: E402

from specserve.kernels import fp8_gemm, w4_decode, w4a16_gemm  # noqa: E402
from specserve.kernels.split_kv import split_counters  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
FP8 = torch.float8_e4m3fn
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# -- references ---------------------------------------------------------------------------------


def ref_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group: s = amax / 448, q = fp8(x / s) (torch's cast rounds to nearest even)."""
    xf = x.float().cpu()
    q, scales = torch.empty(xf.shape, dtype=FP8), []
    for start in range(0, xf.shape[1], group):
        part = xf[:, start : start + group]
        s = part.abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
        q[:, start : start + group] = (part / s).to(FP8)
        scales.append(s)
    return q, torch.cat(scales, 1)


def ref_fp8_mm(xq, xs, act_group, w, ws_full) -> torch.Tensor:
    """Sum over K groups of (x_q . w_q^T) * x_s * w_s, w_s given per weight element [N, K]."""
    m, k = xq.shape
    out = torch.zeros(m, w.shape[0], dtype=torch.float64)
    wd = w.double().cpu() * ws_full.double().cpu()
    for g, start in enumerate(range(0, k, act_group)):
        a = xq[:, start : start + act_group].double().cpu() * xs[:, g : g + 1].double().cpu()
        out += a @ wd[:, start : start + act_group].t()
    return out


def ref_w4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    k: int,
    fp4: bool,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The [N, K] weight: columns i, i + 8, ... come from nibble i of each word."""
    p = packed.cpu().long() & 0xFFFFFFFF
    n, words = p.shape
    codes = torch.empty(n, words * 8, dtype=torch.long)
    for i in range(8):
        codes[:, i::8] = (p >> (4 * i)) & 0xF
    codes = codes[:, :k]
    if fp4:
        sign = 1.0 - 2.0 * (codes >= 8).double()
        val = torch.tensor(E2M1, dtype=torch.float64)[codes % 8] * sign
    else:
        val = (codes - 8).double()
    col_group = torch.arange(k) // group
    w = val * scales.double().cpu()[:, col_group]
    if row_scale is not None:
        w *= row_scale.double().cpu()[:, None]
    return w


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} vs {rtol} x {scale:.3g}"


# -- checks (device, dtype, shapes) -------------------------------------------------------------


def check_quant(m: int, k: int, group: int, dtype, device) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype) * 3
    # values that round to zero keep their sign (-0 is code 0x80), -0.0 itself included
    x[0, :4] = torch.tensor([-1e-9, -0.0, 1e-9, 0.0], dtype=dtype)
    q, s = fp8_gemm.quant_fp8(x.to(device), group)
    rq, rs = ref_quant(x, group)
    assert torch.equal(s.cpu(), rs), "scales differ"
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)), "codes differ"
    static = torch.tensor(0.02, device=device)
    q, s = fp8_gemm.quant_fp8(x.to(device), group, static)
    want = (x.float() / 0.02).clamp(-448, 448).to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8)), "static codes differ"


def check_fp8_mm(m: int, n: int, k: int, strategy: str, plan, dtype, device, rtol) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    if strategy == "block":
        ws = torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.5
        ws_full = ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        group, bn, bk = 128, 128, 128
    else:  # per-channel weights, per-token activations
        ws = torch.rand(n, 1, generator=gen) + 0.5
        ws_full, group, bn, bk = ws.expand(n, k), k, 1, k
    xq, xs = ref_quant(x, group)
    got = fp8_gemm.fp8_mm(
        xq.to(device), xs.to(device), group, w.to(device), ws.to(device), bn, bk, dtype, plan=plan
    )
    if compiling():
        return
    _close(got, ref_fp8_mm(xq, xs, group, w, ws_full), rtol)


def check_w4(m: int, n: int, k: int, group: int, fp4: bool, plan, dtype, device, rtol,
             soft: bool | None = None) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 8)), generator=gen, dtype=torch.int32)
    # scales over e4m3's range, subnormals (below 2^-6) included
    scales = torch.rand(n, -(-k // group), generator=gen) * 0.1 + 0.01
    if fp4:
        scales = scales * torch.logspace(-9, 8, scales.shape[1], base=2.0)
    scales = scales.to(FP8) if fp4 else scales.to(dtype)
    row = torch.rand(n, generator=gen) + 0.5 if fp4 else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = w4a16_gemm.w4a16_mm(
        x.to(device),
        packed.to(device),
        scales.to(device),
        group,
        fp4,
        row.to(device) if fp4 else None,
        plan=plan,
        soft_e4m3=soft,
    )
    if compiling():
        return
    want = x.double() @ ref_w4(packed, scales, group, k, fp4, row).t()
    _close(got, want, rtol)


def check_fp8_linear(m: int, n: int, k: int, static: bool, plan, dtype, device, rtol) -> None:
    """Activations quantized inside the GEMM (128-groups, or a static scale) = quantized first."""
    gen = torch.Generator().manual_seed(m + n * k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    ws = torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.5
    ws_full = ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    if static:
        xq = (x.float() / 0.01).clamp(-448, 448).to(FP8)
        xs = torch.full((m, -(-k // 128)), 0.01)
        scale = torch.tensor(0.01, device=device)
    else:
        (xq, xs), scale = ref_quant(x, 128), None
    got = fp8_gemm.fp8_linear(
        x.to(device), w.to(device), ws.to(device), 128, 128, 128, scale, plan=plan
    )
    if compiling():
        return
    assert got.dtype == dtype
    _close(got, ref_fp8_mm(xq, xs, 128, w, ws_full), rtol)
    assert not split_counters(1, torch.device(device)).any(), "arrival counters left non-zero"


def check_e4m3_decode() -> None:
    """Every e4m3 code but NaN, decoded from its bits in a kernel == torch's conversion."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(src, dst):
        i = tl.arange(0, 256)
        tl.store(dst + i, w4_decode._decode_e4m3(tl.load(src + i)))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    decode[(1,)](codes, out)
    want = codes.view(FP8).float()
    ok = ~want.isnan()
    assert torch.equal(out[ok], want[ok]), (out[ok] - want[ok]).abs().max()


def check_e2m1_decode() -> None:
    """Every e2m1 nibble decoded in a kernel == decode_nibbles (signs, -0 and 0.5 included)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(src, dst):
        i = tl.arange(0, 16)
        tl.store(dst + i, w4_decode._decode_e2m1(tl.load(src + i)))

    nib = torch.arange(16, dtype=torch.int32)
    out = torch.empty(16)
    decode[(1,)](nib, out)
    want = w4a16_gemm.decode_nibbles(nib, fp4=True)
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit()), (out, want)


def check_codes16_decode() -> None:
    """w4_codes16 over words holding every nibble at every position, in bf16 and fp16: INT4
    magic + nibble, NVFP4 the e2m1 value / FP4_UNBIAS_* (signs and -0 included, 0.5 a
    subnormal), in word order (the GEMMs are checked in fp16 above: the interpreter's bf16
    tl.dot is unusable)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(src, dst, FP4: tl.constexpr, BF16: tl.constexpr):
        rows = tl.arange(0, 16)
        codes = w4_decode.w4_codes16(src + rows[:, None] * 2, rows < 16, 0, 16, FP4, BF16, 16,
                                      16)  # fmt: skip
        tl.store(dst + rows[:, None] * 16 + tl.arange(0, 16)[None, :], codes)

    # the bits are compared: the interpreter's bf16 -> fp32 conversion loses subnormals
    nib = (torch.arange(16)[:, None] + torch.arange(16)[None, :] * 7) % 16  # [16 rows, 16]
    words = (nib.view(16, 2, 8) << (torch.arange(8) * 4)).sum(-1)  # [16, 2] (int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    for fp4 in (False, True):
        for dtype, base, unbias in ((torch.bfloat16, 128, 2.0**126), (torch.float16, 1024, 2.0**14)):
            out = torch.empty(16, 16, dtype=torch.int16)
            decode[(1,)](words, out, fp4, dtype == torch.bfloat16)
            want = (w4a16_gemm.decode_nibbles(nib, fp4=True) / unbias if fp4
                    else (nib + base).float())  # fmt: skip
            assert torch.equal(out, want.to(dtype).view(torch.int16)), (fp4, dtype, out, want)


CPU, F32, TOL32 = "cpu", torch.float32, 1e-5
INTERPRETER_CHECKS = {
    "quant_group128_ragged_k": lambda: check_quant(5, 200, 128, F32, CPU),
    "quant_per_token": lambda: check_quant(3, 72, 72, F32, CPU),
    "fp8_block_ragged": lambda: check_fp8_mm(
        5, 200, 200, "block", (16, 32, 64, 1), F32, CPU, TOL32
    ),
    "fp8_block_split3": lambda: check_fp8_mm(
        20, 72, 328, "block", (16, 32, 32, 3), F32, CPU, TOL32
    ),
    "fp8_channel_split2": lambda: check_fp8_mm(
        3, 40, 136, "channel", (16, 32, 32, 2), F32, CPU, TOL32
    ),
    "int4_g32_ragged": lambda: check_w4(3, 72, 200, 32, False, (16, 32, 64, 1), F32, CPU, TOL32),
    "int4_g128_split2": lambda: check_w4(20, 40, 264, 128, False, (16, 32, 64, 2), F32, CPU, TOL32),
    "int4_g24_column_scales": lambda: check_w4(
        3, 40, 200, 24, False, (16, 32, 64, 2), F32, CPU, TOL32
    ),
    "int4_default_plan_prefill": lambda: check_w4(70, 40, 200, 32, False, None, F32, CPU, TOL32),
    # 16-bit activations, steps inside one group: the magic-number decode (codes + 1032 in
    # fp16, the offset subtracted before the dot), ragged N and K, split or one row
    "int4_offset_codes_fp16": lambda: check_w4(
        20, 40, 264, 128, False, (16, 32, 64, 2), torch.float16, CPU, 1e-3
    ),
    "int4_offset_codes_fp16_one_row": lambda: check_w4(
        1, 72, 200, 64, False, (16, 32, 64, 1), torch.float16, CPU, 1e-3
    ),
    # and several groups a step (scaled in fp16) or each column's scale
    "int4_magic_fp16_groups": lambda: check_w4(
        5, 40, 200, 16, False, (16, 32, 64, 2), torch.float16, CPU, 1e-3
    ),
    "int4_magic_fp16_column_scales": lambda: check_w4(
        3, 40, 200, 24, False, (16, 32, 64, 1), torch.float16, CPU, 1e-3
    ),
    # N and K that the tiles divide: the weights load without masks (EVEN), FP8 and 4-bit
    "fp8_even_split2": lambda: check_fp8_mm(3, 64, 256, "block", (16, 32, 64, 2), F32, CPU, TOL32),
    "gemv_fp8_even_in_loop_quant": lambda: check_fp8_linear(
        1, 64, 256, False, (1, 32, 128, 2), F32, CPU, TOL32
    ),
    "int4_even_fp32": lambda: check_w4(5, 64, 256, 32, False, (16, 32, 64, 2), F32, CPU, TOL32),
    "int4_even_fp16": lambda: check_w4(
        20, 64, 256, 128, False, (16, 32, 64, 2), torch.float16, CPU, 1e-3
    ),
    "nvfp4_even_fp16": lambda: check_w4(
        3, 64, 256, 16, True, (16, 32, 64, 1), torch.float16, CPU, 1e-3
    ),
    "nvfp4_fp16_groups": lambda: check_w4(
        3, 40, 208, 16, True, (16, 32, 64, 2), torch.float16, CPU, 1e-3
    ),
    "nvfp4_fp16_soft_e4m3_one_step": lambda: check_w4(
        5, 40, 256, 16, True, (16, 32, 16, 1), torch.float16, CPU, 1e-3, soft=True
    ),
    "codes16_decode": lambda: check_codes16_decode(),
    "fp8_default_plan_prefill": lambda: check_fp8_linear(70, 40, 200, False, None, F32, CPU, TOL32),
    "nvfp4_rowscale_split2": lambda: check_w4(
        3, 40, 208, 16, True, (16, 32, 64, 2), F32, CPU, TOL32
    ),
    # NVFP4 without the GPU's e4m3 type (Ampere): scales decoded from their bits
    "nvfp4_soft_e4m3_scales": lambda: check_w4(
        3, 40, 208, 16, True, (16, 32, 64, 2), F32, CPU, TOL32, soft=True
    ),
    "nvfp4_soft_e4m3_per_step": lambda: check_w4(
        5, 40, 256, 16, True, (16, 32, 16, 1), F32, CPU, TOL32, soft=True
    ),
    "e4m3_soft_decode_all_codes": lambda: check_e4m3_decode(),
    "e2m1_decode_all_codes": lambda: check_e2m1_decode(),
    "fp8_in_loop_quant_split3": lambda: check_fp8_linear(
        5, 72, 456, False, (16, 32, 128, 3), F32, CPU, TOL32
    ),
    "fp8_static_quant": lambda: check_fp8_linear(
        3, 40, 200, True, (16, 32, 64, 2), F32, CPU, TOL32
    ),
    # GEMV plans (block_m < 16: no tensor cores), one to four rows, ragged and split
    "gemv_fp8_block_split3": lambda: check_fp8_mm(
        3, 72, 328, "block", (4, 16, 32, 3), F32, CPU, TOL32
    ),
    "gemv_fp8_channel": lambda: check_fp8_mm(
        1, 40, 136, "channel", (1, 32, 32, 2), F32, CPU, TOL32
    ),
    "gemv_fp8_in_loop_quant": lambda: check_fp8_linear(
        2, 72, 456, False, (2, 32, 128, 3), F32, CPU, TOL32
    ),
    "gemv_fp8_static_default_plan": lambda: check_fp8_linear(
        1, 40, 200, True, None, F32, CPU, TOL32
    ),
    "gemv_int4_g32_ragged": lambda: check_w4(
        3, 72, 200, 32, False, (4, 16, 64, 2), F32, CPU, TOL32
    ),
    "gemv_w4_one_row_int4_g128": lambda: check_w4(
        1, 40, 264, 128, False, (1, 32, 128, 2), F32, CPU, TOL32
    ),
    "gemv_nvfp4_rowscale": lambda: check_w4(
        2, 40, 208, 16, True, (2, 32, 64, 2), F32, CPU, TOL32
    ),
    # one row: the packed-layout GEMV kernel (scales per word, ragged K, split, soft e4m3)
    "gemv_w4_one_row_int4_g32": lambda: check_w4(
        1, 72, 200, 32, False, (1, 16, 64, 3), F32, CPU, TOL32
    ),
    "gemv_w4_one_row_nvfp4": lambda: check_w4(
        1, 40, 208, 16, True, (1, 32, 64, 2), F32, CPU, TOL32, soft=True
    ),
    # a few rows: one decode of each weight for all of them (ragged M, N, K; scales per word)
    "gemv_w4_rows_int4_g32": lambda: check_w4(
        3, 72, 200, 32, False, (4, 16, 64, 3), F32, CPU, TOL32
    ),
    "gemv_w4_rows_int4_g128_even": lambda: check_w4(
        2, 64, 512, 128, False, (2, 32, 128, 2), F32, CPU, TOL32
    ),
    "gemv_w4_rows_nvfp4": lambda: check_w4(
        5, 40, 208, 16, True, (8, 32, 64, 2), F32, CPU, TOL32, soft=True
    ),
    # tiles that divide N, K and the splits: the unmasked (EVEN) loads
    "gemv_w4_one_row_int4_g128_even": lambda: check_w4(
        1, 64, 512, 128, False, (1, 32, 128, 2), F32, CPU, TOL32
    ),
    "gemv_w4_one_row_int4_g32_even": lambda: check_w4(
        1, 64, 256, 32, False, (1, 16, 64, 4), F32, CPU, TOL32
    ),
}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


BF16, TOL16 = torch.bfloat16, 2e-2


# compile-only (tests/triton_compile.py): the default plans at Llama-3.1-8B shapes, bf16
GPU_DIM_CHECKS = {
    **{f"bf16_quant_{m}": (lambda m=m: check_quant(m, 4096, 128, BF16, CPU)) for m in (1, 200)},
    **{f"bf16_fp8_{s}_{m}": (lambda s=s, m=m: check_fp8_mm(m, 6144, 4096, s, None, BF16, CPU,
                                                           TOL16))
       for s in ("block", "channel") for m in (1, 7, 64, 300)},
    **{f"bf16_fp8_linear_{st}_{m}": (lambda st=st, m=m: check_fp8_linear(
        m, 6144, 4096, st, None, BF16, CPU, TOL16)) for st in (False, True) for m in (1, 300)},
    **{f"bf16_w4_g{g}_{m}": (lambda g=g, fp4=fp4, m=m: check_w4(
        m, 4096, 4096, g, fp4, None, BF16, CPU, TOL16))
       for g, fp4 in ((32, False), (128, False), (16, True)) for m in (1, 7, 64, 300)},
    # the one-row GEMV kernel under a plan the sweep may store (unmasked tiles)
    **{f"bf16_w4_gemv_g{g}_{m}": (lambda g=g, fp4=fp4, m=m: check_w4(
        m, 6144, 4096, g, fp4, (m, 64, 256 if m == 1 else 128, 8, 4, 3), BF16, CPU, TOL16))
       for g, fp4 in ((128, False), (16, True)) for m in (1, 4)},
}  # fmt: skip


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
