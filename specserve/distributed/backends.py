"""All-reduce backends behind one interface, and which of them a machine can use.

    nccl / gloo       the process group's own all_reduce (always there; gloo on the CPU)
    symm-one-shot     torch symmetric memory, one_shot_all_reduce_copy_out (one launch)
    symm-two-shot     torch symmetric memory, copy in + two_shot_all_reduce_out
    triton-one-shot   our one-shot kernel over peer buffers (kernels/allreduce.py), which also
                      fuses the residual add + RMSNorm into the same launch

Each is usable inside a CUDA graph (no host sync, fixed buffers). Multicast (NVLS) kernels are
never used. A backend takes messages up to `max_bytes` (None: any size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from specserve.kernels import allreduce as ar

BASES = ("nccl", "gloo")
CUSTOM = ("symm-one-shot", "symm-two-shot", "triton-one-shot")
NAMES = BASES + CUSTOM
SYMM_DTYPES = (torch.bfloat16, torch.float32)  # torch's symm-mem all-reduce kernels: no fp16


class CommBackend:
    """One way to sum a tensor over the group. `fused` backends also implement
    `all_reduce_add_rms_norm` in one launch."""

    name = ""
    fused = False
    max_bytes: int | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x may be overwritten)."""
        raise NotImplementedError

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{self.name} has no fused all-reduce + RMSNorm")


class ProcessGroupBackend(CommBackend):
    """torch.distributed.all_reduce on the group (NCCL on GPUs, gloo on the CPU), in place."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.name = dist.get_backend(group)
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class SymmMemBackend(CommBackend):
    """torch.ops.symm_mem one-shot or two-shot all-reduce through one symmetric buffer."""

    def __init__(
        self, kind: str, group: dist.ProcessGroup, nbytes: int, device: torch.device
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        assert kind in ("one-shot", "two-shot")
        self.name, self.kind, self.max_bytes = f"symm-{kind}", kind, nbytes
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        buf = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self.kind == "one-shot":  # copies x into the buffer inside the kernel
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", self.group_name, out)
        else:
            buf.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out)
        return out


class TritonOneShotBackend(CommBackend):
    """kernels/allreduce.py over peer buffers (symmetric memory, or shared memory on the CPU)."""

    name = "triton-one-shot"
    fused = True

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        from specserve.distributed import peer_memory

        self.max_bytes = nbytes
        if device.type == "cuda":
            self.bufs, self._keep = peer_memory.cuda_peer_buffers(nbytes, group, device)
        else:
            self.bufs, self._keep = peer_memory.host_peer_buffers(nbytes, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return ar.one_shot_all_reduce(x, self.bufs)

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ar.one_shot_all_reduce_add_rms_norm(x, residual, weight, eps, self.bufs)


class OrderedBackend(CommBackend):
    """Exact mode's all-reduce: every rank's partial gathered, then summed in fp32 in rank
    order, as the Triton one-shot kernel sums (so the two agree bit for bit). NCCL's ring and
    tree, and gloo's ring, cut a message into chunks by its size, so the order one element's
    partials are added in follows the batch; here each element is ((p0 + p1) + p2) ...
    whatever the message."""

    name = "ordered"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()
        return total.to(x.dtype)


def make_backend(
    name: str, group: dist.ProcessGroup, nbytes: int, device: torch.device
) -> CommBackend:
    if name in BASES:
        return ProcessGroupBackend(group)
    if name == "triton-one-shot":
        return TritonOneShotBackend(group, nbytes, device)
    return SymmMemBackend(name.removeprefix("symm-"), group, nbytes, device)


def availability(facts: dict[str, Any]) -> dict[str, str]:
    """{backend: "" if it can be tried here, else why not}, a pure function of:
    device ("cuda" | "cpu"), world, dtype (str), peer_access (every pair of the group's GPUs),
    symm_mem (importable), cuda_version (str | None), triton (usable on the device),
    interpreter (TRITON_INTERPRET=1)."""
    cuda, world, dtype = facts["device"] == "cuda", facts["world"], facts["dtype"]
    out = {
        "nccl": "" if cuda else "no CUDA GPU (the CPU all-reduces through gloo)",
        "gloo": "" if not cuda else "GPU tensors all-reduce through NCCL",
    }
    if not cuda:
        why = "needs CUDA GPUs with peer access (torch symmetric memory)"
        out.update({"symm-one-shot": why, "symm-two-shot": why})
        out["triton-one-shot"] = (
            ""
            if facts["interpreter"]
            else ("needs a CUDA GPU (on the CPU it runs only under TRITON_INTERPRET=1, for tests)")
        )
        return out
    symm = ""
    if world < 2:
        symm = f"needs >= 2 GPUs, found {world}"
    elif not facts["peer_access"]:
        symm = "some GPU pair of the group has no peer access (no P2P over PCIe/IOMMU)"
    elif not facts["symm_mem"]:
        symm = "torch.distributed._symmetric_memory is not importable"
    elif _version(facts["cuda_version"]) < (12, 3):
        symm = f"torch symmetric memory needs CUDA >= 12.3, torch has {facts['cuda_version']}"
    for kind in ("symm-one-shot", "symm-two-shot"):
        out[kind] = symm or (
            ""
            if dtype in ("bfloat16", "float32")
            else f"torch's symmetric-memory all-reduce has no {dtype} kernels "
            "(bfloat16 and float32 only)"
        )
    out["triton-one-shot"] = symm or ("" if facts["triton"] else "triton is not usable here")
    return out


def _version(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in (text or "").split(".")[:2])
    except ValueError:
        return (0,)


def local_facts(device: torch.device, world: int, dtype: torch.dtype) -> dict[str, Any]:
    """`availability`'s facts for this process (rank r of `world` drives cuda:r)."""
    import importlib.util
    import os

    from specserve.kernels.dispatch import triton_usable

    cuda = device.type == "cuda"
    peer = True
    if cuda:
        me = device.index if device.index is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        peer = all(
            torch.cuda.can_device_access_peer(me, j % count)
            for j in range(world)
            if j % count != me
        )
    return {
        "device": device.type,
        "world": world,
        "dtype": str(dtype).removeprefix("torch."),
        "peer_access": peer,
        "cuda_version": torch.version.cuda,
        "symm_mem": importlib.util.find_spec("torch.distributed._symmetric_memory") is not None,
        "triton": triton_usable(),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
