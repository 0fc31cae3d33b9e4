"""Start-up measurement of the all-reduce candidates, per message size (feeds DispatchTable).

For each size every rank runs the same sequence of collectives: first one call of every
candidate, checked against the process group's own all-reduce (a backend that returns wrong
sums on this fabric is dropped for that size, on every rank); then the timing of the valid
ones. GPU: a CUDA graph of CALLS calls, replayed REPEATS times after a group barrier, the
median time per call; CPU: the same over eager calls. Each rank's times are combined by
maximum, so every rank computes the same choices. The first call of a custom kernel that
does not finish within HANG_S seconds (peer memory that never delivers a flag) stops the
start-up with what to do instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from specserve.distributed.backends import CommBackend
from specserve.distributed.dispatch import FUSED, pick
from specserve.distributed.exchange import all_max
from specserve.kernels.dispatch import use_triton
from specserve.kernels.fused_ops import fused_add_rms_norm, fused_add_rms_norm_ref

CALLS = 10
REPEATS = 5
HANG_S = 30.0
EPS = 1e-6
_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of the unfused path (what RMSNorm.forward(x, residual) runs)."""
    if use_triton(x, weight):
        return fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _candidate(
    backend: CommBackend,
    fused: bool,
    x: torch.Tensor,
    res: torch.Tensor | None,
    w: torch.Tensor | None,
    clone: bool,
) -> Callable[[], Any]:
    """One call of a candidate. clone: keep x intact for in-place backends (checks); timing
    runs on x itself, as the model does (in-place sums may overflow: times do not change)."""
    if fused:
        assert res is not None and w is not None
        return lambda: backend.all_reduce_add_rms_norm(x, res, w, EPS)
    if res is None:
        return lambda: backend.all_reduce(x.clone() if clone else x)
    return lambda: add_rms_norm(backend.all_reduce(x.clone() if clone else x), res, w, EPS)


def _error(out: Any, ref: Any) -> float:
    """Largest error relative to the reference's largest magnitude, over every output."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        scale = r.float().abs().max().clamp_min(1e-6)
        worst = max(worst, ((o.float() - r.float()).abs().max() / scale).item())
    return worst if all(torch.isfinite(o).all() for o in outs) else float("inf")


def _finish(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + HANG_S
    while not done.query():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} did not finish within {HANG_S:.0f} s at start-up (peer "
                "memory not delivering on this machine?); rerun with "
                "--comm-backend nccl"
            )
        time.sleep(1e-3)


def _time(fn: Callable[[], Any], device: torch.device, group: dist.ProcessGroup) -> float:
    """Median microseconds per call."""
    times = []
    if device.type == "cuda":
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(REPEATS + 1):  # the first replay warms up
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / CALLS)
        del graph
    else:
        for _ in range(REPEATS + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / CALLS)
    return statistics.median(times[1:])


def measure(
    backends: dict[str, CommBackend],
    base: str,
    rows_list: list[int],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    fuse: bool = True,
) -> list[dict[str, Any]]:
    """Table entries {"op", "nbytes", "rows", "us": {label: us | None}, "choice"} for both
    ops at every size: "all_reduce" times every backend that takes the size; "add_rms_norm"
    times the all_reduce winner's unfused path (and the base's) against the fused kernels."""
    rank = dist.get_rank(group)
    elem = torch.empty((), dtype=dtype).element_size()
    entries = []
    for rows in rows_list:
        nbytes = rows * hidden * elem
        gen = torch.Generator().manual_seed(rows * 1009 + rank)
        x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        res = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        w = 1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(rows))
        w = w.to(device, dtype)
        fits = [n for n, b in backends.items() if n != base and (b.max_bytes or nbytes) >= nbytes]
        plain = _measure_one(backends, [base, *fits], x, None, None, device, group)
        labels = [base, plain["choice"]]
        if fuse:
            labels += [n + FUSED for n in fits if backends[n].fused]
        normed = _measure_one(backends, list(dict.fromkeys(labels)), x, res, w, device, group)
        for op, timed in (("all_reduce", plain), ("add_rms_norm", normed)):
            entries.append({"op": op, "nbytes": nbytes, "rows": rows, **timed})
    return entries


def _measure_one(
    backends: dict[str, CommBackend],
    labels: list[str],
    x: torch.Tensor,
    res: torch.Tensor | None,
    w: torch.Tensor | None,
    device: torch.device,
    group: dist.ProcessGroup,
) -> dict[str, Any]:
    """{"us": {label: us | None}, "choice"}; labels[0] (the base) is the reference."""

    def make(label: str, clone: bool) -> Callable[[], Any]:
        backend = backends[label.removesuffix(FUSED)]
        return _candidate(backend, label.endswith(FUSED), x, res, w, clone)

    ref = make(labels[0], True)()
    errors = []
    for label in labels:
        try:
            out = make(label, True)()
        except RuntimeError:  # e.g. a size or alignment a backend refuses: not a candidate
            errors.append(float("inf"))
            continue
        _finish(device, f"the {label} all-reduce")
        errors.append(_error(out, ref))
    errors = all_max(errors, group)
    tol = _TOL[x.dtype]
    times = [
        _time(make(lb, False), device, group) if err <= tol else float("inf")
        for lb, err in zip(labels, errors)
    ]
    times = all_max(times, group)
    us = {lb: (None if t == float("inf") else round(t, 2)) for lb, t in zip(labels, times)}
    return {"us": us, "choice": pick(us)}
