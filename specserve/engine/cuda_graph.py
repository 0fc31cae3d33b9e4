"""CUDA graphs for fixed-shape forwards, one graph per batch-size bucket.

`GraphRunner` captures any forward whose shape is fixed by (batch size, tokens per request):
plain decode (1 token per request) today, and the verify shape (num_draft_tokens per request,
tree mask) or the draft step by the same code. Static input buffers are sized for the largest
bucket; a replay copies the step's inputs in with one host-to-device transfer, pads the unused
rows (slot -1: nothing is written; seq_len 1 over page 0: a harmless read) and replays the
smallest bucket that fits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from specserve.layers.attention_metadata import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)

log = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return small + list(range(16, max_bs, 16)) + [max_bs]


class GraphRunner:
    """Graphs of `forward(input_ids [T], positions [T], md) -> out [T, H]` with T = bs * q_len."""

    def __init__(self, forward: ForwardFn, backend: object, device: torch.device, max_bs: int,
                 q_len: int, max_pages: int, hidden_size: int, dtype: torch.dtype,
                 max_seq_len: int, name: str = "decode") -> None:
        self.forward = forward
        self.backend = backend
        self.q_len = q_len
        self.max_bs = max_bs
        self.max_seq_len = max_seq_len
        self.buckets = batch_buckets(max_bs)
        n = max_bs * q_len
        # static inputs; one int64 staging layout on the host mirrors them
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=device)
        self.mask = (torch.ones(max_bs, q_len, q_len, dtype=torch.bool, device=device)
                     if q_len > 1 else None)
        self.out = torch.empty(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in tqdm(list(reversed(self.buckets)), desc=f"capturing {name} graphs",
                       leave=False):
            self.graphs[bs] = self._capture(bs, pool)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[: bs * self.q_len],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs],
            max_query_len=self.q_len,
            max_seq_len=self.max_seq_len,
            custom_mask=None if self.mask is None else self.mask[:bs],
        )

    def _run(self, bs: int) -> torch.Tensor:
        t = bs * self.q_len
        set_forward_context(ForwardContext(self._metadata(bs), self.backend))
        try:
            return self.forward(self.input_ids[:t], self.positions[:t], self._metadata(bs))
        finally:
            set_forward_context(None)

    def _capture(self, bs: int, pool: object) -> torch.cuda.CUDAGraph:
        t = bs * self.q_len
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernel compilation, library handles
                self._run(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.out[:t] = self._run(bs)
        return graph

    def bucket(self, bs: int) -> int | None:
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    @torch.inference_mode()
    def replay(self, input_ids: list[int], positions: list[int], slots: list[int],
               seq_lens: list[int], page_tables: list[list[int]],
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the graph for a batch of len(seq_lens) requests; returns out [T, H]."""
        bs = len(seq_lens)
        b = self.bucket(bs)
        assert b is not None, f"batch {bs} exceeds the largest graph ({self.max_bs})"
        t, tb = bs * self.q_len, b * self.q_len
        pad_t, pad_b = tb - t, b - bs
        width = self.page_table.shape[1]
        rows = [p + [0] * (width - len(p)) for p in page_tables] + [[0] * width] * pad_b
        host = torch.tensor(
            input_ids + [0] * pad_t + positions + [0] * pad_t + slots + [-1] * pad_t
            + seq_lens + [1] * pad_b + [x for r in rows for x in r], dtype=torch.long)
        dev = host.pin_memory().to(self.input_ids.device, non_blocking=True)
        self.input_ids[:tb].copy_(dev[:tb])
        self.positions[:tb].copy_(dev[tb:2 * tb])
        self.slots[:tb].copy_(dev[2 * tb:3 * tb])
        self.seq_lens[:b].copy_(dev[3 * tb:3 * tb + b])
        self.page_table[:b].copy_(dev[3 * tb + b:].view(b, width))
        if mask is not None:
            assert self.mask is not None
            self.mask[:bs].copy_(mask)
        self.graphs[b].replay()
        return self.out[:t]
