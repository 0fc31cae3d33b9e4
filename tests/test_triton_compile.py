"""Every Triton kernel compiles for the GPUs we serve on, checked on a machine without one.

The kernel check files (their interpreter checks, plus bf16 launches at the GPU tests' dims)
run in compile-only mode (tests/triton_compile.py): each launch is built down to a cubin for
sm_90 (H100/H200), the GEMM, MoE and MLA files also for sm_120 (RTX Blackwell, 99 KB of shared
memory a block), and must fit the architecture's shared memory. The kernels no check file
reaches (rotary, SiLU-and-mul, top-k log-probs, KV compaction, the busy-wait of the comm
emulator, the one-shot all-reduce) are launched here at serving dims.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from interpreted import report  # noqa: E402
from triton_compile import run_compiled  # noqa: E402

from specserve.kernels import allreduce, busy_wait, fused_ops, kv_compact, rotary, topk  # noqa: E402

KERNEL_FILES = ["test_kernels.py", "test_mla_kernels.py", "test_dsa.py", "test_dsa_select.py",
                "test_fused_moe.py", "test_fused_fp8_rows.py",
                "test_fused_moe_nvfp4.py", "test_quant_kernels.py", "test_exact_kernels.py",
                "test_ngram_kernel.py", "test_triton_compile.py"]
NO_LAUNCH = {"moe_no_tokens"}  # checks that rightly launch nothing (zero tokens)
BF16 = torch.bfloat16


# sm_120 (99 KB of shared memory a block) for the kernels with the largest tiles: the GEMMs
# and the MLA kernels (the fused MoE's sm_120 builds, ~50 s of the suite, are left to
# scripts/compile_targets.py, which runs the whole matrix; test_plans_fit_shared_memory
# checks every MoE plan against the 99 KB)
CASES = [(name, "90") for name in KERNEL_FILES] + [
    (name, "120") for name in ("test_quant_kernels.py", "test_mla_kernels.py")
]


_RUNS: dict[tuple[str, str], Future] = {}


def compiled(name: str, arch: str) -> dict[str, str]:
    """run_compiled's results for one case; the first call starts every case, two
    subprocesses at a time (each is one CPU-bound compiler process; the cases then take about
    half the wall time on the two-core CI machine)."""
    if not _RUNS:
        pool = ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)))
        for case in CASES:
            _RUNS[case] = pool.submit(run_compiled, str(Path(__file__).parent / case[0]), case[1])
        pool.shutdown(wait=False)
    return _RUNS[(name, arch)].result()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name,arch", CASES)
def test_kernels_compile(name: str, arch: str) -> None:
    results = compiled(name, arch)
    assert results
    failed = {k: v for k, v in results.items() if v != "ok" and k not in NO_LAUNCH}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_compile_only_catches_what_the_interpreter_accepts(tmp_path: Path) -> None:
    """A kernel reading a plain module global runs under the interpreter but cannot compile:
    the compile-only run must say so (and pass the same kernel once the global is constexpr)."""
    pytest.importorskip("triton")
    script = tmp_path / "kernel_file.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from interpreted import report\n"
        "from specserve.kernels.dispatch import jit, tl\n"
        "PLAIN = 2\n"
        "CONST = tl.constexpr(2)\n"
        "@jit\n"
        "def scale_plain(x_ptr, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n"
        "    tl.store(x_ptr + i, tl.load(x_ptr + i) * PLAIN)\n"
        "@jit\n"
        "def scale_const(x_ptr, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n"
        "    tl.store(x_ptr + i, tl.load(x_ptr + i) * CONST)\n"
        "x = torch.ones(16)\n"
        "report({'plain': lambda: scale_plain[(1,)](x, BLOCK=16),\n"
        "        'const': lambda: scale_const[(1,)](x, BLOCK=16),\n"
        "        'none': lambda: None})\n"
    )
    results = run_compiled(str(script), "90")
    assert results["const"] == "ok", results["const"]
    assert "scale_plain does not compile for sm_90" in results["plain"], results["plain"]
    assert "global" in results["plain"], results["plain"]
    assert results["none"].startswith("no launch reached"), results["none"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_plans_fit_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Hopper's 227 KB every default GEMM and MoE plan is the unfitted one (no H200 plan
    changes); with RTX Blackwell's 99 KB each fitted plan's staged tiles fit, no tile grows."""
    from specserve.kernels import fused_moe as fm
    from specserve.kernels import gemm_split as gs

    cpu = torch.device("cpu")
    moe = {fmt: fm.ExpertWeights(fmt, torch.empty(0, dtype=dt), None, 7168, 128, 128)
           for fmt, dt in ((fm.DENSE, BF16), (fm.FP8_BLOCK, torch.float8_e4m3fn),
                           (fm.INT4, torch.int32))}  # fmt: skip

    # (A bytes, B bytes) of the FP8 GEMM (bf16 or FP8 activations) and W4A16 (bf16, fp32)
    gemms = ((2, 1), (1, 1), (2, 0.5), (4, 0.5))

    def plans() -> list:
        out = []
        for m in (1, 7, 16, 64, 65, 300, 4096):
            for a, b in gemms:  # W4A16 steps K by 64 at prefill sizes, as w4a16_mm asks
                bk = 64 if b < 1 and m > 64 else 128
                out.append(gs.launch_plan(m, 6144, 4096, cpu, bk, a, b))
            for w in moe.values():
                out.append(fm.moe_launch_config(m, 2048, 7168, 256, 8, BF16, w))
        return out

    unfitted = plans()  # the interpreter's limit: nothing fitted
    monkeypatch.setattr(gs, "max_shared_memory", lambda device: 232448)
    assert plans() == unfitted
    monkeypatch.setattr(gs, "max_shared_memory", lambda device: 101376)
    fitted = plans()
    assert fitted != unfitted
    limit = 101376 - gs.SHARED_ALLOWANCE
    for plan, before in zip(fitted, unfitted):
        assert plan.block_m <= before.block_m and plan.block_n <= before.block_n
        assert plan.block_k == before.block_k and plan.num_stages >= 1
    for i, (a, b) in enumerate(gemms):
        for plan in fitted[i::7]:
            assert plan.num_stages * plan.block_k * (plan.block_m * a + plan.block_n * b) <= limit


