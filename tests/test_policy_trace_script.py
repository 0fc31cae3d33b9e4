"""scripts/policy_trace.py against a hand-made trace: its per-kind rates, switch and probe
counts and scores beside delivered rates equal values worked out by hand; bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "policy_trace.py"
sys.path.insert(0, str(SCRIPT.parent))
import policy_trace  # noqa: E402


def _trace(tmp_path: Path) -> Path:
    """Six steps: off, off, chain3 (a probe), off, chain3, chain3; the fourth carries a
    chunk. The first chain3 step comes back from off 40 positions behind."""
    steps = [  # (mode, rows, behind, ms, accepted, mixed)
        ("off", 4, 0, 10.0, 0, False), ("off", 4, 0, 10.0, 0, False),
        ("chain3", 4, 40, 20.0, 6, False), ("off", 4, 0, 30.0, 0, True),
        ("chain3", 2, 12, 16.0, 4, False), ("chain3", 2, 0, 16.0, 2, False)]
    lines = []
    for i, (mode, b, behind, ms, acc, mixed) in enumerate(steps):
        rec = {"step": i, "b": b, "others": 0, "behind": behind, "mode": mode}
        if i % 2 == 0:
            rec["scores"] = {"off": 400.0 + i, "chain3": 500.0 + i}
            rec["share"] = {"off": 0.1 * i, "chain3": 0.5}
        lines.append(rec)
        lines.append({"observed": mode, "b": b, "ms": ms, "mixed": mixed, "chunk": 64 * mixed,
                      "accepted": acc})
        lines.append({"engine": {"caught_up": behind, "ahead": int(i == 5), "compiled": 0}})
    path = tmp_path / "trace-c4-1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_summary_equals_hand_worked_values(tmp_path: Path) -> None:
    decisions, observed = policy_trace.load(_trace(tmp_path))
    k = policy_trace.kinds(observed)
    assert k["off"] == {"steps": 2, "rows": 4.0, "ms": 10.0, "tokens_per_row": 1.0,
                        "tok_s": 400.0, "caught_up": 0.0, "ahead": 0.0}
    assert k["off+mixed"]["tok_s"] == pytest.approx(4 / 30.0 * 1e3)
    # chain3: 3 steps, 8 rows, 52 ms, 8 rows + 12 accepted = 20 tokens
    # the engine's records: 40 + 12 positions caught up over 3 steps, the last launched ahead
    assert k["chain3"] == pytest.approx({"steps": 3, "rows": 8 / 3, "ms": 52 / 3,
                                         "tokens_per_row": 20 / 8, "tok_s": 20 / 52 * 1e3,
                                         "caught_up": 52 / 3, "ahead": 1 / 3})
    s = policy_trace.decisions_summary(decisions)
    assert s == {"steps": {"off": 3, "chain3": 3}, "switches": 3, "probes": 2,
                 "switches_on": 2, "behind_at_switch_on": 52}
    v = policy_trace.scores_vs_delivered(decisions, observed)
    # scored at steps 0, 2, 4 (rows 4, 4, 2); chain3's pure steps within 2x of rows 4: all
    # three each time (rows 4, 2, 2), of rows 2: all three (2 <= ... <= 4)
    # expected mixed shares: the scored steps' mean; ran: chain3 0 of 3, off 1 of 3 steps
    assert v["chain3"] == pytest.approx({"scored": 3, "score": 502.0,
                                         "delivered": 20 / 52 * 1e3, "share": 0.5,
                                         "ran_share": 0.0})
    # off's pure steps (rows 4) near rows 4 (twice) and rows 2 (once): 3 x (8 tokens / 20 ms)
    assert v["off"] == pytest.approx({"scored": 3, "score": 402.0, "delivered": 400.0,
                                      "share": 0.2, "ran_share": 1 / 3})


def test_cli_prints_and_refuses_bad_input(tmp_path: Path) -> None:
    good = subprocess.run([sys.executable, str(SCRIPT), str(_trace(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "switches 3, probes 2" in good.stdout
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.jsonl")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such trace" in missing.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"hello": 1}\n')
    bad = subprocess.run([sys.executable, str(SCRIPT), str(junk)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "not a policy trace" in bad.stderr
