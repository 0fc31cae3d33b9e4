"""CUDA graphs of fixed-shape batch functions, one graph per batch-size bucket.

`BatchGraphs` captures any function of batch-major static inputs (the plain decode step with
its LM head and sampling, the whole speculative cycle: draft loop, verify forward, acceptance,
draft extend). Inputs are buffers of shape [max_bs, ...]; a replay loads the step's values into
the first bs rows, fills the padding rows with harmless values (slot -1: nothing is written;
seq_len 1 over the spare page: a read whose result is dropped) and replays the smallest bucket
that fits. Outputs are batch-major too and are overwritten by the next replay: copy what must
survive.

`StaticInputs` moves a step's host values with as few copies as possible: every input of at
most SMALL_ROW_BYTES per row lives in one packed device block, filled from a pinned host
mirror by a single host-to-device copy; wider inputs (page tables) get one copy each, of the
rows and columns in use. Values already on the device are copied device to device.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.distributed.comm import quiet_emulator
from specserve.distributed.dispatch import message_rows

log = logging.getLogger(__name__)

BatchFn = Callable[..., Sequence[torch.Tensor]]
SMALL_ROW_BYTES = 16
_ALIGN = 16


def batch_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return small + list(range(16, max_bs, 16)) + [max_bs]


def comm_message_rows(config: EngineConfig) -> list[int]:
    """Rows of the all-reduce messages an engine sends: every graph batch bucket times 1
    (decode) and, with speculation, the verify width and the draft branching; plus powers of
    two up to the prefill token budget, and the token graphs' buckets."""
    spec = config.spec
    widths = [1] + ([spec.verify_tokens, spec.topk] if spec.enabled else [])
    from specserve.worker.token_graphs import token_buckets  # (it imports this module)

    graph_bs = min(config.cuda_graph_max_bs, config.scheduler.max_num_seqs)
    budget = config.scheduler.max_num_batched_tokens
    rows = message_rows(batch_buckets(graph_bs), widths, budget)
    tokens = min(config.cuda_graph_max_tokens, budget)
    return sorted(set(rows) | set(token_buckets(tokens))) if tokens > 0 else rows


