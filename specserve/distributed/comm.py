"""All tensor-parallel collectives go through here (no-ops for a lone rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from specserve.distributed.parallel_state import get_tp_group, get_tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place; returns `x`."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order (same shape on every rank)."""
    world = get_tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=get_tp_group())
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s values, in place; returns `x`."""
    if get_tp_size() == 1:
        return x
    dist.broadcast(x, src=src, group=get_tp_group())
    return x
