"""The TP group's all-reduce backends and the measured table that picks one per size.

Built once per engine, before CUDA graphs are captured, by every rank in the same order:
    1. which backends this machine can try (backends.availability), agreed over the group:
       a backend any rank cannot use is tried by none;
    2. initialise them; one that fails on any rank is dropped on every rank, with its reason;
    3. the dispatch table: rank 0 reads the per-machine cache and says which sizes are
       missing; every rank measures those together (tuning.measure); rank 0 stores the result
       and sends the table to every rank, so all ranks choose alike (a mismatch would hang).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from specserve.config import CommConfig
from specserve.distributed import dispatch, tuning
from specserve.distributed.backends import (
    CUSTOM,
    NAMES,
    CommBackend,
    OrderedBackend,
    ProcessGroupBackend,
    availability,
    local_facts,
    make_backend,
)
from specserve.distributed.exchange import all_gather_json, broadcast_json

log = logging.getLogger(__name__)

MAX_BUFFER_BYTES = 64 << 20  # peer buffers cover messages up to this size

AddNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Communicator:
    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        hidden: int,
        rows: list[int],
        config: CommConfig,
    ) -> None:
        self.group, self.device, self.dtype, self.hidden = group, device, dtype, hidden
        self.base = dist.get_backend(group)
        self.world = dist.get_world_size(group)
        elem = torch.empty((), dtype=dtype).element_size()
        self.rows = sorted(set(rows))
        nbytes = min(MAX_BUFFER_BYTES, max(self.rows) * hidden * elem)
        self.backends: dict[str, CommBackend] = {self.base: ProcessGroupBackend(group)}
        self.unavailable = self._start_backends(config, nbytes)
        self.source = "fixed"
        # exact mode (kernels/dispatch.py): sums whose per-element order never follows the
        # message size: the Triton one-shot where it fits, else the gathered rank-order sum
        from specserve.kernels.dispatch import exact_mode

        self.ordered = OrderedBackend(group) if exact_mode() else None
        if self.ordered is not None:
            self.source = "exact: rank-order fp32 sums"
            self.table = dispatch.DispatchTable([], self.base)
        else:
            self.table = self._build_table(config)

    # -- 1, 2: backends ----------------------------------------------------------------------
    def _start_backends(self, config: CommConfig, nbytes: int) -> dict[str, str]:
        reasons = availability(local_facts(self.device, self.world, self.dtype))
        wanted = (
            CUSTOM
            if config.comm_backend == "auto"
            else ((config.comm_backend,) if config.comm_backend in CUSTOM else ())
        )
        unavailable = {n: r for n, r in reasons.items() if n not in (self.base, *wanted)}
        unavailable.update(
            {
                n: f"not requested (--comm-backend {config.comm_backend})"
                for n in CUSTOM
                if n not in wanted
            }
        )
        agreed = _union(all_gather_json({n: reasons[n] for n in wanted if reasons[n]}, self.group))
        failed: dict[str, str] = {}
        for name in wanted:
            if name in agreed:
                continue
            try:
                self.backends[name] = make_backend(name, self.group, nbytes, self.device)
            except Exception as err:  # noqa: BLE001 - any failure means: use another backend
                failed[name] = f"initialisation failed: {type(err).__name__}: {err}"
        agreed.update(_union(all_gather_json(failed, self.group)))
        for name, why in agreed.items():
            self.backends.pop(name, None)
            unavailable[name] = why
            log.info("all-reduce backend %s unavailable: %s", name, why)
        forced = config.comm_backend
        if forced not in ("auto", self.base) and forced not in self.backends:
            raise ValueError(
                f"--comm-backend {forced} cannot be used here: "
                f"{unavailable.get(forced, 'not available')}; use --comm-backend auto"
            )
        return unavailable

    # -- 3: the table ------------------------------------------------------------------------
    def _build_table(self, config: CommConfig) -> dispatch.DispatchTable:
        fuse = config.comm_fuse != "off"
        # one backend: nothing to choose between (gloo on the CPU) unless asked to measure
        alone = len(self.backends) == 1 and config.comm_tune == "auto"
        if config.comm_tune == "off" or config.comm_backend != "auto" or alone:
            return dispatch.DispatchTable(self._fixed_entries(config), self.base)
        names = [n for n in NAMES if n in self.backends]
        key = (
            dispatch.machine_key(
                self.device,
                self.world,
                self.dtype,
                self.hidden,
                names + (["fused"] if fuse else []),
            )
            if self._lead
            else None
        )
        path = (
            dispatch.cache_file(dispatch.cache_dir(config.comm_cache_dir), key)
            if key is not None
            else None
        )
        cached: list[dict[str, Any]] = []
        if path is not None and config.comm_tune == "auto":
            record = dispatch.load_cache(path, key)
            cached = record["entries"] if record else []
        have = {e["rows"] for e in cached if e["op"] == "add_rms_norm"}
        missing = broadcast_json([r for r in self.rows if r not in have], self.group)
        entries = cached + tuning.measure(
            self.backends,
            self.base,
            missing,
            self.hidden,
            self.dtype,
            self.device,
            self.group,
            fuse,
        )
        if missing and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the timing graphs' memory goes back before KV sizing
        if self._lead and missing:
            assert path is not None and key is not None
            dispatch.save_cache(path, key, entries, self.unavailable)
        self.source = "measured" if missing else "cache"
        entries = broadcast_json(entries, self.group)
        if config.comm_fuse == "on":
            for e in entries:
                fused = [k for k, v in e["us"].items() if k.endswith(dispatch.FUSED) and v]
                e["choice"] = fused[0] if fused else e["choice"]
        return dispatch.DispatchTable(entries, self.base)

    def _fixed_entries(self, config: CommConfig) -> list[dict[str, Any]]:
        """No measurement: the requested backend (its fused kernel unless --comm-fuse off)
        at every size it takes; the process group's own past them (and for auto)."""
        name = config.comm_backend if config.comm_backend in self.backends else self.base
        backend = self.backends[name]
        fused = name + dispatch.FUSED if backend.fused and config.comm_fuse != "off" else name
        elem = torch.empty((), dtype=self.dtype).element_size()
        entries = []
        for rows in self.rows:
            nbytes = rows * self.hidden * elem
            if (backend.max_bytes or nbytes) < nbytes:
                continue
            for op, label in (("all_reduce", name), ("add_rms_norm", fused)):
                entries.append(
                    {"op": op, "nbytes": nbytes, "rows": rows, "us": {label: None}, "choice": label}
                )
        return entries

    @property
    def _lead(self) -> bool:
        return dist.get_rank(self.group) == 0

    # -- the calls ---------------------------------------------------------------------------
    def _exact_backend(self, nbytes: int) -> CommBackend:
        one = self.backends.get("triton-one-shot")
        if one is not None and (one.max_bytes is None or nbytes <= one.max_bytes):
            return one
        assert self.ordered is not None
        return self.ordered

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.ordered is not None:
            return self._exact_backend(x.numel() * x.element_size()).all_reduce(x)
        choice = self.table.choose("all_reduce", x.numel() * x.element_size())
        return self.backends[choice.backend].all_reduce(x)

    def all_reduce_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unfused: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ordered is not None:
            backend = self._exact_backend(x.numel() * x.element_size())
            if backend.fused:
                return backend.all_reduce_add_rms_norm(x, residual, weight, eps)
            return unfused(backend.all_reduce(x), residual)
        choice = self.table.choose("add_rms_norm", x.numel() * x.element_size())
        backend = self.backends[choice.backend]
        if choice.fused:
            return backend.all_reduce_add_rms_norm(x, residual, weight, eps)
        return unfused(backend.all_reduce(x), residual)

    def describe(self) -> list[str]:
        """One line per measured size: rows, bytes, the choice per op and its time."""
        if self.ordered is not None:
            one = "triton-one-shot" in self.backends
            return [f"every size: {'triton-one-shot where it fits, else ' if one else ''}"
                    "ordered (gathered, summed in rank order)"]
        lines = []
        by_size: dict[int, dict[str, dispatch.Choice]] = {}
        for op in dispatch.OPS:
            for nbytes in sorted(self.table.measured(op)):
                by_size.setdefault(nbytes, {})[op] = self.table.choose(op, nbytes)
        for nbytes, choices in sorted(by_size.items()):
            parts = [
                f"{op} {c.label} {c.us if c.us is not None else '-'} us"
                for op, c in choices.items()
            ]
            lines.append(f"{nbytes:>10} B  " + "; ".join(parts))
        return lines


def _union(parts: list[dict[str, str]]) -> dict[str, str]:
    """One reason per backend from every rank's reasons: the common one, or the first
    rank's that has one."""
    out: dict[str, str] = {}
    for name in sorted({n for reasons in parts for n in reasons}):
        whys = [reasons.get(name) for reasons in parts]
        rank = next(r for r, why in enumerate(whys) if why)
        out[name] = whys[rank] if len(set(whys)) == 1 else f"rank {rank}: {whys[rank]}"
    return out
