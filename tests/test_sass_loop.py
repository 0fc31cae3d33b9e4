"""scripts/sass_loop.py: a kernel's K loop found in its sm_90 SASS and counted (compile-only,
no GPU, in a subprocess: compile-only mode replaces Triton's driver for the process): the exact
GEMM's loop holds its wgmma and its cp.async loads, and its resource usage is read."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_exact_gemm_loop_counts() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "scripts/sass_loop.py", "exact-m1", "--top", "40"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("exact-m1"))
    m = re.match(r"\S+\s+\S+\s+(\d+)\s+reg (\d+) spill (\d+) smem (\d+)K\s+(.*)", line)
    assert m, line
    total, regs, spill, smem = map(int, m.groups()[:4])
    ops = dict(item.rsplit(" ", 1) for item in m.group(5).split(", "))
    assert "HGMMA" in ops and "LDGSTS" in ops and 20 < total < 1000, line
    assert 32 <= regs <= 255 and spill == 0 and smem > 0, line  # its staged tiles: shared
    bad = subprocess.run([sys.executable, "scripts/sass_loop.py", "no-such-case"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown case" in bad.stderr
