"""scripts/profile_decode.py runs end to end (CPU smoke test; its numbers matter on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"


@pytest.mark.parametrize("spec", [[], ["--spec-topk", "2", "--spec-num-draft-tokens", "6"]])
def test_profile_script_writes_a_report(tmp_path: Path, spec: list[str]) -> None:
    out = tmp_path / "p"
    res = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-llama", "--batch-sizes",
                          "1,2", "--context-len", "24", "--steps", "2", "--out", str(out), *spec],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "profile.json").read_text())
    assert [p["batch_size"] for p in report["points"]] == [1, 2]
    assert (report["speculative"] is not None) == bool(spec)
    for p in report["points"]:
        assert p["step_ms"] > 0 and p["kernels"] and p["eager_kernel_us_total"] > 0
        assert bool(p["phases_ms"]) == (not spec)  # host phases are a plain-step measure


PREFILL = SCRIPT.parent / "profile_prefill.py"


def test_prefill_profile_reports_each_chunk_and_its_host_hotspots(tmp_path: Path) -> None:
    """scripts/profile_prefill.py: every (decode rows, chunk) point, wall time, the host
    functions of one such step by own time; on the CPU no kernel time; a bad flag exits 2."""
    out = tmp_path / "p"
    res = subprocess.run([sys.executable, str(PREFILL), "--model", "tiny-llama",
                          "--chunk-tokens", "8,40", "--decode-rows", "0,2", "--context-len",
                          "16", "--repeats", "2", "--exact-attention", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "profile_prefill.json").read_text())
    assert report["exact_attention"] is True
    got = [(p["decode_rows"], p["chunk_tokens"]) for p in report["points"]]
    assert got == [(0, 8), (0, 40), (2, 8), (2, 40)]
    for p in report["points"]:
        assert p["wall_ms"] > 0 and p["device_ms"] == 0.0
        assert p["host_gap_ms"] == p["wall_ms"]
        own = [h["own_ms"] for h in p["host_hotspots"]]
        assert own and own == sorted(own, reverse=True)
        assert all(h["calls"] >= 1 and h["cumulative_ms"] >= h["own_ms"] for h in p["host_hotspots"])
    bad = subprocess.run([sys.executable, str(PREFILL), "--decode-rows", "-1", "--out",
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--decode-rows" in bad.stderr
