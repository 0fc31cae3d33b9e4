"""Fused MoE and expert-selection kernels vs their torch references and a naive per-token loop;
quantized experts (FP8 block W8A8, INT4 W4A16) against the same loop on weights dequantized by
quant_formats.py (the loop fake-quantizes the W8A8 activations per row and 128-group).

On the CPU the kernels run on tiny fp32 shapes under the Triton interpreter, in one subprocess
(TRITON_INTERPRET must be set before triton is imported): `python tests/test_fused_moe.py`
runs the checks and prints a JSON line of results that `test_interpreter` reads. GPU tests
(marker `gpu`) run them in bf16 and fp32 on Kimi-sized shapes.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import compiling, interpreter_test, report  # noqa: E402
from quant_formats import _fake_quant_groups, quantize_experts  # noqa: E402

from specserve.kernels import fused_moe as fm  # noqa: E402
from specserve.kernels import moe_routing as mr  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON


def make_inputs(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, seed: int,
    skew: float = 0.0, unused: int = 0, device: str = "cpu",
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """x [M, H], w13 [E, 2I, H], w2 [E, H, I], weights [M, k], ids [M, k] (k distinct per
    token), fp32 on `device`. skew > 0 makes the loads ragged (low experts much likelier); the
    last `unused` experts are never chosen."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    likelihood = torch.exp(-skew * torch.arange(num_experts, dtype=torch.float, device=device))
    likelihood[num_experts - unused :] = 0
    ids = torch.zeros(num_tokens, top_k, dtype=torch.long, device=device)
    for m in range(num_tokens):
        ids[m] = torch.multinomial(likelihood, top_k, generator=gen)
    return x, w13, w2, weights, ids.int()


