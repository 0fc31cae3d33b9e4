"""The dense Triton GEMM under measured plans (kernels/dense_gemm.py): GEMV and tensor-core
plans, with and without split-K, bias and ragged N / K, against F.linear in fp64 (under the
interpreter on the CPU, in bf16 on CUDA); and the dense layers' choice between it and cuBLAS
(a plan-table entry for the shape and row count, else F.linear)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import interpreter_test, report  # noqa: E402

from specserve.kernels import dense_gemm as dg  # noqa: E402
from specserve.kernels.gemm_split import GemmPlan  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
# (block_m, block_n, block_k, splits, warps, stages): GEMVs, then tensor-core tiles
PLANS = [GemmPlan(1, 32, 64, 1, 4, 3), GemmPlan(1, 16, 32, 3, 2, 3),
         GemmPlan(16, 32, 32, 1, 4, 2), GemmPlan(16, 64, 64, 3, 4, 3)]  # fmt: skip


def _check(
    device: str,
    dtype: torch.dtype,
    n: int,
    k: int,
    rows: tuple[int, ...],
    plans: list[GemmPlan],
    tol: float,
) -> None:
    g = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, generator=g, device=device).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype)
    for m in rows:
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        for i, plan in enumerate(plans):
            bias = b if (m + i) % 2 else None  # each plan with and without over the rows
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = dg.dense_gemm(x, w, bias, plan)
            assert got.dtype == dtype and got.shape == (m, n)
            err = (got.double() - want).abs().max().item()
            assert err <= tol * (1 + want.abs().max().item()), (m, plan, bias is None, err)


def check_dense_gemm() -> None:
    # N and K not multiples of any tile; 3 splits over K 200 leave a short last chunk
    _check("cpu", torch.float32, 96, 200, (1, 4, 20), PLANS, 1e-5)
    _check("cpu", torch.float16, 80, 128, (1, 16), PLANS[1:], 2e-3)


INTERPRETER_CHECKS = {"dense_gemm": check_dense_gemm}
test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_dense_gemm_cuda_bf16() -> None:
    plans = [GemmPlan(1, 64, 128, 4, 4, 3), GemmPlan(16, 64, 128, 4, 4, 4),
             GemmPlan(64, 128, 64, 2, 4, 4), GemmPlan(32, 128, 128, 1, 4, 3)]  # fmt: skip
    _check("cuda", torch.bfloat16, 6144, 4096, (1, 16, 64), plans, 2e-2)
    _check("cuda", torch.bfloat16, 4096, 14336, (1, 16), plans[:2], 2e-2)


def test_dense_layers_take_a_measured_plan_else_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.kernels import plan_table
    from specserve.layers.linear import ReplicatedLinear
    from specserve.layers.quantization import unquantized

    layer = ReplicatedLinear(64, 48, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    asked, launched = [], []

    def tuned(fmt, m, n, k, device):  # noqa: ANN001, ANN202
        asked.append((fmt, m, n, k))
        return GemmPlan(16, 64, 64, 2) if m <= 8 else None

    def fake_gemm(x_, w, bias, plan):  # noqa: ANN001, ANN202
        launched.append(plan)
        return F.linear(x_, w, bias)

    monkeypatch.setattr(plan_table, "tuned_plan", tuned)
    monkeypatch.setattr(unquantized, "dense_gemm", fake_gemm)
    want = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), want) and launched == [GemmPlan(16, 64, 64, 2)]
    assert torch.equal(layer(x.repeat(2, 2, 1)), want.repeat(2, 2, 1))  # 24 rows: no plan
    assert launched == [GemmPlan(16, 64, 64, 2)]
    layer.float()
    layer(x.float())  # fp32 weights: no plan format, no table asked
    assert asked == [("bf16", 6, 48, 64), ("bf16", 24, 48, 64)]
    # the real table on the CPU: never a plan (GPUs only)
    monkeypatch.undo()
    assert plan_table.tuned_plan("bf16", 1, 48, 64, torch.device("cpu")) is None


if __name__ == "__main__":
    report(INTERPRETER_CHECKS)
