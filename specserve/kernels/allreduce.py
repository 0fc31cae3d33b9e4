"""One-shot all-reduce over peer-addressable buffers, alone or fused with residual add + RMSNorm.

Every rank owns a buffer that every rank can address (`PeerBuffers`: torch symmetric memory on
GPUs; shared-memory files on the CPU, where the kernels run under the Triton interpreter) and a
signal pad of int32 flags. One launch, per program:
    1. copy: write this program's share of the local input into this rank's buffer;
    2. barrier A: tell every rank "my share is written", wait until every rank has said so;
    3. reduce: read the share from every rank's buffer in rank order 0..W-1 and sum in fp32
       (every rank computes bitwise the same sum), then write the output; the fused kernel
       rounds the sum, adds the residual and normalises the row (fused_ops rounding);
    4. barrier B: wait until every rank has read the share, so the next launch may overwrite it.

Signal pad (per rank, int32): flag [slot * W + r] == 1 means "rank r reached barrier `slot`".
Program p uses slot p for barrier A and MAX_PROGRAMS + p for barrier B. The sender sets a flag
(atomic exchange, release, system scope); the owner consumes it (compare-and-swap 1 -> 0,
acquire), so every flag is 0 between launches (graph replays rely on it). A flag cannot be set
twice before it is consumed: a sender sets the same barrier-A flag again only after passing
the owner's next barrier B, which the owner reaches only after consuming it (and likewise for
barrier B), so two barriers per launch on separate slots make the pads safe to reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl, triton
from specserve.kernels.fused_ops import rms_norm_row

MAX_PROGRAMS = 32
BLOCK = 1024  # elements per chunk of the plain all-reduce
SIGNAL_SLOTS = 2 * MAX_PROGRAMS  # barrier A and barrier B of every program


@dataclass(frozen=True)
class PeerBuffers:
    """Every rank's buffer and signal pad, as addresses valid in this process.

    buffer_ptrs / signal_ptrs: int64 [world] on the device the kernels run on; a buffer holds
    `nbytes`, a pad at least SIGNAL_SLOTS * world int32 flags (zeros when idle).
    """

    buffer_ptrs: torch.Tensor
    signal_ptrs: torch.Tensor
    rank: int
    world: int
    nbytes: int


@jit
def _barrier(sig_ptrs, slot, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    # send: set flag [slot * W + rank] in every rank's pad, one lane per rank (a vector
    # atomic whose results are unused, so replicated lanes are harmless)
    peers = tl.arange(0, WORLD_P2)
    real = peers < WORLD
    pads = tl.load(sig_ptrs + peers, mask=real, other=0).to(tl.pointer_type(tl.int32))
    tl.debug_barrier()  # the whole program's writes come before the release below
    tl.atomic_xchg(pads + slot * WORLD + rank, tl.full([WORLD_P2], 1, tl.int32), mask=real,
                   sem="release", scope="sys")  # fmt: skip
    # wait: consume flag [slot * W + p] of this rank's pad for every p (scalar atomics: their
    # result reaches every thread of the program)
    own = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32)) + slot * WORLD
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(own + p, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # no thread reads peers' buffers before every flag was seen


@jit
def _one_shot_kernel(
    x_ptr, out_ptr, buf_ptrs, sig_ptrs, numel, rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, MAX_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program p owns chunks p, p + P, ... of BLOCK elements of the flat message
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = x_ptr.dtype.element_ty
    own = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, numel, step):
        ok = start + offs < numel
        tl.store(own + start + offs, tl.load(x_ptr + start + offs, mask=ok), mask=ok)
    _barrier(sig_ptrs, pid, rank, WORLD, WORLD_P2)
    for start in range(pid * BLOCK, numel, step):
        ok = start + offs < numel
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(WORLD):
            peer = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
            acc += tl.load(peer + start + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + start + offs, acc.to(dtype), mask=ok)
    _barrier(sig_ptrs, MAX_P + pid, rank, WORLD, WORLD_P2)


@jit
def _one_shot_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptrs, sig_ptrs,
    rows, hidden, stride_x, stride_r, eps, rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, MAX_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program p owns rows p, p + P, ...; the buffer holds the message as [rows, hidden]
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    own = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    for row in range(pid, rows, progs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok)
        tl.store(own + row * hidden + cols, x, mask=ok)
    _barrier(sig_ptrs, pid, rank, WORLD, WORLD_P2)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    for row in range(pid, rows, progs):
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(WORLD):
            peer = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
            acc += tl.load(peer + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        # the unfused path's roundings: the sum, then the residual add, in the activation dtype
        res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * hidden + cols, h, mask=ok)
        y = rms_norm_row(h, w, hidden, eps)
        tl.store(out_ptr + row * hidden + cols, y.to(dtype), mask=ok)
    _barrier(sig_ptrs, MAX_P + pid, rank, WORLD, WORLD_P2)


def _consts(bufs: PeerBuffers) -> dict[str, int]:
    return {"WORLD": bufs.world, "WORLD_P2": next_power_of_2(bufs.world),
            "MAX_P": MAX_PROGRAMS}  # fmt: skip


def one_shot_all_reduce(x: torch.Tensor, bufs: PeerBuffers) -> torch.Tensor:
    """Sum of `x` over the ranks (a new tensor; every rank must call with the same shape)."""
    x = x.contiguous()
    assert x.numel() * x.element_size() <= bufs.nbytes, "message larger than the peer buffers"
    out = torch.empty_like(x)
    numel = x.numel()
    if numel:
        grid = (min(MAX_PROGRAMS, triton.cdiv(numel, BLOCK)),)
        _one_shot_kernel[grid](x, out, bufs.buffer_ptrs, bufs.signal_ptrs, numel, bufs.rank,
                               BLOCK=BLOCK, **_consts(bufs))  # fmt: skip
    return out


def one_shot_all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, bufs: PeerBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual), sum + residual) with sum = x summed over the ranks; x and
    residual [..., hidden], rows contiguous."""
    hidden = x.shape[-1]
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1 and weight.is_contiguous()
    assert x2.numel() * x2.element_size() <= bufs.nbytes, "message larger than the peer buffers"
    rows = x2.shape[0]
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    if rows:
        block = next_power_of_2(hidden)
        _one_shot_add_rms_norm_kernel[(min(MAX_PROGRAMS, rows),)](
            x2, r2, weight, out, res_out, bufs.buffer_ptrs, bufs.signal_ptrs, rows, hidden,
            x2.stride(0), r2.stride(0), eps, bufs.rank, BLOCK=block,
            num_warps=min(16, max(4, block // 512)), **_consts(bufs),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


# -- torch references: every rank's input given as a list ------------------------------------


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum in fp32 (the order does not matter at this precision for the tests' sizes)."""
    return torch.stack([p.float() for p in parts]).sum(0)


def all_reduce_add_rms_norm_ref(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum, add the residual, RMSNorm, all in fp32: (normed, sum + residual)."""
    h = all_reduce_ref(parts) + residual.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed, h
