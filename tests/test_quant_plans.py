"""Launch-plan choices of the quantized GEMMs (no kernel runs): which row counts take the
GEMV plan, and where fp8_linear quantizes the activations (tests/test_quant_kernels.py checks
the kernels' values under each)."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.kernels import fp8_gemm

FP8 = torch.float8_e4m3fn


def test_one_row_plans() -> None:
    """The measured choice (gemm_split.GEMV_MAX_ROWS): one FP8 row runs as a GEMV, W4A16 and
    two or more rows on tensor-core tiles; the GEMV is checked above for 1-4 rows."""
    from specserve.kernels.gemm_split import launch_plan

    if os.environ.get("SPECSERVE_GEMV_MAX_ROWS"):
        pytest.skip("the GEMV row limit is set by the environment")
    cpu = torch.device("cpu")
    assert launch_plan(1, 6144, 4096, cpu).block_m == 1
    assert launch_plan(2, 6144, 4096, cpu).block_m == 16
    assert launch_plan(1, 6144, 4096, cpu, gemv_rows=0).block_m == 16


def test_fp8_activations_quantized_in_the_loop_only_for_gemv_plans(monkeypatch) -> None:
    """fp8_linear quantizes in the K loop for a GEMV plan (one row) and with quant_fp8 first
    for tensor-core plans (more rows, an explicit 16-row plan, exact mode's tiles)."""
    from specserve.kernels import dispatch, gemm_split

    calls = []
    monkeypatch.setattr(gemm_split, "GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(fp8_gemm, "_launch", lambda a, s, quant, *rest: calls.append(quant))
    monkeypatch.setattr(fp8_gemm, "quant_fp8", lambda x, g, st=None: calls.append("q") or (x, x))
    w, ws = torch.zeros(8, 256, dtype=FP8), torch.ones(1, 2)
    static = torch.tensor(0.5)
    for m, static_scale, plan, want in [
        (1, None, None, [fp8_gemm.DYNAMIC]), (1, static, None, [fp8_gemm.STATIC]),
        (2, None, None, ["q", fp8_gemm.GIVEN]), (2, static, None, ["q", fp8_gemm.GIVEN]),
        (1, None, (16, 32, 128, 1), ["q", fp8_gemm.GIVEN]),
        (3, None, (4, 16, 128, 1), [fp8_gemm.DYNAMIC]),
    ]:  # fmt: skip
        calls.clear()
        fp8_gemm.fp8_linear(torch.zeros(m, 256), w, ws, 128, 128, 128, static_scale, plan)
        assert calls == want, (m, static_scale is not None, plan, calls)
    monkeypatch.setattr(dispatch.EXACT, "on", True)
    calls.clear()
    fp8_gemm.fp8_linear(torch.zeros(1, 256), w, ws, 128, 128, 128)
    assert calls == ["q", fp8_gemm.GIVEN]
