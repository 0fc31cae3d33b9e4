"""The fused MoE kernel with NVFP4 experts (W4A16: e2m1 codes, e4m3 scales per 16, a global
scale per expert and part) against fused_moe_ref and a float64 token-by-token loop on weights
quantized and dequantized here (bucketed e2m1 rounding, codes packed byte by byte as ModelOpt
writes them, the bytes viewed as int32 words as the engine loads them).

The experts are built so that a misplaced scale shows: each expert's matrices have their own
magnitude and the up rows a larger one than the gate rows (so every (expert, part) global
scale differs), and `spread` makes the gate/up scales span e4m3's range down to subnormals
while the activations undo it (every scale group weighs about the same in the output).

CPU: tiny fp32 shapes under the Triton interpreter, in one subprocess (`python
tests/test_fused_moe_nvfp4.py` prints a JSON line of results that `test_interpreter` reads):
ragged N, top-k 1..3, per-pair (decode) and sorted blocks, the decode and batch launch
configs and hand-picked tiles (one scale per K step, several groups a step), e4m3 scales read
as e4m3 and decoded from their bits (GPUs without the e4m3 type). GPU tests (marker `gpu`):
Kimi K2 expert shapes in bf16. GPU_DIM_CHECKS: the same launches at those dims, compiled only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import compiling, interpreter_test, report  # noqa: E402
from test_fused_moe import (  # noqa: E402
    HAS_CUDA,
    K64,
    SMALL,
    _poison_allocator,
    _small_launch,
    check_against,
    check_alignment,
    check_graph_replay,
    make_inputs,
    naive_moe,
    rel_error,
)

from specserve.kernels import fused_moe as fm  # noqa: E402

FP8 = torch.float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # rounding boundaries between them


def quantize_nvfp4(w: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """Stacked experts [E, N, K] (K a multiple of 16; `parts` row parts with a global scale
    each) -> (int32 words [E, N, K/8], e4m3 scales [E, N, K/16], global scales [E, parts] fp32,
    the fp32 weight the three mean [E, N, K]). One expert at a time (Kimi-sized stacks)."""
    num, n, k = w.shape
    dev = w.device
    table = torch.tensor(E2M1, device=dev)
    bounds = torch.tensor(MIDPOINTS, device=dev)
    words, scales, globs, deqs = [], [], [], []
    for matrix in w.float():
        g = matrix.view(parts, n // parts, k // 16, 16)
        glob = g.abs().amax(dim=(1, 2, 3)) / (6.0 * 448.0)  # [parts]: amax / 2688
        s = (g.abs().amax(-1) / 6.0 / glob[:, None, None]).to(FP8)  # [parts, N/parts, K/16]
        unit = (s.float() * glob[:, None, None])[..., None]
        scaled = torch.where(unit > 0, g / unit.clamp_min(1e-30), torch.zeros_like(g))
        idx = torch.bucketize(scaled.abs(), bounds)  # nearest e2m1 magnitude (ties: lower)
        code = (idx + 8 * (scaled < 0)).reshape(n, k)
        deq = torch.where(scaled < 0, -table[idx], table[idx]) * s.float()[..., None]
        deqs.append((deq * glob[:, None, None, None]).reshape(n, k))
        byte = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)  # low nibble: even k
        words.append(byte.view(torch.int32))  # little-endian: byte j of word c = k 8c+2j, +1
        scales.append(s.reshape(n, k // 16))
        globs.append(glob)
    return torch.stack(words), torch.stack(scales), torch.stack(globs), torch.stack(deqs)


def nvfp4_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """(ExpertWeights gate_up, down, dequantized w13, w2) on the weights' device."""
    (c13, s13, g13, d13), (c2, s2, g2, d2) = quantize_nvfp4(w13, 2), quantize_nvfp4(w2, 1)
    e13 = fm.ExpertWeights(fm.NVFP4, c13, s13, w13.shape[2], 1, 16, 2, g13)
    e2 = fm.ExpertWeights(fm.NVFP4, c2, s2, w2.shape[2], 1, 16, 1, g2)
    return e13, e2, d13, d2


