"""scripts/bench_decode_vs_sdpa.py end to end on the CPU (our kernel under the Triton
interpreter, torch's math and CPU flash backends; fp32, so every output is checked against the
reference; its timings matter on a GPU). A subprocess: TRITON_INTERPRET must be set before
triton is imported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_vs_sdpa.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_decode_vs_sdpa_rows(tmp_path: Path) -> None:
    out = tmp_path / "dvs.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--context-lens", "8,37", "--batch-sizes", "3",
         "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--page-size", "4",
         "--backends", "math,flash,cudnn", "--replays", "1", "--dtype", "float32",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context_len"], r["batch_size"]) for r in rows] == [(8, 3), (37, 3)]
    for r in rows:
        # our paged kernel and torch's kernels agree with the reference on the same K/V
        assert r["ours"]["ok"] and r["sdpa_math"]["ok"] and r["sdpa_flash"]["ok"], r
        assert "error" in r["sdpa_cudnn"]  # no cuDNN attention on the CPU: reported, not fatal
        assert r["ours_vs_best_sdpa"] > 0 and r["kv_sets"] == 8  # tiny KV: cycled sets
    # a bad backend name stops before any work, in one line
    bad = subprocess.run([sys.executable, str(SCRIPT), "--backends", "fa3"], capture_output=True,
                         text=True, timeout=60, env=env)  # fmt: skip
    assert bad.returncode == 2 and "--backends: unknown ['fa3']" in bad.stderr