def naive_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, w8a8: bool = False) -> torch.Tensor:  # fmt: skip
    """Token by token, expert by expert, in float64 (on the inputs' device); w8a8: both
    GEMMs' inputs fake-quantized to fp8 per 128-group first."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w2.shape[2]

    def act(v: torch.Tensor) -> torch.Tensor:
        return _fake_quant_groups(v.float()[None], 128)[0].double() if w8a8 else v.double()

    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            h = w13[e].double() @ act(x[m])
            y = w2[e].double() @ act(F.silu(h[:inter]) * h[inter:])
            out[m] += float(weights[m, j]) * y
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def check_alignment(ids: torch.Tensor, block_m: int, num_experts: int) -> None:
    """Each pair exactly once; each block's pairs all of the block's expert; padding only as
    each expert's run needs; blocks at or past num_padded unused."""
    align = fm.align_pairs(ids, block_m, num_experts)
    num_pairs = ids.numel()
    sorted_ids = align.sorted_ids.cpu().long()
    block_expert = align.block_expert.cpu().long()
    num_padded = int(align.num_padded.item())
    used = sorted_ids[:num_padded]
    assert sorted(used[used < num_pairs].tolist()) == list(range(num_pairs))
    assert (sorted_ids[num_padded:] == num_pairs).all()
    flat = ids.flatten().cpu().long()
    per_pair = num_pairs * 4 <= num_experts
    for b in range(num_padded // block_m):
        rows = used[b * block_m : (b + 1) * block_m]
        real = rows[rows < num_pairs]
        assert len(real) == (1 if per_pair else len(real)) and len(real) > 0
        assert (flat[real] == block_expert[b]).all()
    if not per_pair:
        counts = torch.bincount(flat, minlength=num_experts)
        assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
        assert len(block_expert) * block_m >= num_pairs + num_experts * (block_m - 1)


def check_fused_moe(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
    device: str, tol: float, seed: int = 0, skew: float = 0.0, unused: int = 0,
    launch: tuple[fm.MoELaunch, fm.MoELaunch] | None = None,
) -> None:  # fmt: skip
    x, w13, w2, weights, ids = make_inputs(
        num_tokens, num_experts, top_k, hidden, inter, seed, skew, unused, device
    )
    x, w13, w2 = (t.to(dtype) for t in (x, w13, w2))
    block_m = launch[0].block_m if launch else fm.moe_launch_config(
        num_tokens, inter, hidden, num_experts, top_k, dtype).block_m  # fmt: skip
    check_alignment(ids, block_m, num_experts)
    _poison_allocator(device, num_tokens * top_k * max(hidden, inter))
    out = fm.fused_moe(x, w13, w2, weights, ids, launch)
    if compiling():
        return
    naive = naive_moe(x, w13, w2, weights, ids)  # on the rounded inputs
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    if num_tokens == 0:
        return
    assert rel_error(ref, naive) < tol, f"reference vs naive {rel_error(ref, naive):.3g}"
    err = rel_error(out, naive)
    assert err < tol, f"kernel vs naive: relative error {err:.3g} >= {tol}"
    err = rel_error(out, ref)
    assert err < tol, f"kernel vs reference: relative error {err:.3g} >= {tol}"


QUANT_FORMATS = {  # quant_formats format -> (kernel format, block rows, group along K)
    "fp8-block": (fm.FP8_BLOCK, 128, 128),
    "ct-int4-g32": (fm.INT4, 1, 32),
    "ct-int4-g128": (fm.INT4, 1, 128),
    "ct-int4-g24": (fm.INT4, 1, 24),
}


def quantized_experts(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> tuple:
    """(ExpertWeights gate_up, down, dequantized w13, w2) on the weights' device."""
    kind, group_n, group_k = QUANT_FORMATS[fmt]
    dev = w13.device
    (c13, s13, d13), (c2, s2, d2) = (
        quantize_experts(w.cpu(), fmt, p) for w, p in ((w13, 2), (w2, 1))
    )
    e13 = fm.ExpertWeights(kind, c13.to(dev), s13.to(dev), w13.shape[2], group_n, group_k, 2)
    e2 = fm.ExpertWeights(kind, c2.to(dev), s2.to(dev), w2.shape[2], group_n, group_k, 1)
    return e13, e2, d13.to(dev), d2.to(dev)


def check_quant_fused_moe(
    fmt: str, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
    dtype: torch.dtype, device: str, tol: float, seed: int = 0, skew: float = 0.0,
    launch: tuple[fm.MoELaunch, fm.MoELaunch] | None = None,
) -> None:  # fmt: skip
    x, w13, w2, weights, ids = make_inputs(
        num_tokens, num_experts, top_k, hidden, inter, seed, skew, device=device
    )
    e13, e2, d13, d2 = quantized_experts(w13, w2, fmt)
    if dtype == torch.float16 and fmt.startswith("ct-int4"):  # fp16 scales (from bf16: exact)
        e13, e2 = (replace(e, scale=e.scale.half()) for e in (e13, e2))
    x = x.to(dtype)
    _poison_allocator(device, num_tokens * top_k * max(hidden, inter))
    out = fm.fused_moe(x, e13, e2, weights, ids, launch)
    if compiling():
        return
    naive = naive_moe(x, d13, d2, weights, ids, w8a8=fmt == "fp8-block")
    check_against(out, fm.fused_moe_ref(x, e13, e2, weights, ids), naive, dtype,
                  (num_tokens, hidden), tol, fmt)


def check_against(out, ref, naive, dtype, shape, tol: float, what: str) -> None:
    """The kernel's output vs fused_moe_ref and the naive loop, and the two references."""
    assert out.dtype == dtype and out.shape == shape
    assert rel_error(ref, naive) < tol, f"reference vs naive {rel_error(ref, naive):.3g}"
    err = rel_error(out, naive)
    assert err < tol, f"{what} kernel vs naive: relative error {err:.3g} >= {tol}"
    err = rel_error(out, ref)
    assert err < tol, f"{what} kernel vs reference: relative error {err:.3g} >= {tol}"


def _poison_allocator(device: str, numel: int) -> None:
    """On CUDA, leave NaN in the caching allocator's free blocks, so that buffers the kernel
    forgets to write show up as NaN."""
    if device == "cuda":
        for _ in range(4):
            torch.full((numel * 2,), float("nan"), device=device)


def check_routing(
    num_tokens: int, num_experts: int, rule: mr.RoutingRule, device: str, seed: int = 0,
    with_bias: bool = True,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(num_tokens, num_experts, generator=gen)).to(device)
    bias = (0.2 * torch.randn(num_experts, generator=gen)).to(device) if with_bias else None
    if bias is not None:
        assert (bias < 0).any()
    weights, ids = mr.grouped_topk(logits, bias, rule)
    ref_w, ref_ids = mr.grouped_topk_ref(logits, bias, rule)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    got, order = ids.long().sort(1)
    want, ref_order = ref_ids.long().sort(1)
    assert torch.equal(got, want), "selected experts differ"
    w, rw = weights.gather(1, order), ref_w.gather(1, ref_order)
    assert (w - rw).abs().max().item() < 1e-6 * max(1.0, rule.scaling)
    if rule.renormalize:
        sums = weights.sum(1)
        assert torch.allclose(sums, torch.full_like(sums, rule.scaling), rtol=1e-5)


# --------------------------------------------------------------------------------------------
# CPU: tiny fp32 shapes under the Triton interpreter

F32, CPU, TOL32 = torch.float32, "cpu", 1e-5


def _small_launch(block_m: int, block_n: int, block_k: int, group_m: int) -> fm.MoELaunch:
    return fm.MoELaunch(block_m, block_n, block_k, group_m, num_warps=4, num_stages=1)


SMALL = (_small_launch(16, 16, 16, 2), _small_launch(16, 32, 16, 1))
GEMV_SMALL = (_small_launch(1, 16, 32, 1), _small_launch(1, 32, 32, 2))
GEMV_K64 = (_small_launch(1, 32, 64, 1), _small_launch(1, 16, 64, 1))
FP8_SMALL = (_small_launch(16, 32, 128, 2), _small_launch(16, 64, 128, 1))  # BLOCK_K = block
K64 = (_small_launch(16, 16, 64, 2), _small_launch(16, 32, 64, 1))
# W8A8: an activation near an fp8 rounding boundary may round the other way in the fp64 loop
TOL_W8A8 = 2e-3
INTERPRETER_CHECKS = {
    # sorted path, ragged loads (skewed), two experts never chosen, several blocks per expert
    "moe_ragged_top2": lambda: check_fused_moe(
        40, 8, 2, 40, 24, F32, CPU, TOL32, skew=0.5, unused=2, launch=SMALL
    ),  # fmt: skip
    "moe_top1": lambda: check_fused_moe(9, 4, 1, 32, 16, F32, CPU, TOL32, seed=1),
    "moe_top8_of_8": lambda: check_fused_moe(
        5, 8, 8, 24, 40, F32, CPU, TOL32, seed=2, launch=SMALL
    ),  # fmt: skip
    "moe_top3_odd_dims": lambda: check_fused_moe(6, 6, 3, 37, 21, F32, CPU, TOL32, seed=3),
    # per-pair blocks (M*k*4 <= E: decode), default launch from the shapes
    "moe_per_pair_decode": lambda: check_fused_moe(1, 32, 8, 48, 16, F32, CPU, TOL32, seed=4),
    "moe_per_pair_batch": lambda: check_fused_moe(
        3, 64, 4, 32, 32, F32, CPU, TOL32, seed=5, unused=20, launch=SMALL
    ),  # fmt: skip
    "moe_no_tokens": lambda: check_fused_moe(0, 4, 2, 16, 16, F32, CPU, TOL32),
    # quantized experts: ragged blocks / groups along N and K, sorted and per-pair paths
    "qmoe_fp8_ragged": lambda: check_quant_fused_moe(
        "fp8-block", 20, 6, 2, 160, 96, F32, CPU, TOL_W8A8, seed=6, skew=0.3, launch=FP8_SMALL
    ),
    "qmoe_fp8_decode": lambda: check_quant_fused_moe(
        "fp8-block", 1, 32, 4, 256, 192, F32, CPU, TOL_W8A8, seed=7
    ),
    # group 32 over BLOCK_K 16 (one scale per step) and 64 (two groups a step), K 72 and 40
    "qmoe_int4_g32_step": lambda: check_quant_fused_moe(
        "ct-int4-g32", 20, 6, 2, 72, 40, F32, CPU, TOL32, seed=8, skew=0.3, launch=SMALL
    ),
    "qmoe_int4_g32_groups": lambda: check_quant_fused_moe(
        "ct-int4-g32", 12, 4, 3, 72, 40, F32, CPU, TOL32, seed=9, launch=K64
    ),
    # fp16 activations and scales: INT4 decoded by the magic number and scaled in fp16
    "qmoe_int4_g32_fp16_magic": lambda: check_quant_fused_moe(
        "ct-int4-g32", 12, 4, 3, 72, 40, torch.float16, CPU, 2e-3, seed=9, launch=K64
    ),
    # dims that the launch's tiles divide: the 4-bit words load without masks (EVEN)
    "qmoe_int4_g32_even": lambda: check_quant_fused_moe(
        "ct-int4-g32", 12, 4, 3, 128, 64, torch.float16, CPU, 2e-3, seed=10, launch=K64
    ),
    "qmoe_int4_g128_decode": lambda: check_quant_fused_moe(
        "ct-int4-g128", 2, 16, 2, 256, 136, F32, CPU, TOL32, seed=10
    ),
    # one pair a block in the GEMV form (4-bit weights, BLOCK_M 1): per-pair blocks at decode
    # and sorted runs, a scale per step (BLOCK_K 32) and per word (BLOCK_K 64), ragged tiles
    "qmoe_int4_g32_gemv_decode": lambda: check_quant_fused_moe(
        "ct-int4-g32", 2, 16, 2, 72, 40, F32, CPU, TOL32, seed=12, launch=GEMV_SMALL
    ),
    "qmoe_int4_g32_gemv_sorted": lambda: check_quant_fused_moe(
        "ct-int4-g32", 12, 4, 3, 72, 40, F32, CPU, TOL32, seed=13, skew=0.3, launch=GEMV_K64
    ),
    "qmoe_int4_g128_gemv_even": lambda: check_quant_fused_moe(
        "ct-int4-g128", 3, 8, 2, 256, 128, torch.float16, CPU, 2e-3, seed=14,
        launch=(_small_launch(1, 32, 128, 1), _small_launch(1, 64, 128, 1)),
    ),
    # group 24 tiles neither way with BLOCK_K 16: a scale per column
    "qmoe_int4_g24_columns": lambda: check_quant_fused_moe(
        "ct-int4-g24", 7, 4, 2, 48, 24, F32, CPU, TOL32, seed=11, launch=SMALL
    ),
    "route_v3_groups": lambda: check_routing(
        9, 16, mr.RoutingRule(4, n_group=4, topk_group=2, scaling=2.5), CPU
    ),
    # top_k = every expert of the kept groups: negative biased scores must beat masked ones
    "route_all_kept": lambda: check_routing(9, 8, mr.RoutingRule(4, 4, 2), CPU, 5),
    "route_v3_kimi": lambda: check_routing(3, 384, mr.RoutingRule(8, scaling=2.827), CPU, 1),
    "route_top1_unnormalised": lambda: check_routing(
        5, 8, mr.RoutingRule(1, n_group=2, topk_group=1, renormalize=False), CPU, 2
    ),
    "route_v2_group_max": lambda: check_routing(
        6,
        12,
        mr.RoutingRule(3, 3, 2, softmax=True, group_max=True, renormalize=False, scaling=16.0),
        CPU,
        3,
        with_bias=False,
    ),  # fmt: skip
    "route_softmax_greedy": lambda: check_routing(
        4, 10, mr.RoutingRule(6, softmax=True), CPU, 4, with_bias=False
    ),
}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


@pytest.mark.parametrize("top_k", [1, 2, 5, 8])
def test_reference_equals_naive_loop(top_k: int) -> None:
    x, w13, w2, weights, ids = make_inputs(11, 8, top_k, 24, 16, top_k, skew=0.3, unused=1)
    assert rel_error(fm.fused_moe_ref(x, w13, w2, weights, ids), naive_moe(x, w13, w2, weights,
                                                                           ids)) < TOL32  # fmt: skip


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 384, 8, 16), (7, 16, 2, 16), (50, 8, 3, 16), (33, 384, 8, 32), (64, 4, 4, 64),
])  # fmt: skip
def test_alignment(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    *_, ids = make_inputs(num_tokens, num_experts, top_k, 8, 8, num_tokens, skew=0.05)
    check_alignment(ids, block_m, num_experts)


def check_graph_replay(x, w13, w2, weights, ids) -> None:
    """fused_moe captured once (x [T, 1024], 384 experts, top 8, inter 256), replayed on new
    tokens and routing == fused_moe_ref."""
    fm.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        nx, _, _, nw, nids = make_inputs(x.shape[0], 384, 8, 1024, 256, seed, 0.02, 0, "cuda")
        x.copy_(nx)
        weights.copy_(nw)
        ids.copy_(nids)
        graph.replay()
        assert rel_error(out, fm.fused_moe_ref(x, w13, w2, weights, ids)) < 2e-2


def gpu_test(fn):  # noqa: ANN001, ANN201
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")(fn))


# GPU tests: tests/test_fused_moe_gpu.py


# compile-only (tests/triton_compile.py): DeepSeek-V3 / Kimi K2 expert dims (hidden 7168, inter
# 256 = 2048 / TP 8), bf16, with 8 experts and top-2 (small host tensors) at token counts that
# give each tile config the real models' batches reach: per-pair blocks, BLOCK_M 16/32/64/128
BF16 = torch.bfloat16
GPU_DIM_CHECKS = {
    **{f"bf16_moe_{m}_tokens": (lambda m=m: check_fused_moe(m, 8, 2, 7168, 256, BF16, CPU, 2e-2))
       for m in (1, 64, 96, 300)},
    "bf16_moe_600_inter2048": lambda: check_fused_moe(600, 8, 2, 1024, 2048, BF16, CPU, 2e-2),
    **{f"bf16_qmoe_{fmt}_{m}": (lambda fmt=fmt, m=m: check_quant_fused_moe(
        fmt, m, 8, 2, 7168, 256, BF16, CPU, 2e-2)) for fmt in ("fp8-block", "ct-int4-g32",
                                                             "ct-int4-g128") for m in (1, 96)},
    **{f"bf16_qmoe_{fmt}_gemv": (lambda fmt=fmt: check_quant_fused_moe(
        fmt, 1, 8, 2, 7168, 256, BF16, CPU, 2e-2, launch=(
            fm.MoELaunch(1, 64, 128, 1, 4, 3), fm.MoELaunch(1, 64, 128, 1, 4, 3))))
       for fmt in ("ct-int4-g32", "ct-int4-g128")},
    "bf16_route_v3": lambda: check_routing(64, 256, mr.RoutingRule(8, 8, 4, scaling=2.5), CPU),
}  # fmt: skip


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
