"""Measured launch plans (kernels/plan_table.py): which entry a GEMM of m rows takes, when the
tables are bypassed, that fp8_linear and w4a16_mm launch with the table's plan, and how
scripts/bench_quant_gemm.py --write-table merges a sweep into a table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specserve.kernels import fp8_gemm, plan_table, w4a16_gemm
from specserve.kernels.dispatch import EXACT
from specserve.kernels.gemm_split import GemmPlan

P1 = GemmPlan(1, 32, 128, 4, 2, 3)
P16 = GemmPlan(16, 64, 128, 2, 4, 4)
P64 = GemmPlan(64, 128, 128, 1, 8, 3)
TABLE = {"fp8": {"6144x4096": {"1": P1.__dict__, "16": P16.__dict__, "64": P64.__dict__}}}


def test_lookup_takes_the_smallest_measured_row_count_at_or_above_m() -> None:
    got = {m: plan_table.lookup(TABLE, "fp8", m, 6144, 4096) for m in (0, 1, 2, 16, 17, 64, 65)}
    assert got == {0: None, 1: P1, 2: P16, 16: P16, 17: P64, 64: P64, 65: None}
    assert plan_table.lookup(TABLE, "fp8", 1, 4096, 4096) is None  # another shape
    assert plan_table.lookup(TABLE, "int4-g128", 1, 6144, 4096) is None  # another format


@pytest.fixture
def fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A table directory holding TABLE for a GPU named "Fake GPU 80GB"."""
    monkeypatch.setattr(plan_table, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(plan_table, "_gpu_name", lambda index: "Fake GPU 80GB")
    path = plan_table.table_file("Fake GPU 80GB")
    assert path == tmp_path / "Fake_GPU_80GB.json"
    path.write_text(json.dumps(TABLE))
    plan_table._load.cache_clear()
    plan_table._cached_plan.cache_clear()
    yield path
    plan_table._load.cache_clear()
    plan_table._cached_plan.cache_clear()


def test_tuned_plan_per_gpu_and_its_bypasses(fake_gpu: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cuda = torch.device("cuda", 0)
    assert plan_table.tuned_plan("fp8", 8, 6144, 4096, cuda) == P16
    assert plan_table.tuned_plan("fp8", 8, 6144, 4096, torch.device("cpu")) is None
    monkeypatch.setattr(EXACT, "on", True)  # exact mode: one plan for every row count
    assert plan_table.tuned_plan("fp8", 8, 6144, 4096, cuda) is None
    monkeypatch.setattr(EXACT, "on", False)
    monkeypatch.setenv(plan_table.ENV, "0")
    assert plan_table.tuned_plan("fp8", 8, 6144, 4096, cuda) is None
    monkeypatch.delenv(plan_table.ENV)
    monkeypatch.setattr(plan_table, "_gpu_name", lambda index: "Other GPU")  # no table
    assert plan_table.tuned_plan("fp8", 8, 6144, 4096, torch.device("cuda", 1)) is None


def test_a_malformed_table_names_its_file(fake_gpu: Path) -> None:
    fake_gpu.write_text(json.dumps({"fp8": {"6144x4096": {"1": {"block_m": 1, "bogus": 2}}}}))
    with pytest.raises(ValueError, match="Fake_GPU_80GB.json: bad plan fp8/6144x4096/1"):
        plan_table.tuned_plan("fp8", 1, 6144, 4096, torch.device("cuda", 0))


class _Kernel:
    """Stands in for a Triton kernel: records the launch's keyword arguments."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return lambda *args, **kw: self.launches.append({"grid": grid, **kw})


def test_gemms_launch_with_the_measured_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a table entry, fp8_linear (128-blocks) and w4a16_mm launch that plan's tiles,
    warps and stages; without one, the rule of thumb's."""
    asked = []

    def tuned(fmt, m, n, k, device):  # noqa: ANN001, ANN202
        asked.append((fmt, m, n, k))
        return {"fp8": P1, "int4-g128": P16, "nvfp4": P64}.get(fmt)

    monkeypatch.setattr(plan_table, "tuned_plan", tuned)
    k, n = 256, 192
    fp8_kernel, w4_kernel, gemv_kernel = _Kernel(), _Kernel(), _Kernel()
    monkeypatch.setattr(fp8_gemm, "_fp8_mm_kernel", fp8_kernel)
    monkeypatch.setattr(w4a16_gemm, "_w4a16_kernel", w4_kernel)
    monkeypatch.setattr(w4a16_gemm, "_w4_gemv_kernel", gemv_kernel)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=fp8_gemm.FP8)
    fp8_gemm.fp8_linear(x, w, torch.ones(n // 128 + 1, k // 128), 128, 128, 128)
    launch = fp8_kernel.launches[-1]
    assert (launch["BLOCK_M"], launch["BLOCK_N"], launch["num_warps"]) == (1, 32, 2)
    assert launch["grid"] == (1, n // 32, 2)  # 4 splits of 128-wide steps over K 256: 2
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    x4 = torch.randn(3, k, dtype=torch.bfloat16)
    w4a16_gemm.w4a16_mm(x4, packed, torch.ones(n, k // 128, dtype=torch.bfloat16), 128, False)
    launch = w4_kernel.launches[-1]
    assert (launch["BLOCK_M"], launch["BLOCK_N"], launch["num_stages"]) == (16, 64, 4)
    fp4_scales = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    w4a16_gemm.w4a16_mm(x4, packed, fp4_scales, 16, True, torch.ones(n))
    assert w4_kernel.launches[-1]["BLOCK_N"] == 128
    assert asked == [("fp8", 1, n, k), ("int4-g128", 3, n, k), ("nvfp4", 3, n, k)]
    # no entry: the rule of thumb (tensor-core tiles of 16 rows for a 3-row W4A16 GEMM)
    monkeypatch.setattr(plan_table, "tuned_plan", lambda *a: None)
    w4a16_gemm.w4a16_mm(x4, packed, torch.ones(n, k // 128, dtype=torch.bfloat16), 128, False)
    rule = w4a16_gemm.rule_plan(3, n, k, torch.device("cpu"))
    assert w4_kernel.launches[-1]["BLOCK_N"] == rule.block_n and rule.block_m == 16
    assert not gemv_kernel.launches


def _bench_script():  # noqa: ANN202
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_quant_gemm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_table_keeps_only_clear_wins() -> None:
    bench = _bench_script()
    old = {"fp8": {"4096x4096": {"1": P1.__dict__}, "6144x4096": {"64": P64.__dict__}}}
    rows = [  # 10% faster: stored; 1% faster: the default stays, the old entry goes
        {"format": "fp8", "n": 6144, "k": 4096, "m": 16, "best_plan": P16.__dict__,
         "best_ms": 0.09, "default_ms": 0.10},
        {"format": "fp8", "n": 6144, "k": 4096, "m": 64, "best_plan": P16.__dict__,
         "best_ms": 0.099, "default_ms": 0.10},
        {"format": "int4", "n": 6144, "k": 4096, "m": 1, "best_plan": P1.__dict__,
         "best_ms": 0.05, "default_ms": 0.10},
        {"format": "nvfp4", "n": 6144, "k": 4096, "m": 1, "best_plan": P1.__dict__,
         "best_ms": 0.10, "default_ms": 0.10},
    ]  # fmt: skip
    table = bench.merge_table(old, rows, 0.03)
    assert table == {
        "fp8": {"4096x4096": {"1": P1.__dict__}, "6144x4096": {"16": P16.__dict__}},
        "int4-g128": {"6144x4096": {"1": P1.__dict__}},
    }
    assert plan_table.lookup(table, "int4-g128", 1, 6144, 4096) == P1


def test_the_stored_tables_parse() -> None:
    """Every committed table loads (a malformed entry raises, naming its file) and holds only
    formats the kernels ask for."""
    formats = {"fp8", "int4-g32", "int4-g128", "nvfp4", "bf16", "fp16"}
    for path in sorted(plan_table.TABLE_DIR.glob("*.json")):
        table = plan_table._load(path)
        assert table and set(table) <= formats, (path, set(table))
