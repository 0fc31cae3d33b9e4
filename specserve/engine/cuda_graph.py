"""CUDA graphs of fixed-shape batch functions, one graph per batch-size bucket.

`BatchGraphs` captures any function of batch-major static inputs (the plain decode forward,
the whole speculative cycle: draft loop, verify forward, acceptance, draft extend). Inputs are
buffers of shape [max_bs, ...]; a replay copies the step's values into the first bs rows, fills
the padding rows with harmless values (slot -1: nothing is written; seq_len 1 over page 0: a
read whose result is dropped) and replays the smallest bucket that fits. Outputs are
batch-major too and are overwritten by the next replay: copy what must survive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

BatchFn = Callable[..., Sequence[torch.Tensor]]


def batch_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return small + list(range(16, max_bs, 16)) + [max_bs]


class BatchGraphs:
    def __init__(self, fn: BatchFn, inputs: dict[str, torch.Tensor],
                 pads: dict[str, int | float | bool], max_bs: int, name: str,
                 pool: object | None = None) -> None:
        """fn(**views) -> outputs, with views = {name: buffer[:bs]}; every buffer is
        [max_bs, ...] and is reset to pads[name] before capture."""
        self.fn = fn
        self.inputs = inputs
        self.pads = pads
        self.max_bs = max_bs
        self.buckets = batch_buckets(max_bs)
        for key, buf in inputs.items():
            buf.fill_(pads[key])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Sequence[torch.Tensor]] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for bs in tqdm(list(reversed(self.buckets)), desc=f"capturing {name} graphs",
                       leave=False):
            self._capture(bs)

    def _views(self, bs: int) -> dict[str, torch.Tensor]:
        return {key: buf[:bs] for key, buf in self.inputs.items()}

    def _capture(self, bs: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernel compilation, library handles
                self.fn(**self._views(bs))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = tuple(self.fn(**self._views(bs)))
        self.graphs[bs] = graph

    def bucket(self, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= bs), None)

    def replay(self, bs: int, **values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy values (tensors with bs rows, any device) into the static inputs and replay."""
        b = self.bucket(bs)
        assert b is not None, f"batch {bs} exceeds the largest graph ({self.max_bs})"
        for key, buf in self.inputs.items():
            value = values[key]
            if value.device.type == "cpu" and buf.device.type == "cuda":
                value = value.pin_memory()
            buf[:bs].copy_(value, non_blocking=True)
            if b > bs:
                buf[bs:b].fill_(self.pads[key])
        self.graphs[b].replay()
        return tuple(o[:bs] for o in self.outputs[b])
