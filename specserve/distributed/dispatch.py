"""Which backend each all-reduce uses, by message size: measured, and cached per machine.

Two ops are dispatched: `all_reduce` and `add_rms_norm` (all-reduce, then residual add +
RMSNorm). A candidate is a backend name; for `add_rms_norm` a fused backend also offers
"<name>+fused", its one-launch kernel (the others run their all-reduce, then the add + norm
kernel). A message uses the choice measured for the smallest measured size >= its size; a
message larger than every measured size uses the process group's own all-reduce.

The cache is one JSON file per key (GPU names and count, peer-access matrix, `nvidia-smi topo
-m`, torch / CUDA / NCCL versions, world size, dtype, hidden size, candidate set) under the
user cache dir: ~/.cache/specserve/comm (or $XDG_CACHE_HOME/specserve/comm).
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

OPS = ("all_reduce", "add_rms_norm")
FUSED = "+fused"


@dataclass(frozen=True)
class Choice:
    backend: str
    fused: bool = False
    us: float | None = None  # measured time per call; None when chosen without measuring

    @classmethod
    def parse(cls, label: str, us: float | None = None) -> Choice:
        return cls(label.removesuffix(FUSED), label.endswith(FUSED), us)

    @property
    def label(self) -> str:
        return self.backend + (FUSED if self.fused else "")


class DispatchTable:
    """entries: [{"op", "nbytes", "rows", "us": {label: us or None}, "choice": label}]."""

    def __init__(self, entries: list[dict[str, Any]], fallback: str) -> None:
        self.entries = sorted(entries, key=lambda e: (e["op"], e["nbytes"]))
        self.fallback = Choice(fallback)
        self._sizes: dict[str, list[int]] = {op: [] for op in OPS}
        self._choices: dict[str, list[Choice]] = {op: [] for op in OPS}
        for e in self.entries:
            self._sizes[e["op"]].append(e["nbytes"])
            self._choices[e["op"]].append(Choice.parse(e["choice"], e["us"].get(e["choice"])))
        self._memo: dict[tuple[str, int], Choice] = {}

    def choose(self, op: str, nbytes: int) -> Choice:
        key = (op, nbytes)
        if key not in self._memo:
            i = bisect.bisect_left(self._sizes[op], nbytes)
            self._memo[key] = self._choices[op][i] if i < len(self._sizes[op]) else self.fallback
        return self._memo[key]

    def measured(self, op: str) -> set[int]:
        return set(self._sizes[op])


def pick(us: dict[str, float | None]) -> str:
    """The fastest measured candidate (ties: the first in order)."""
    timed = {k: v for k, v in us.items() if v is not None}
    assert timed, "no candidate ran"
    return min(timed, key=timed.__getitem__)


def message_rows(batch_sizes: list[int], widths: list[int], max_tokens: int) -> list[int]:
    """Rows of the messages an engine sends: every captured batch size times every width
    (decode 1, verify, draft), and powers of two up to the prefill token budget."""
    rows = {b * w for b in batch_sizes for w in widths}
    p = 1
    while p <= max_tokens:
        rows.add(p)
        p *= 2
    return sorted(rows)


# -- the per-machine cache ---------------------------------------------------------------------


def cache_dir(configured: str = "") -> Path:
    if configured:
        return Path(configured)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "specserve" / "comm"


def machine_key(
    device: torch.device, world: int, dtype: torch.dtype, hidden: int, candidates: list[str]
) -> dict[str, Any]:
    """What a measured table depends on."""
    key: dict[str, Any] = {
        "torch": torch.__version__,
        "world": world,
        "hidden": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "candidates": candidates,
    }
    if device.type == "cuda":
        n = torch.cuda.device_count()
        key.update(
            gpus=[torch.cuda.get_device_name(i) for i in range(n)],
            peer=[
                [i != j and torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                for i in range(n)
            ],
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            topology=_topology_text(),
        )
    else:
        key.update(cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    return key


def _topology_text() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() if out.returncode == 0 else ""


def cache_file(directory: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"allreduce-{digest}.json"


def load_cache(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached record for `key`, or None (absent, unreadable, or another key)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def save_cache(
    path: Path, key: dict[str, Any], entries: list[dict[str, Any]], unavailable: dict[str, str]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "key": key,
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
        "entries": sorted(entries, key=lambda e: (e["op"], e["nbytes"])),
        "unavailable": unavailable,
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # readers never see a half-written file


def load_all(directory: Path) -> list[dict[str, Any]]:
    """Every cached record in `directory` (for `doctor`), newest first."""
    records = []
    for path in sorted(directory.glob("allreduce-*.json")):
        try:
            records.append({**json.loads(path.read_text()), "path": str(path)})
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r.get("measured", ""), reverse=True)
