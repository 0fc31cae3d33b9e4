"""Small JSON values exchanged over a process group as byte tensors (never pickled)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives take tensors (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_json(value: Any, group: dist.ProcessGroup, src: int = 0) -> Any:
    """Group rank `src`'s value on every rank (the others pass anything, e.g. None)."""
    dev = _device(group)
    mine = dist.get_rank(group) == src
    data = json.dumps(value).encode() if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    root = dist.get_global_rank(group, src)
    dist.broadcast(size, root, group=group)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    if mine:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, root, group=group)
    return json.loads(buf.cpu().numpy().tobytes().decode())


def all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's value, in group rank order."""
    dev = _device(group)
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return [json.loads(p.cpu().numpy().tobytes().decode().rstrip("\0")) for p in parts]


def all_max(values: list[float], group: dist.ProcessGroup) -> list[float]:
    """Element-wise maximum over the ranks (inf stays inf)."""
    t = torch.tensor(values, dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()
