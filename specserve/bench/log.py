"""The experiment log: one markdown row and one JSON line per benchmark result.

`<exp_dir>/LOG.md` is a human-readable table (header written on first use); every row has a
twin in `<exp_dir>/results.jsonl` carrying the full record: resolved config, library versions,
GPU, git SHA (+ dirty flag) and the UTC date, so any row can be traced to the code that made it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

LOG_NAME = "LOG.md"
RESULTS_NAME = "results.jsonl"

# (header, row key) in table order; date / sha / gpu are filled in from environment_info()
LOG_COLUMNS: tuple[tuple[str, str], ...] = (
    ("date", "date"),
    ("git SHA", "sha"),
    ("GPU", "gpu"),
    ("benchmark", "benchmark"),
    ("config", "config"),
    ("tok/s mean (min-max)", "tok_s"),
    ("change vs baseline", "change"),
    ("notes", "notes"),
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(repo_dir: str, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", repo_dir, *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gpu_name() -> str:
    try:
        import torch
    except ImportError:
        return "unknown"
    if not torch.cuda.is_available():
        return "cpu"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if len(names) == 1:
        return names[0]
    return f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def environment_info(repo_dir: str | None = None) -> dict[str, Any]:
    """Facts that make a result reproducible. repo_dir defaults to the checkout holding the
    specserve package. SPECSERVE_GIT_SHA, when set, names the commit instead (a tree copied
    to another machine, whose own git metadata may be missing or stale), with dirty None;
    outside a git repository and without it the SHA is "unknown"."""
    repo = repo_dir or _PACKAGE_DIR
    override = os.environ.get("SPECSERVE_GIT_SHA", "").strip()
    sha = override or _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain") if sha and not override else None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_sha": sha or "unknown",
        "git_dirty": None if status is None else bool(status),
        "gpu": _gpu_name(),
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "triton": _version("triton"),
            "specserve": _version("specserve"),
        },
    }


def _cell(value: Any) -> str:
    """One markdown table cell: pipes escaped, newlines flattened."""
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def _short_sha(env: dict[str, Any]) -> str:
    sha = env["git_sha"]
    short = sha[:10] if sha != "unknown" else sha
    return short + ("+dirty" if env.get("git_dirty") else "")


def append_result(
    exp_dir: str, record: dict[str, Any], row: dict[str, Any], repo_dir: str | None = None
) -> tuple[str, str]:
    """Append `row` to <exp_dir>/LOG.md and `record` (+ environment) to results.jsonl.

    row keys: benchmark, config, tok_s, change, notes (any may be omitted; date, sha and gpu
    default to the environment's). Returns (log_md_path, jsonl_path)."""
    known = {key for _, key in LOG_COLUMNS}
    unknown = sorted(set(row) - known)
    if unknown:
        raise ValueError(f"unknown LOG.md column keys {unknown}; use only {sorted(known)}")
    os.makedirs(exp_dir, exist_ok=True)
    env = environment_info(repo_dir)
    filled = {"date": env["date"][:10], "sha": _short_sha(env), "gpu": env["gpu"], **row}

    log_path = os.path.join(exp_dir, LOG_NAME)
    new_file = not os.path.exists(log_path) or os.path.getsize(log_path) == 0
    with open(log_path, "a", encoding="utf-8") as fh:
        if new_file:
            fh.write("# Experiment log\n\n")
            fh.write("| " + " | ".join(h for h, _ in LOG_COLUMNS) + " |\n")
            fh.write("|" + "---|" * len(LOG_COLUMNS) + "\n")
        cells = [_cell(filled.get(key, "")) for _, key in LOG_COLUMNS]
        fh.write("| " + " | ".join(cells) + " |\n")

    jsonl_path = os.path.join(exp_dir, RESULTS_NAME)
    line = {**env, **record, "log_row": filled}
    with open(jsonl_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, default=str, allow_nan=True) + "\n")
    return log_path, jsonl_path


def read_results(exp_dir: str) -> list[dict[str, Any]]:
    """All JSON records of <exp_dir>/results.jsonl, oldest first ([] when there is none)."""
    path = os.path.join(exp_dir, RESULTS_NAME)
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno} is not valid JSON ({err.msg}); fix or remove that line"
                ) from None
    return out
