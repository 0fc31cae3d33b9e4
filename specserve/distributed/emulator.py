"""Communication-cost emulator: each all-reduce point costs what a latency table says.

A `LatencyTable` (comm_tables/*.json, or any JSON file of the same form) gives, per world
size, measured (message bytes, microseconds) points. Between points the latency is linear in
the size; below the first point it is the first point's (small messages are latency-bound);
past the last it grows with the last segment's slope (bandwidth-bound; flat for one point).

`CommEmulator` turns that into waits on the device: a table of nanoseconds per 256-byte size
class lives in device memory, and each all-reduce point launches one busy-wait kernel that
reads its class's entry (kernels/busy_wait.py). Replace mode (a lone process: TP 1, or rank 0
of an emulated shard) waits the whole latency instead of communicating; pad mode (a real TP
group) stamps the time before the real all-reduce and waits after it until the table's
latency has passed since the stamp. Swapping tables rewrites the device array in place, so
captured CUDA graphs wait the new latencies at their next replay; the same makes graph
capture quick (`quiet`: the waits are zero while the graphs' warm-up runs execute, the
table's again at every replay after). On the CPU the wait spins on the host clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.kernels.busy_wait import busy_wait, stamp_now

TABLE_DIR = Path(__file__).with_name("comm_tables")
GRANULE = 256  # bytes per size class


def table_names() -> list[str]:
    return sorted(p.stem for p in TABLE_DIR.glob("*.json"))


@dataclass(frozen=True)
class LatencyTable:
    name: str
    description: str
    sources: tuple[str, ...]
    # world size -> ((bytes, us), ...) sorted by bytes
    points: dict[int, tuple[tuple[int, float], ...]] = field(hash=False, compare=False)

    @classmethod
    def load(cls, spec: str) -> LatencyTable:
        """A table by name (comm_tables/NAME.json) or by path."""
        path = Path(spec) if spec.endswith(".json") else TABLE_DIR / f"{spec}.json"
        if not path.is_file():
            raise ValueError(
                f"no communication table {spec!r}: use one of {table_names()} or "
                f"the path of a .json table"
            )
        try:
            return cls.from_dict(json.loads(path.read_text()), path.stem)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"communication table {path}: {err}") from err

    @classmethod
    def from_dict(cls, data: dict[str, Any], default_name: str = "") -> LatencyTable:
        points = {}
        for world, pts in data["latency_us"].items():
            pairs = tuple((int(b), float(us)) for b, us in pts)
            if not pairs or any(b <= 0 or us <= 0 for b, us in pairs):
                raise ValueError(f"world {world}: need (bytes > 0, us > 0) points, got {pts}")
            if any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:])):
                raise ValueError(f"world {world}: sizes must increase, got {pts}")
            points[int(world)] = pairs
        return cls(
            data.get("name", default_name),
            data.get("description", ""),
            tuple(data.get("sources", ())),
            points,
        )

    def latency_us(self, world: int, nbytes: Any) -> Any:
        """Latency of all-reducing `nbytes` (a number or an array) over `world` ranks."""
        if world not in self.points:
            raise ValueError(
                f"communication table {self.name!r} has no world size {world}: "
                f"choose --emulate-tp from {sorted(self.points)}"
            )
        sizes = np.array([b for b, _ in self.points[world]], dtype=np.float64)
        us = np.array([u for _, u in self.points[world]], dtype=np.float64)
        x = np.asarray(nbytes, dtype=np.float64)
        out = np.interp(x, sizes, us)  # flat below the first point and (for now) past the last
        if len(sizes) > 1:
            slope = (us[-1] - us[-2]) / (sizes[-1] - sizes[-2])
            out = np.where(x > sizes[-1], us[-1] + slope * (x - sizes[-1]), out)
        return out if out.ndim else float(out)


class CommEmulator:
    """Device-side waits of a table's latencies (see the module docstring)."""

    def __init__(
        self, table: LatencyTable, world: int, device: torch.device, pad: bool, max_bytes: int
    ) -> None:
        table.latency_us(world, 1)  # the world size must be in the table
        self.table, self.world, self.device, self.pad = table, world, device, pad
        self.stamp = torch.zeros(1, dtype=torch.int64, device=device) if pad else None
        self.calls = 0  # waits issued (launches; a captured graph counts once, at capture)
        self.quiet_depth = 0  # > 0: inside quiet(), every wait is zero
        self._ns: list[torch.Tensor] = []  # every array a graph may read; the last is current
        self._grow(max_bytes)

    def _fill(self, ns: torch.Tensor) -> None:
        # the arrays may be inference tensors (made under the engine's inference mode): their
        # in-place updates must run in one, wherever quiet() is left
        with torch.inference_mode():
            if self.quiet_depth:
                ns.zero_()
                return
            sizes = np.arange(ns.numel(), dtype=np.float64) * GRANULE
            values = np.rint(self.table.latency_us(self.world, sizes) * 1e3).astype(np.int32)
            ns.copy_(torch.from_numpy(values))

    def _grow(self, nbytes: int) -> None:
        count = -(-nbytes // GRANULE) + 1
        if self._ns and self._ns[-1].numel() >= count:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise AssertionError(
                f"a {nbytes}-byte all-reduce first appeared inside a CUDA "
                "graph capture, past the emulator's sizes"
            )
        ns = torch.empty(
            max(count, 2 * self._ns[-1].numel() if self._ns else 0),
            dtype=torch.int32,
            device=self.device,
        )
        self._fill(ns)
        self._ns.append(ns)

    def set_table(self, table: LatencyTable) -> None:
        """Use another table from now on (also in graphs captured before)."""
        table.latency_us(self.world, 1)
        self.table = table
        for ns in self._ns:
            self._fill(ns)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Waits of zero inside (graph capture: its warm-up runs execute every all-reduce
        point, and under an 8-GPU PCIe table the token graphs to 8192 tokens took 89 s on an
        H100); after it the table's latencies again, in the graphs captured inside too (they
        read the same device arrays at replay). Nests."""
        self.quiet_depth += 1
        if self.quiet_depth == 1:
            for ns in self._ns:
                self._fill(ns)
        try:
            yield
        finally:
            self.quiet_depth -= 1
            if not self.quiet_depth:
                for ns in self._ns:
                    self._fill(ns)

    def latency_ns(self, nbytes: int) -> int:
        """What a wait for an `nbytes` message lasts now (reads the device table)."""
        self._grow(nbytes)
        return int(self._ns[-1][-(-nbytes // GRANULE)])

    def begin(self) -> None:
        """Before a real all-reduce (pad mode): the interval starts now."""
        if self.pad:
            stamp_now(self.stamp)

    def wait(self, nbytes: int) -> None:
        """After the all-reduce point (replace mode: instead of it)."""
        self._grow(nbytes)
        busy_wait(self._ns[-1], -(-nbytes // GRANULE), self.stamp)
        self.calls += 1
