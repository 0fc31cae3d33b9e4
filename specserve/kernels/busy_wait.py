"""A graph-safe busy-wait: one GPU thread block spins on the global timer.

`busy_wait(ns_table, index)` spins until `ns_table[index]` nanoseconds have passed since the
kernel started, or (with `stamp`) since the time `stamp_now(stamp)` recorded earlier in the
stream; the duration is read from device memory at run time, so a captured CUDA graph waits
whatever the table holds when it is replayed. Work later in the stream starts after the wait.

On the CPU the same calls spin on the host clock (time.perf_counter_ns): the CPU runs every op
synchronously, so a host spin costs exactly its duration too. `busy_wait_ref` is that path.
"""

from __future__ import annotations

import time

import torch

from specserve.kernels.dispatch import jit, tl, use_triton


@jit
def _stamp_kernel(stamp_ptr):
    tl.store(stamp_ptr, tl.extra.cuda.globaltimer())


@jit
def _busy_wait_kernel(ns_ptr, index, stamp_ptr, FROM_STAMP: tl.constexpr):
    if FROM_STAMP:
        start = tl.load(stamp_ptr)
    else:
        start = tl.extra.cuda.globaltimer()
    wait = tl.load(ns_ptr + index).to(tl.int64)
    now = tl.extra.cuda.globaltimer()
    while now - start < wait:
        now = tl.extra.cuda.globaltimer()


def stamp_now(stamp: torch.Tensor) -> None:
    """Record the current time (ns) in `stamp` [1] int64: the start of a padded interval."""
    if use_triton(stamp):
        _stamp_kernel[(1,)](stamp, num_warps=1)
    else:
        stamp[0] = time.perf_counter_ns()


def busy_wait(ns_table: torch.Tensor, index: int, stamp: torch.Tensor | None = None) -> None:
    """Spin for ns_table[index] ns from now, or from the time held in `stamp`."""
    if not use_triton(ns_table):
        busy_wait_ref(ns_table, index, stamp)
        return
    from_stamp = stamp is not None
    _busy_wait_kernel[(1,)](ns_table, index, stamp if from_stamp else ns_table,
                            FROM_STAMP=from_stamp, num_warps=1)  # fmt: skip


def busy_wait_ref(ns_table: torch.Tensor, index: int, stamp: torch.Tensor | None = None) -> None:
    """The host clock version (CPU tensors)."""
    start = int(stamp[0]) if stamp is not None else time.perf_counter_ns()
    end = start + int(ns_table[index])
    while time.perf_counter_ns() < end:
        pass