# -- launches no kernel check file makes, at serving dims (compile-only) ----------------------


def _rotary(partial: bool) -> None:
    t, hq, hk, d = 5, 32, 8, 128
    rot = 64 if partial else d  # GLM-4.5: partial_rotary_factor 0.5
    q, k, v = (torch.randn(t, h, d).to(BF16) for h in (hq, hk, hk))
    cos_sin = torch.randn(4096, rot)
    positions = torch.arange(t)
    k_cache, v_cache = (torch.zeros(8, 16, hk, d, dtype=BF16) for _ in range(2))
    rotary.rotary_inplace(positions, q, k, cos_sin)
    rotary.rotary_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, positions)


def _kv_compact(mla: bool) -> None:
    shapes = [(32, 4, 16, 576)] if mla else [(32, 4, 16, 8, 128)] * 2
    caches = [torch.zeros(s, dtype=BF16) for s in shapes]
    src = torch.tensor([[17, 19, 21], [40, 41, 43]])
    kv_compact.compact_kv(caches, 32, src, torch.tensor([[16, 17, 18], [40, 41, 42]]))


def _all_reduce(world: int, fused: bool) -> None:
    bufs = SimpleNamespace(
        world=world, rank=1, nbytes=1 << 24,
        buffer_ptrs=torch.zeros(world, dtype=torch.int64),
        signal_ptrs=torch.zeros(world, dtype=torch.int64),
    )  # fmt: skip
    x = torch.randn(16, 4096).to(BF16)
    if fused:
        w = torch.ones(4096, dtype=BF16)
        allreduce.one_shot_all_reduce_add_rms_norm(x, torch.zeros_like(x), w, 1e-5, bufs)
    else:
        allreduce.one_shot_all_reduce(x, bufs)


def _busy_wait() -> None:
    table, stamp = torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    busy_wait._stamp_kernel[(1,)](stamp, num_warps=1)
    for from_stamp in (False, True):
        busy_wait._busy_wait_kernel[(1,)](table, 2, stamp, FROM_STAMP=from_stamp, num_warps=1)


GPU_DIM_CHECKS = {
    "bf16_rotary_llama": lambda: _rotary(False),
    "bf16_rotary_partial": lambda: _rotary(True),
    "bf16_silu_and_mul_14336": lambda: fused_ops.silu_and_mul(torch.randn(3, 28672).to(BF16)),
    "bf16_add_rms_norm_7168": lambda: fused_ops.fused_add_rms_norm(
        *(torch.randn(3, 7168).to(BF16) for _ in range(2)), torch.ones(7168, dtype=BF16), 1e-6
    ),
    "top_log_probs_128k": lambda: topk.top_log_probs(torch.randn(4, 128256).to(BF16), 16),
    "bf16_compact_kv_mha": lambda: _kv_compact(False),
    "bf16_compact_kv_mla": lambda: _kv_compact(True),
    "bf16_all_reduce_tp8": lambda: _all_reduce(8, False),
    "bf16_all_reduce_add_rms_norm_tp2": lambda: _all_reduce(2, True),
    "busy_wait": _busy_wait,
}


if __name__ == "__main__":
    report({}, GPU_DIM_CHECKS)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_compile_targets_script(tmp_path: Path) -> None:
    """scripts/compile_targets.py: a line per (arch, file), the summary, the JSON; a bad arch
    is one usage error."""
    import json
    import subprocess

    script = str(REPO / "scripts" / "compile_targets.py")
    out = tmp_path / "targets.json"
    res = subprocess.run([sys.executable, script, "--archs", "80,90", "--files",
                          "test_ngram_kernel.py", "--json-out", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "sm_80 test_ngram_kernel.py" in res.stdout and "sm_90: 3/3 checks compile" in res.stdout
    assert set(json.loads(out.read_text())) == {"80", "90"}
    bad = subprocess.run([sys.executable, script, "--archs", "75"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "unknown 75" in bad.stderr
