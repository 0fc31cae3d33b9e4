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
