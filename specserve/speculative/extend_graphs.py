"""A drafter's extend over prompt chunks and catch-up pieces through CUDA graphs.

`Proposer.extend` runs the draft head over the positions a prefill chunk (or a catch-up after
plain steps) adds: for EAGLE-3 / MTP one decoder layer plus the feature projection, some 400
kernel launches. Eager, its host time (2-3 ms a step on an H100 host, against ~0.1 ms of GPU
work for a 128-token chunk of a small head) was most of what a speculative step carrying a
new prompt cost beyond an off step (experiments/2026-12-07-rope-scale-nvfp4.md: 5.4 ms
against 1.8 ms on the bundled pair). `ExtendGraphs` captures the head's forward per token
bucket with worker/token_graphs.py (padded tokens write no KV, padded rows attend to
nothing) and one more static input, the target features, copied into a buffer of the
largest bucket's size before each replay.

Only heads whose attention takes the token graphs' metadata (MHA / GQA); an extend that no
bucket holds (more tokens or rows than the largest) runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from specserve.layers.attention import attention_modules
from specserve.layers.attention_metadata import AttentionMetadata
from specserve.worker.token_graphs import TokenGraphs, page_array

VARIANT = "draft extend"
log = logging.getLogger(__name__)


class ExtendGraphs:
    """The head's forward over T tokens per bucket, features read from `feats[:T]`."""

    def __init__(self, head_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor,
                                                AttentionMetadata], torch.Tensor],
                 runner, head: torch.nn.Module, feature_width: int, max_tokens: int,  # noqa: ANN001
                 max_rows: int, capture: bool = True) -> None:
        """head_forward(ids [T], positions [T], feats [T, F], md) -> the head's output
        [T, H] (the proposer's forward, its context set); feature_width F (0: the head reads
        no features); capture False: the padded call runs eagerly (CPU tests)."""
        self.runner = runner
        width = max(feature_width, 1)
        self.feats = torch.zeros(max_tokens, width, dtype=runner.dtype, device=runner.device)
        self.reads_feats = feature_width > 0
        attn = attention_modules(head)[0]

        def forward(ids: torch.Tensor, positions: torch.Tensor,
                    md: AttentionMetadata) -> torch.Tensor:
            feats = self.feats[: ids.numel()] if self.reads_feats else None
            return head_forward(ids, positions, feats, md)

        self.graphs = TokenGraphs(forward, max_tokens, max_rows, runner.max_pages,
                                  runner.max_positions, attn.num_heads // attn.num_kv_heads,
                                  attn.num_kv_heads, runner.page_size, runner.spare_page,
                                  runner.device, capture=capture, name=VARIANT)

    @staticmethod
    def fits(head: torch.nn.Module) -> bool:
        """Whether every attention layer of the head takes token graphs (MHA / GQA)."""
        mods = attention_modules(head)
        return bool(mods) and all(getattr(m, "takes_split", False) for m in mods)

    @property
    def replays(self) -> int:
        return self.graphs.replays[VARIANT]

    def run(self, starts: list[int], page_tables: list[list[int]],
            next_tokens: list[list[int]], feats: torch.Tensor | None,
            last: torch.Tensor | None = None) -> torch.Tensor | None:
        """The head's output [t, H] over Proposer.extend's arguments (t tokens: a view of the
        graph's buffer, valid until the next replay), or None where no bucket holds them."""
        q_lens = np.array([len(t) for t in next_tokens], dtype=np.int64)
        t = int(q_lens.sum())
        if self.graphs.bucket(t, len(q_lens)) is None:
            return None
        if self.reads_feats:
            assert feats is not None and feats.shape[0] == t
            self.feats[:t].copy_(feats)
        ids = np.fromiter((x for row in next_tokens for x in row), dtype=np.int64, count=t)
        first = np.asarray(starts, dtype=np.int64)
        positions = np.repeat(first - np.cumsum(q_lens) + q_lens, q_lens) + np.arange(t)
        table = page_array(page_tables, self.runner.spare_page)
        at = None if last is None else (self.runner.tensor(np.cumsum(q_lens) - 1), last)
        return self.graphs.run(ids, positions, q_lens, first + q_lens, table, VARIANT,
                               ids_at=at)[0]


def graph_extends(runner, proposers: list, max_tokens: int,  # noqa: ANN001
                  capture: bool = True) -> None:
    """Capture the extends of the proposers that offer it (`graph_extends`), over steps of up
    to max_tokens (the catch-ups' pieces; prefill chunks: the scheduler's budget) and as
    many rows as the runner's token graphs (capture False: their eager form, CPU tests)."""
    tokens = min(runner.token_graphs.buckets[-1], max_tokens)
    rows = runner.config.scheduler.max_num_seqs
    for p in proposers:
        t0 = time.perf_counter()
        if hasattr(p, "graph_extends") and p.graph_extends(tokens, rows, capture):
            log.info("drafter extend graphs: %d token buckets up to %d tokens in %.1f s",
                     len(p.extend_graphs.graphs.buckets), tokens, time.perf_counter() - t0)


def covers(proposer, max_tokens: int) -> bool:  # noqa: ANN001
    """Whether the proposer's extend graphs hold every extend of up to max_tokens tokens (the
    scheduler's budget: prefill chunks and catch-up pieces); else some run eagerly."""
    graphs = getattr(proposer, "extend_graphs", None)
    return graphs is not None and graphs.graphs.buckets[-1] >= max_tokens