def shaped_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                  seed: int, skew: float, spread: bool, device: str) -> tuple:  # fmt: skip
    """make_inputs with an own magnitude per expert, up rows 3x the gate rows and, with
    `spread`, gate/up columns scaled by 2^0 .. 2^-16 per 16-group (x scaled back up)."""
    x, w13, w2, weights, ids = make_inputs(num_tokens, num_experts, top_k, hidden, inter, seed,
                                           skew, device=device)  # fmt: skip
    per_expert = (1.0 + torch.arange(num_experts, device=device) % 5) / 3.0
    w13 = w13 * per_expert[:, None, None]
    w2 = w2 * per_expert.flip(0)[:, None, None]
    w13[:, inter:] *= 3.0
    if spread:
        groups = torch.linspace(0.0, -16.0, hidden // 16, device=device)
        col = torch.exp2(groups).repeat_interleave(16)  # [H]
        w13 = w13 * col
        x = x / col
    return x, w13, w2, weights, ids


def check_nvfp4_moe(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
    dtype: torch.dtype, device: str, tol: float, seed: int = 0, skew: float = 0.0,
    launch: tuple[fm.MoELaunch, fm.MoELaunch] | None = None, soft: bool | None = None,
    spread: bool = False,
) -> None:  # fmt: skip
    x, w13, w2, weights, ids = shaped_inputs(num_tokens, num_experts, top_k, hidden, inter,
                                             seed, skew, spread, device)  # fmt: skip
    e13, e2, d13, d2 = nvfp4_experts(w13, w2)
    x = x.to(dtype)
    block_m = launch[0].block_m if launch else fm.moe_launch_config(
        num_tokens, inter, hidden, num_experts, top_k, dtype, e13).block_m  # fmt: skip
    check_alignment(ids, block_m, num_experts)
    _poison_allocator(device, num_tokens * top_k * max(hidden, inter))
    out = fm.fused_moe(x, e13, e2, weights, ids, launch, soft_e4m3=soft)
    if compiling():
        return
    check_against(out, fm.fused_moe_ref(x, e13, e2, weights, ids),
                  naive_moe(x, d13, d2, weights, ids), dtype, (num_tokens, hidden), tol, "nvfp4")


# --------------------------------------------------------------------------------------------
# CPU: tiny fp32 shapes under the Triton interpreter

F32, CPU, TOL32 = torch.float32, "cpu", 1e-5
K32 = (_small_launch(16, 16, 32, 2), _small_launch(16, 32, 32, 1))
INTERPRETER_CHECKS = {
    # BLOCK_K 16: one scale per row and step; I 48 and H 80 ragged against the N tiles
    "nvfp4_ragged_top2_step": lambda: check_nvfp4_moe(
        20, 6, 2, 80, 48, F32, CPU, TOL32, seed=1, skew=0.3, launch=SMALL
    ),
    # BLOCK_K 64 over K 80 and 48: four groups a step, a ragged last step
    "nvfp4_top3_groups": lambda: check_nvfp4_moe(
        12, 4, 3, 80, 48, F32, CPU, TOL32, seed=2, launch=K64
    ),
    "nvfp4_top1_k32": lambda: check_nvfp4_moe(9, 4, 1, 64, 32, F32, CPU, TOL32, seed=3,
                                              launch=K32),  # fmt: skip
    # default launches: per-pair blocks (decode), the 32-row and 64-row batch configs
    "nvfp4_decode_default": lambda: check_nvfp4_moe(1, 32, 4, 96, 48, F32, CPU, TOL32, seed=4),
    "nvfp4_batch32_default": lambda: check_nvfp4_moe(
        40, 4, 2, 64, 48, F32, CPU, TOL32, seed=5, skew=0.2
    ),
    "nvfp4_batch64_default": lambda: check_nvfp4_moe(
        100, 4, 2, 48, 32, F32, CPU, TOL32, seed=6
    ),
    # scales from 448 down to e4m3 subnormals, read as e4m3 and decoded from their bits
    "nvfp4_spread_scales": lambda: check_nvfp4_moe(
        10, 4, 2, 256, 32, F32, CPU, TOL32, seed=7, launch=K64, spread=True
    ),
    "nvfp4_soft_e4m3_spread": lambda: check_nvfp4_moe(
        10, 4, 2, 256, 32, F32, CPU, TOL32, seed=7, launch=K64, soft=True, spread=True
    ),
    # the GEMV form (one pair a block): decode and sorted runs, scales per step and per word
    "nvfp4_gemv_decode": lambda: check_nvfp4_moe(
        2, 16, 2, 80, 48, F32, CPU, TOL32, seed=10,
        launch=(fm.MoELaunch(1, 16, 16, 1, 4, 1), fm.MoELaunch(1, 32, 16, 1, 4, 1)),
    ),
    "nvfp4_gemv_sorted_soft": lambda: check_nvfp4_moe(
        12, 4, 3, 96, 64, F32, CPU, TOL32, seed=11, soft=True, spread=True,
        launch=(fm.MoELaunch(1, 32, 64, 1, 4, 1), fm.MoELaunch(1, 16, 32, 1, 4, 1)),
    ),
    "nvfp4_soft_e4m3_decode": lambda: check_nvfp4_moe(
        2, 16, 2, 80, 48, F32, CPU, TOL32, seed=8, soft=True
    ),
    "nvfp4_soft_e4m3_step": lambda: check_nvfp4_moe(
        7, 4, 2, 48, 32, F32, CPU, TOL32, seed=9, launch=SMALL, soft=True
    ),
}

test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


def test_quantizer_layout_and_dequantize() -> None:
    """The test's quantizer packs what the engine decodes: ExpertWeights.dequantize (the
    engine's) equals the quantizer's own dequantized weight, gate and up globals apart."""
    _, w13, w2, *_ = shaped_inputs(3, 4, 2, 64, 32, 0, 0.0, True, "cpu")
    e13, e2, d13, d2 = nvfp4_experts(w13, w2)
    assert e13.weight.dtype == torch.int32 and e13.weight.shape == (4, 64, 8)
    assert e13.scale.dtype == FP8 and e13.scale.shape == (4, 64, 4)
    assert e13.global_scale.shape == (4, 2) and e2.global_scale.shape == (4, 1)
    assert (e13.global_scale[:, 1] > 2 * e13.global_scale[:, 0]).all()  # up rows 3x larger
    assert (e13.scale.float() < 2**-6).any(), "spread: some scales are e4m3 subnormals"
    for e in range(4):
        torch.testing.assert_close(e13.dequantize(e), d13[e], rtol=1e-6, atol=0)
        torch.testing.assert_close(e2.dequantize(e), d2[e], rtol=1e-6, atol=0)
    # quantization error bounded by half an e2m1 step at the top of each group
    assert rel_error(d2, w2) < 0.1


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_reference_equals_naive_loop(top_k: int) -> None:
    x, w13, w2, weights, ids = shaped_inputs(11, 8, top_k, 48, 32, top_k, 0.3, False, "cpu")
    e13, e2, d13, d2 = nvfp4_experts(w13, w2)
    ref = fm.fused_moe_ref(x, e13, e2, weights, ids)
    assert rel_error(ref, naive_moe(x, d13, d2, weights, ids)) < TOL32


def test_launch_config_counts_half_a_byte_per_weight() -> None:
    """NVFP4 tiles are sized like INT4's (0.5 byte a weight), not by the int32 words."""
    x, w13, w2, *_ = shaped_inputs(1, 4, 2, 64, 32, 0, 0.0, False, "cpu")
    e13, *_ = nvfp4_experts(w13, w2)
    int4 = fm.ExpertWeights(fm.INT4, e13.weight, e13.scale.float(), 64, 1, 16, 2)
    for m in (1, 64, 4096):
        assert fm.moe_launch_config(m, 32, 64, 4, 2, torch.bfloat16, e13) == (
            fm.moe_launch_config(m, 32, 64, 4, 2, torch.bfloat16, int4))


# --------------------------------------------------------------------------------------------
# GPU: Kimi K2 expert shapes (E 384, I 2048 or its TP-8 slice 256, H 7168), bf16


def gpu_test(fn):  # noqa: ANN001, ANN201
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")(fn))


@gpu_test
@pytest.mark.parametrize("soft", [None, True], ids=["e4m3", "soft-e4m3"])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("hidden,inter", [(7168, 256), (7168, 2048), (1008, 208)])
def test_nvfp4_fused_moe_gpu(num_tokens: int, hidden: int, inter: int, soft: bool | None) -> None:
    """Kimi K2.5 NVFP4 experts (I 2048, or its TP-8 slice) and a ragged shape, bf16
    activations; 32 experts at I 2048 (host memory of the fp32 originals)."""
    experts = 32 if inter > 256 else 384
    check_nvfp4_moe(num_tokens, experts, 8, hidden, inter, torch.bfloat16, "cuda", 2e-2,
                    seed=num_tokens, skew=0.01, soft=soft)  # fmt: skip


@gpu_test
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_nvfp4_fused_moe_gemv_gpu(num_tokens: int) -> None:
    """The GEMV form (one pair a block), per-pair and sorted blocks."""
    launch = (fm.MoELaunch(1, 64, 128, 1, 4, 3),) * 2
    check_nvfp4_moe(num_tokens, 384 if num_tokens == 1 else 8, 8, 7168, 256, torch.bfloat16,
                    "cuda", 2e-2, seed=num_tokens, skew=0.01, launch=launch)


@gpu_test
def test_nvfp4_spread_scales_gpu() -> None:
    check_nvfp4_moe(64, 16, 4, 1024, 256, torch.bfloat16, "cuda", 2e-2, seed=3, spread=True)
    check_nvfp4_moe(64, 16, 4, 1024, 256, torch.bfloat16, "cuda", 2e-2, seed=3, soft=True,
                    spread=True)  # fmt: skip


@gpu_test
def test_nvfp4_fused_moe_cuda_graph_gpu() -> None:
    """Both NVFP4 GEMMs captured once, replayed on new routing."""
    x, w13, w2, weights, ids = shaped_inputs(8, 384, 8, 1024, 256, 0, 0.0, False, "cuda")
    e13, e2, _, _ = nvfp4_experts(w13, w2)
    check_graph_replay(x.bfloat16(), e13, e2, weights, ids)


# compile-only (tests/triton_compile.py): Kimi K2 expert dims (hidden 7168, inter 256 = 2048 /
# TP 8), bf16, 8 experts and top-2, at token counts that reach each tile config: per-pair
# blocks, BLOCK_M 16/32/64/128; e4m3 scales as bytes (GPUs without the type) per-pair and
# BLOCK_M 64. (I 2048 takes the same tiles as I 256: the N tile is at most 128.)
BF16 = torch.bfloat16
GPU_DIM_CHECKS = {
    **{f"bf16_nvfp4_moe_{m}": (
        lambda m=m: check_nvfp4_moe(m, 8, 2, 7168, 256, BF16, CPU, 2e-2))
       for m in (1, 64, 96, 300, 600)},
    **{f"bf16_nvfp4_moe_{m}_soft": (
        lambda m=m: check_nvfp4_moe(m, 8, 2, 7168, 256, BF16, CPU, 2e-2, soft=True))
       for m in (1, 300)},
}  # fmt: skip


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
