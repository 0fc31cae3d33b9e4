"""scripts/bench_attention.py runs end to end (CPU smoke test under the Triton interpreter; its
numbers matter on a GPU). A subprocess: TRITON_INTERPRET must be set before triton is imported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bench_attention_script_writes_rows(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--num-heads", "4", "--num-kv-heads", "2",
         "--head-dim", "16", "--page-size", "4", "--context-len", "8", "--batch-sizes", "1",
         "--num-warps", "4", "--block-n", "16", "--num-splits", "default,2", "--replays", "1",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "best per case" in res.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    cases = ["decode", "verify4_mask", "causal4", "verify16_tree", "causal16"]
    assert [c for c in cases if any(r["case"] == c for r in rows)] == cases
    for case in cases:
        group = [r for r in rows if r["case"] == case]
        assert sum(r["is_default"] for r in group) == 1
        # the default (block_n None: the wrapper's), plus block_n 16 with the default splits
        # and with 2 splits
        assert {(r["block_n"], r["num_splits"]) for r in group} == {(None, None), (16, None),
                                                                     (16, 2)}
        for r in group:
            assert r["ok"] and r["error"] is None and r["us"] > 0, r
            assert r["max_abs_err"] < 1e-4 and r["active_splits"] <= r["splits"]
    assert set(report["best"]) == {f"{c}/bs1" for c in cases}
    assert report["meta"]["graphs"] is False and report["meta"]["distinct_kernels"] > 0


def test_kv_sets_fit_half_the_free_memory() -> None:
    import torch

    from specserve.bench.attention_sweep import CASES, Shapes, fit_kv_sets

    decode = CASES[0]
    s = Shapes(32, 8, 128, 16, 32768, torch.bfloat16, torch.device("cpu"))
    per_set = 2 * 64 * 2049 * 16 * 8 * 128 * 2  # K and V: 64 requests x 2049 pages of 16
    assert fit_kv_sets(20, decode, 64, s, 80 * 2**30) == 80 * 2**30 // 2 // per_set == 4
    assert fit_kv_sets(20, decode, 64, s, 2**30) == 1  # not even one: 1 (its allocation says)
    assert fit_kv_sets(20, decode, 1, s, 80 * 2**30) == 20  # small sets: all of them
