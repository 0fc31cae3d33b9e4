"""scripts/bench_drafters.py end to end on the bundled tiny-code model (CPU): plain, ngram and
suffix rows in one invocation, the drafters' tokens equal plain's, the report is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_drafters_script(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_drafters",
                                                  ROOT / "scripts" / "bench_drafters.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "report.json"
    bench.main(["--model", "tiny-code", "--device", "cpu", "--batch-sizes", "1,2",
                "--max-tokens", "24", "--max-prompt-tokens", "120", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        (m, b) for m in ("plain", "ngram", "suffix") for b in (1, 2)]
    for r in rows:
        assert r["tokens"] == 24 * r["batch_size"] and r["tok_s"] > 0
        if r["method"] != "plain":
            assert r["same_as_plain"] is True and r["accept_length"] > 1.0, r  # some drafts accepted
    assert all(r["host_states_ms"] > 0 for r in rows if r["method"] == "suffix")