class StaticInputs:
    """Batch-major device buffers with pinned host mirrors (see the module docstring)."""

    def __init__(self, specs: dict[str, torch.Tensor], pads: dict[str, int | float | bool]) -> None:
        """specs: {name: a tensor giving the buffer's shape [max_bs, ...], dtype and device}."""
        self.pads = pads
        first = next(iter(specs.values()))
        self.device = first.device
        self.max_bs = first.shape[0]
        pin = self.device.type == "cuda"
        small = {k: v for k, v in specs.items() if _row_bytes(v) <= SMALL_ROW_BYTES}
        self._small = set(small)
        offsets, size = {}, 0
        for key, spec in small.items():
            offsets[key] = size
            size += -(-spec.numel() * spec.element_size() // _ALIGN) * _ALIGN
        self._block = torch.zeros(max(size, _ALIGN), dtype=torch.uint8, device=self.device)
        self._host_block = torch.zeros_like(self._block, device="cpu", pin_memory=pin)
        self.buffers: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for key, spec in specs.items():
            if key in small:
                nbytes = spec.numel() * spec.element_size()
                view = slice(offsets[key], offsets[key] + nbytes)
                self.buffers[key] = self._block[view].view(spec.dtype).view(spec.shape)
                self.host[key] = self._host_block[view].view(spec.dtype).view(spec.shape)
            else:
                self.buffers[key] = torch.zeros_like(spec)
                self.host[key] = torch.zeros_like(spec, device="cpu", pin_memory=pin)
        self._host_np = {k: _numpy(v) for k, v in self.host.items()}
        self._copied = torch.cuda.Event() if pin else None
        self.reset()

    def reset(self) -> None:
        """Every row to its pad value (before capture)."""
        for key, buf in self.buffers.items():
            buf.fill_(self.pads[key])
            self.host[key].fill_(self.pads[key])

    def views(self, bs: int) -> dict[str, torch.Tensor]:
        return {key: buf[:bs] for key, buf in self.buffers.items()}

    def load(self, bs: int, bucket: int, values: dict[str, object],
             widths: dict[str, int] | None = None) -> None:
        """Rows [0, bs) <- values, rows [bs, bucket) <- pads. A value is a device tensor, a
        host tensor, a numpy array or a (nested) list with bs rows. widths[name] bounds the
        columns copied of a wide input (the kernels never read past them)."""
        if self._copied is not None:
            self._copied.synchronize()  # the pinned mirror is free again
        widths = widths or {}
        on_device = {}
        for key in self.buffers:
            value = values[key]
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                on_device[key] = value
                continue
            arr = self._host_np.get(key)
            if arr is not None:
                w = widths.get(key)
                target = arr[:bs] if w is None else arr[:bs, :w]
                target[...] = value.numpy() if isinstance(value, torch.Tensor) else value
                arr[bs:bucket] = self.pads[key]
            else:  # dtypes numpy lacks (bfloat16)
                self.host[key][:bs].copy_(torch.as_tensor(value))
                self.host[key][bs:bucket].fill_(self.pads[key])
        self._block.copy_(self._host_block, non_blocking=True)
        for key, buf in self.buffers.items():
            if key in on_device or key in self._small:
                continue
            w = widths.get(key)
            rows = slice(0, bucket)
            if w is None:
                buf[rows].copy_(self.host[key][rows], non_blocking=True)
            else:
                buf[rows, :w].copy_(self.host[key][rows, :w], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        for key, value in on_device.items():
            buf = self.buffers[key]
            buf[:bs].copy_(value)
            if bucket > bs:
                buf[bs:bucket].fill_(self.pads[key])


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    try:
        return t.numpy()
    except TypeError:  # bfloat16 has no numpy dtype
        return None


@contextlib.contextmanager
def no_gc_during_capture() -> Iterator[None]:
    """Keep the cyclic garbage collector off while a graph is captured.

    torch no longer collects when a capture begins, so a collection triggered mid-capture could
    free an earlier engine's CUDA graphs or events: their destruction is a CUDA call that is
    not permitted while a stream captures, and it invalidates the capture (collect before)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class BatchGraphs:
    def __init__(self, fn: BatchFn, inputs: dict[str, torch.Tensor],
                 pads: dict[str, int | float | bool], max_bs: int, name: str,
                 pool: object | None = None) -> None:
        """fn(**views) -> outputs, with views = {name: buffer[:bs]}; `inputs` give each
        buffer's shape [max_bs, ...], dtype and device (they are re-homed in StaticInputs)."""
        self.fn = fn
        self.inputs = StaticInputs(inputs, pads)
        self.max_bs = max_bs
        self.buckets = batch_buckets(max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Sequence[torch.Tensor]] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        gc.collect()  # garbage holding CUDA objects goes now, not during a capture
        with quiet_emulator():  # warm-ups wait no emulated latency; replays will
            for bs in tqdm(list(reversed(self.buckets)), desc=f"capturing {name} graphs",
                           leave=False):
                self._capture(bs)

    def _capture(self, bs: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernel compilation, library handles
                self.fn(**self.inputs.views(bs))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with no_gc_during_capture(), torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = tuple(self.fn(**self.inputs.views(bs)))
        self.graphs[bs] = graph

    def bucket(self, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= bs), None)

    def replay(self, bs: int, widths: dict[str, int] | None = None,
               **values: object) -> tuple[torch.Tensor, ...]:
        """Load values (bs rows each; see StaticInputs.load) and replay the bucket's graph."""
        b = self.bucket(bs)
        assert b is not None, f"batch {bs} exceeds the largest graph ({self.max_bs})"
        self.inputs.load(bs, b, values, widths)
        self.graphs[b].replay()
        return tuple(o[:bs] for o in self.outputs[b])
