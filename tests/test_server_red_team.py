"""scripts/red_team.py replays every case of issue 18 against a live `specserve serve` (the
bundled model, 127.0.0.1) and exits 0 only when each shows its documented behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_red_team_replay(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/red_team.py",
            "--json-out",
            str(out),
            "--keep-logs",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    rows = json.loads(out.read_text()) if out.exists() else []
    failed = [(r["case"], r["now"]) for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert {r["item"] for r in rows} == set(range(1, 14))  # every item of the issue
