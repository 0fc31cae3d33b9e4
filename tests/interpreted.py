"""Kernel checks under the Triton interpreter, run in a subprocess (TRITON_INTERPRET must be set
before triton is imported).

A test file keeps a dict of named checks, calls `report(checks)` when run as a script, and
reads the results through `run_interpreted(__file__)`: {check name: "ok" or its traceback};
`interpreter_test(__file__, checks)` is the test that does so, one case per check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(test_file: str, *argv: str, timeout: int = 600) -> dict[str, str]:
    """Run `python test_file *argv` under the interpreter; its last line's JSON results."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, test_file, *argv], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def run_shards(test_file: str, *argv: str) -> dict[str, str]:
    """run_interpreted in two subprocesses at once, each with every other check (the test
    process only waits meanwhile: two CPU cores busy instead of one)."""
    shards = max(1, min(2, os.cpu_count() or 1))
    if shards == 1:
        return run_interpreted(test_file, *argv)
    with ThreadPoolExecutor(max_workers=shards) as pool:
        parts = pool.map(lambda i: run_interpreted(test_file, *argv, f"--shard={i}/{shards}"),
                         range(shards))  # fmt: skip
        return {k: v for part in parts for k, v in part.items()}


def compiling() -> bool:
    """In a compile-only run (tests/triton_compile.py): a check may stop after its launches
    (their outputs are never written) instead of computing its reference."""
    from specserve.kernels.dispatch import COMPILE_ONLY_ENV

    return bool(os.environ.get(COMPILE_ONLY_ENV))


def report(checks: dict[str, Callable[[], None]],
           gpu_dims: dict[str, Callable[[], None]] | None = None) -> None:
    """Run every check (in the interpreter subprocess) and print the results as one JSON line.
    In a compile-only run (tests/triton_compile.py) each launch is compiled for a GPU instead,
    and `gpu_dims` joins in: the same checks in bf16 at the dims the GPU tests launch (too slow
    for the interpreter, compiled only)."""
    from specserve.kernels.dispatch import COMPILE_ONLY_ENV

    if os.environ.get(COMPILE_ONLY_ENV):
        from triton_compile import compile_checks

        print(json.dumps(compile_checks({**checks, **(gpu_dims or {})})))
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through run_interpreted"
    shard = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--shard=")), None)
    if shard is not None:  # "i/n": every n-th check from the i-th (a parallel share)
        i, n = (int(v) for v in shard.split("/"))
        checks = {k: c for j, (k, c) in enumerate(checks.items()) if j % n == i}
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps(results))


def interpreter_test(test_file: str, checks: dict[str, Callable[[], None]],
                     run: Callable[[str], dict[str, str]] = run_shards) -> Callable:
    """`test_interpreter = interpreter_test(__file__, CHECKS)`: one parametrized case per check,
    every check run in interpreter subprocesses (`run(test_file)`; two shards at once by
    default) the first time a case
    asks; skipped without Triton."""
    import pytest

    results: dict[str, str] = {}

    @pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                        reason="triton is not installed")
    @pytest.mark.parametrize("name", sorted(checks))
    def test_interpreter(name: str) -> None:
        if not results:
            results.update(run(test_file))
        assert results[name] == "ok", results[name]

    return test_interpreter
