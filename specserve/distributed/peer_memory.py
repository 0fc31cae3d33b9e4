"""Peer-addressable buffers for the one-shot kernels (`kernels.allreduce.PeerBuffers`).

GPU: torch symmetric memory (`torch.distributed._symmetric_memory`; CUDA backend, no
multicast): one allocation per group, rendezvoused once, its peer pointers and signal pads.
CPU: one shared-memory file per rank, mapped by every rank of the group; the kernels then run
under the Triton interpreter (tests of the kernels' synchronisation across real processes).
Both are collective: every rank calls them in the same order.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from specserve.kernels.allreduce import SIGNAL_SLOTS, PeerBuffers

_ALIGN = 128


def _signal_pad_bytes(world: int) -> int:
    return SIGNAL_SLOTS * world * 4


def cuda_peer_buffers(
    nbytes: int, group: dist.ProcessGroup, device: torch.device
) -> tuple[PeerBuffers, Any]:
    """(buffers, keep-alive handle) from torch symmetric memory on `device`."""
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    hdl = symm_mem.rendezvous(local, group)
    need = _signal_pad_bytes(hdl.world_size)
    if hdl.signal_pad_size < need:
        raise RuntimeError(
            f"symmetric-memory signal pads hold {hdl.signal_pad_size} bytes, "
            f"the one-shot kernels need {need}"
        )
    offset = local.data_ptr() - hdl.buffer_ptrs[hdl.rank]  # the tensor's place in its block
    ptrs = torch.tensor([p + offset for p in hdl.buffer_ptrs], dtype=torch.int64, device=device)
    pads = torch.tensor(list(hdl.signal_pad_ptrs), dtype=torch.int64, device=device)
    bufs = PeerBuffers(ptrs, pads, hdl.rank, hdl.world_size, nbytes)
    return bufs, (local, hdl)


def host_peer_buffers(nbytes: int, group: dist.ProcessGroup) -> tuple[PeerBuffers, Any]:
    """(buffers, keep-alive mappings) in shared-memory files: [buffer | signal pad] per rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(token, group_src(group, 0), group=group)  # one name for the whole group
    base = -(-nbytes // _ALIGN) * _ALIGN
    total = base + _signal_pad_bytes(world)
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    paths = [os.path.join(root, f"specserve-comm-{int(token)}-{r}") for r in range(world)]
    with open(paths[rank], "wb") as fh:
        fh.truncate(total)  # zero-filled: every signal flag starts at 0
    dist.barrier(group=group)
    maps = [torch.from_file(p, shared=True, size=total, dtype=torch.uint8) for p in paths]
    dist.barrier(group=group)  # every rank holds every mapping: the names can go
    os.unlink(paths[rank])
    ptrs = torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64)
    pads = ptrs + base
    return PeerBuffers(ptrs, pads, rank, world, nbytes), maps


def group_src(group: dist.ProcessGroup, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (what dist.broadcast's src means)."""
    return dist.get_global_rank(group, group_rank)
