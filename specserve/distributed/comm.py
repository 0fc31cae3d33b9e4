"""All tensor-parallel collectives go through here (no-ops for a lone rank).

    all_reduce(x)                              the sum of x over the TP ranks
    all_reduce_add_rms_norm(x, residual, weight, eps, unfused)
        sum x, add the residual, RMSNorm: (normed, sum + residual). The backend chosen for
        the size either does it in one launch or all-reduces and then calls `unfused(sum,
        residual)`, the layer's own add + norm. A lone rank calls exactly unfused(x, residual).
    all_gather(x, dim), broadcast(x, src)

`init_comm` runs once per engine, before CUDA graphs are captured: a real TP group gets a
`Communicator` (backends + the measured dispatch table); `--emulate-comm` adds the cost
emulator's wait at every all-reduce point (instead of the communication on a lone process;
after it, padding to the table's latency, in a real group). Before `init_comm` a group uses
its process group's own all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from specserve.config import CommConfig
from specserve.distributed.communicator import Communicator
from specserve.distributed.emulator import CommEmulator, LatencyTable
from specserve.distributed.parallel_state import (
    get_tp_group,
    get_tp_size,
    init_emulated,
    is_emulated,
)

log = logging.getLogger(__name__)

_COMM: Communicator | None = None
_EMULATOR: CommEmulator | None = None

AddNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def emulated_tables(config: CommConfig) -> list[LatencyTable]:
    """The --emulate-comm tables, checked (ValueError says what to change)."""
    names = [n.strip() for n in config.emulate_comm.split(",") if n.strip()]
    tables = [LatencyTable.load(n) for n in names]
    for table in tables:
        table.latency_us(config.emulate_tp, 1)
    if config.emulate_compute == "shard" and not tables:
        raise ValueError("--emulate-compute shard needs --emulate-comm TABLE")
    return tables


def configure_shard_emulation(config: CommConfig) -> None:
    """A lone process becomes rank 0 of a TP --emulate-tp shard under --emulate-compute shard,
    and a lone rank again otherwise (call before building anything tensor-parallel)."""
    shard = config.emulate_compute == "shard"
    if get_tp_group() is not None:
        if shard:
            raise ValueError(
                "--emulate-compute shard stands in for TP on one process; use it with --tp-size 1"
            )
        return
    if shard and not config.emulate_comm.strip():
        raise ValueError("--emulate-compute shard needs --emulate-comm TABLE")
    init_emulated(config.emulate_tp if shard else 1)


def init_comm(
    config: CommConfig, *, hidden: int, dtype: torch.dtype, device: torch.device, rows: list[int]
) -> None:
    """Set up this process's communication for an engine (see the module docstring).
    rows: the row counts of the messages it will send (each message is [rows, hidden])."""
    global _COMM, _EMULATOR
    from specserve.kernels.dispatch import triton_usable

    tables = emulated_tables(config)
    group = get_tp_group()
    if tables and device.type == "cuda" and not triton_usable():
        raise ValueError("--emulate-comm on a GPU needs triton (its wait is a Triton kernel)")
    configure_shard_emulation(config)
    _COMM = _EMULATOR = None
    if group is not None:
        _COMM = Communicator(group, device, dtype, hidden, rows, config)
        log.info("all-reduce dispatch (%s):\n%s", _COMM.source, "\n".join(_COMM.describe()))
    if tables:
        log.info(
            "emulating communication: table %s at TP %d (compute %s)",
            tables[0].name,
            config.emulate_tp,
            config.emulate_compute,
        )
        elem = torch.empty((), dtype=dtype).element_size()
        _EMULATOR = CommEmulator(
            tables[0],
            config.emulate_tp,
            device,
            pad=group is not None,
            max_bytes=max(rows) * hidden * elem,
        )


def reset() -> None:
    """Forget the engine's communication set-up (lone process, nothing emulated)."""
    global _COMM, _EMULATOR
    _COMM = _EMULATOR = None
    if get_tp_group() is None:
        init_emulated(1)


def communicator() -> Communicator | None:
    return _communicator()


def emulator() -> CommEmulator | None:
    return _EMULATOR


def quiet_emulator() -> contextlib.AbstractContextManager:
    """Inside: the emulator's waits are zero (CUDA graph capture: the captured graphs wait
    the table's latencies at replay); a no-op without an emulator."""
    return _EMULATOR.quiet() if _EMULATOR is not None else contextlib.nullcontext()


def _communicator() -> Communicator | None:
    """The communicator of the current group (none once that group is gone)."""
    group = get_tp_group()
    return _COMM if _COMM is not None and group is not None and _COMM.group is group else None


def _group_all_reduce(x: torch.Tensor) -> torch.Tensor:
    comm = _communicator()
    if comm is not None:
        return comm.all_reduce(x)
    group = get_tp_group()
    if group is not None:  # before init_comm
        dist.all_reduce(x, group=group)
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks; returns the sum (x itself may be overwritten)."""
    emu = _EMULATOR
    if emu is None:
        return _group_all_reduce(x)
    emu.begin()
    x = _group_all_reduce(x)
    emu.wait(x.numel() * x.element_size())
    return x


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unfused: AddNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial sum [T, H]; (rms_norm(sum + residual), sum + residual)."""
    emu, comm = _EMULATOR, _communicator()
    if emu is not None:
        emu.begin()
        if get_tp_group() is None:  # a lone process: the wait stands in for the all-reduce
            emu.wait(x.numel() * x.element_size())
            return unfused(x, residual)
    if comm is not None:
        out = comm.all_reduce_add_rms_norm(x, residual, weight, eps, unfused)
    else:
        out = unfused(_group_all_reduce(x), residual)
    if emu is not None:  # pad the whole call to the table's latency
        emu.wait(x.numel() * x.element_size())
    return out


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order (same shape on every rank).
    An emulated shard repeats its own part (no wait: only all-reduces are emulated)."""
    world = get_tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    if is_emulated():
        return torch.cat([x] * world, dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=get_tp_group())
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s values, in place; returns `x`."""
    if get_tp_group() is None:
        return x
    dist.broadcast(x, src=src, group=get_tp_group())
    return x
