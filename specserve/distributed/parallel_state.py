"""Tensor-parallel process state: which rank this process is and how many ranks share a model.

One process per TP rank. Before `init_distributed` (or after `destroy`) the process is a lone
rank: `get_tp_rank() == 0`, `get_tp_size() == 1`, and every collective in `comm` is a no-op.

`init_emulated(n)` makes a lone process build rank 0's shard of a TP-n model (cost
benchmarks on one GPU: the per-GPU compute of TP-n); there is no group, and `comm` replaces
each collective by the communication-cost emulator's wait (outputs are meaningless).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None
_EMULATED = False

BACKENDS = ("gloo", "nccl")


def init_distributed(
    tp_size: int,
    rank: int,
    backend: str = "nccl",
    init_method: str = "tcp://127.0.0.1:29500",
) -> None:
    """Join the TP group of `tp_size` processes as `rank` (one group: the whole world).

    With nccl, rank r drives cuda:r (one host). `init_method` is any torch.distributed URL,
    e.g. `tcp://127.0.0.1:<free port>`.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _EMULATED
    if backend not in BACKENDS:
        raise ValueError(f"distributed backend must be one of {BACKENDS}, got {backend!r}")
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"need tp_size >= 1 and 0 <= rank < tp_size, got {tp_size=} {rank=}")
    assert _TP_GROUP is None, "init_distributed called twice without destroy()"
    _EMULATED = False
    if tp_size == 1:
        _TP_RANK, _TP_SIZE = 0, 1
        return
    # NVLink multicast (NVLS) is never used, by NCCL or by torch symmetric memory
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=rank)
    _TP_RANK, _TP_SIZE = rank, tp_size
    _TP_GROUP = dist.group.WORLD


def init_emulated(tp_size: int) -> None:
    """Act as rank 0 of `tp_size` ranks with no other process (see the module docstring)."""
    global _TP_RANK, _TP_SIZE, _EMULATED
    if tp_size < 1:
        raise ValueError(f"the emulated tp size must be >= 1, got {tp_size}")
    assert _TP_GROUP is None, "init_emulated inside a real TP group"
    _TP_RANK, _TP_SIZE, _EMULATED = 0, tp_size, tp_size > 1


def is_emulated() -> bool:
    """True while this lone process stands in for rank 0 of a larger group."""
    return _EMULATED


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_group() -> dist.ProcessGroup | None:
    """The process group collectives run over; None for a lone rank."""
    return _TP_GROUP


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (each rank passes its own); `value` when alone."""
    if _TP_GROUP is None:
        return value
    device = "cuda" if dist.get_backend(_TP_GROUP) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP_GROUP)
    return int(t.item())


def destroy() -> None:
    """Leave the group (safe to call when never initialised)."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _EMULATED
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _EMULATED = 0, 1, None, False
