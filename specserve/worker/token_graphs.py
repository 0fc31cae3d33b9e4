"""CUDA graphs of the target's forward over any batch of T tokens: prefill chunks and decodes.

Decode steps replay graphs captured per batch size (worker/cuda_graph.py); a step that carries
a prefill chunk ran eagerly, and its host time (Python, Triton's launcher: ~300 launches for
a Llama-3.1-8B forward) came to 10-40 ms a step on an H100 / H200 where the GPU work of a
128-token chunk is 5.5 ms (experiments/2026-12-06-h200-profile-policy-exact-longctx.md).
`TokenGraphs` captures the forward (embedding to final norm, no LM head) once per token
bucket T over at most R = min(T, max_rows) requests, from the largest bucket down, sharing
one memory pool. A step of t <= T tokens over r <= R rows replays the smallest bucket that
holds it, its inputs padded:

    tokens  [0, t): the step's ids, positions and KV slots; [t, T): id 0, position 0, slot -1
            (nothing written; their hidden rows are garbage and dropped)
    rows    [0, r): query_start_loc, seq_lens, page tables; [r, R): no queries, no KV
    blocks  the attention grid: one program per (row, query block) of the step's rows, the
            rest padding (kernels/paged_attention.py `block_table`), T / block + R programs

Only plain causal batches: no custom mask (tree verify keeps its own graphs), attention
layers that take SplitMetadata (MHA / GQA: MLA's compute form sizes itself by host lengths),
the Triton backend. Variants (`add_variant`) are other functions of the same inputs: the
speculative worker's returns the drafters' aux features beside the hidden states. The
outputs are the bucket's buffers, valid until the variant's next replay (each variant has a
memory pool of its own, apart from the decode and speculative graphs').
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from specserve.distributed.comm import quiet_emulator
from specserve.kernels.paged_attention import PAD_BLOCK, query_block_size
from specserve.layers.attention_metadata import AttentionMetadata
from specserve.worker.cuda_graph import no_gc_during_capture
from specserve.worker.step_input import StepInput

log = logging.getLogger(__name__)

SMALL_BUCKETS = (16, 32, 64, 128, 256)
STEP = 256  # buckets past 256 tokens: every multiple of STEP (padding below STEP tokens)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: powers of two to 256 (GEMMs are weight-bound there: padding
    is nearly free), then multiples of 256 (at most 255 padded tokens), up to max_tokens."""
    small = [b for b in SMALL_BUCKETS if b < max_tokens]
    big = list(range(STEP * 2, max_tokens, STEP)) if max_tokens > STEP else []
    return small + big + [max_tokens]


def block_table(q_lens: np.ndarray, block_m: int, capacity: int) -> np.ndarray:
    """[capacity, 2] int32: (row, query block) for every block of block_m queries of the rows
    in order, then (0, PAD_BLOCK) entries, whose programs do nothing."""
    blocks = -(-np.asarray(q_lens, dtype=np.int64) // block_m)
    total = int(blocks.sum())
    assert total <= capacity, f"{total} query blocks exceed the table's {capacity}"
    table = np.empty((capacity, 2), dtype=np.int32)
    table[:, 0], table[:, 1] = 0, PAD_BLOCK
    table[:total, 0] = np.repeat(np.arange(len(blocks)), blocks)
    table[:total, 1] = np.arange(total) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    return table


class TokenBatch:
    """Bucket (T tokens, R rows): its attention block size and a step's padded inputs."""

    def __init__(self, tokens: int, rows: int, block_m: int) -> None:
        self.tokens, self.rows = tokens, rows
        self.block_m = block_m
        self.num_blocks = -(-tokens // block_m) + rows

    def arrays(self, ids: np.ndarray, positions: np.ndarray, q_lens: np.ndarray,
               seq_lens: np.ndarray, table: np.ndarray, page_size: int,
               write_kv: bool = True) -> dict[str, np.ndarray]:
        """The bucket's inputs from a step of t = len(ids) tokens over r = len(q_lens) rows;
        `table` [r, width] the rows' page tables (padded with any valid page); write_kv
        False: every slot -1 (the KV is in the cache already: a drafter's catch-up)."""
        t, r = len(ids), len(q_lens)
        assert t <= self.tokens and r <= self.rows and int(q_lens.sum()) == t
        row_of = np.repeat(np.arange(r), q_lens)
        slots = np.full(self.tokens, -1, dtype=np.int64)
        if write_kv:
            slots[:t] = table[row_of, positions // page_size].astype(np.int64) * page_size \
                + positions % page_size
        tok = np.zeros((2, self.tokens), dtype=np.int64)
        tok[0, :t], tok[1, :t] = ids, positions
        qsl = np.full(self.rows + 1, t, dtype=np.int32)
        qsl[0] = 0
        qsl[1 : r + 1] = np.cumsum(q_lens)
        lens = np.zeros(self.rows, dtype=np.int32)
        lens[:r] = seq_lens
        return {"tok": tok, "slots": slots, "qsl": qsl, "seq_lens": lens, "page_table": table,
                "blocks": block_table(q_lens, self.block_m, self.num_blocks)}


class TokenGraphs:
    """The buckets' shared input buffers and, per variant, one CUDA graph a bucket."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                         torch.Tensor],
                 max_tokens: int, max_rows: int, max_pages: int, max_positions: int,
                 group: int, num_kv_heads: int, page_size: int, spare_page: int,
                 device: torch.device, capture: bool = True, name: str = "plain") -> None:
        """forward(ids [T], positions [T], md) -> hidden [T, H]: the runner's forward (its
        context set), the first variant, `name`. capture False: no graphs; `run` calls
        forward over the padded buffers."""
        self.page_size, self.max_positions = page_size, max_positions
        self.buckets = token_buckets(max_tokens)
        self.batches: dict[int, TokenBatch] = {}
        for t in self.buckets:
            rows = min(t, max_rows)
            block_m = query_block_size(rows, t, group, num_kv_heads)
            self.batches[t] = TokenBatch(t, rows, block_m)
        big = self.batches[self.buckets[-1]]
        rows_max = max(b.rows for b in self.batches.values())
        blocks_max = max(b.num_blocks for b in self.batches.values())
        dev, i32 = device, torch.int32
        # one set of buffers at the largest sizes; bucket T uses leading views
        self.buf = {
            "tok": torch.zeros(2, big.tokens, dtype=torch.long, device=dev),
            "slots": torch.full((big.tokens,), -1, dtype=torch.long, device=dev),
            "qsl": torch.zeros(rows_max + 1, dtype=i32, device=dev),
            "seq_lens": torch.zeros(rows_max, dtype=i32, device=dev),
            "page_table": torch.full((rows_max, max_pages), spare_page, dtype=i32, device=dev),
            "blocks": torch.zeros(blocks_max, 2, dtype=i32, device=dev),
        }
        pin = device.type == "cuda"
        self.host = {k: torch.zeros_like(v, device="cpu", pin_memory=pin)
                     for k, v in self.buf.items()}
        self._copied = torch.cuda.Event() if pin else None
        self.capture = capture
        # one memory pool per variant, shared by no other graph: a graph captured into a pool
        # after another may place its outputs in the other's scratch, so replaying the other
        # would overwrite them (a decode or speculative cycle's sampled tokens, still to be
        # read, under a prefill step's activations). Within a variant the buckets share one
        # pool: its outputs are valid until that variant's next replay.
        self.pools: dict[str, object] = {}
        self.variants: dict[str, Callable[..., object]] = {}
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self.replays: dict[str, int] = {}  # steps run through the buckets, per variant
        self.add_variant(name, forward)

    def add_variant(self, name: str, fn: Callable[..., object]) -> None:
        """Another function of the buckets' inputs, fn(ids, positions, md) -> a tensor or a
        tuple of them (e.g. the hidden states and the drafters' features), captured for every
        bucket (largest first, in the shared pool)."""
        self.variants[name] = fn
        self.replays[name] = 0
        if not self.capture:
            return
        self.pools[name] = torch.cuda.graph_pool_handle()
        with quiet_emulator():  # warm-ups wait no emulated latency; replays will
            for t in tqdm(list(reversed(self.buckets)),
                          desc=f"capturing token graphs ({name})", leave=False):
                self._capture(name, t)

    def has(self, name: str) -> bool:
        return name in self.variants

    def bucket(self, tokens: int, rows: int) -> int | None:
        """The smallest bucket holding a step of `tokens` tokens over `rows` rows."""
        return next((t for t in self.buckets
                     if t >= tokens and self.batches[t].rows >= rows), None)

    def _views(self, t: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b, buf = self.batches[t], self.buf
        md = AttentionMetadata(
            slot_mapping=buf["slots"][:t], query_start_loc=buf["qsl"][: b.rows + 1],
            seq_lens=buf["seq_lens"][: b.rows], page_table=buf["page_table"][: b.rows],
            max_query_len=t, max_seq_len=self.max_positions,
            block_table=buf["blocks"][: b.num_blocks])
        return buf["tok"][0, :t], buf["tok"][1, :t], md

    def _call(self, name: str, t: int) -> tuple[torch.Tensor, ...]:
        out = self.variants[name](*self._views(t))
        return out if isinstance(out, tuple) else (out,)

    def _capture(self, name: str, t: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernel compilation, library handles
                self._call(name, t)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with no_gc_during_capture(), torch.cuda.graph(graph, pool=self.pools[name]):
            self.outputs[name, t] = self._call(name, t)
        self.graphs[name, t] = graph

    def load(self, t: int, ids: np.ndarray, positions: np.ndarray, q_lens: np.ndarray,
             seq_lens: np.ndarray, table: np.ndarray, tail_ids: torch.Tensor | None = None,
             write_kv: bool = True,
             ids_at: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Bucket t's buffers <- the step's padded inputs (host to device, no sync);
        tail_ids: the last len(tail_ids) token ids, on the device (ids holds placeholders);
        ids_at: (indices, ids) on the device, written over those token indices likewise."""
        arrays = self.batches[t].arrays(ids, positions, q_lens, seq_lens, table, self.page_size,
                                        write_kv)
        if self._copied is not None:
            self._copied.synchronize()  # the pinned mirror is free again
        r, width = table.shape
        for key, value in arrays.items():
            host, buf = self.host[key], self.buf[key]
            if key == "page_table":
                host[:r, :width].numpy()[...] = value
                buf[:r, :width].copy_(host[:r, :width], non_blocking=True)
                continue
            view = host[..., : value.shape[-1]] if key == "tok" else host[: len(value)]
            view.numpy()[...] = value
            dst = buf[..., : value.shape[-1]] if key == "tok" else buf[: len(value)]
            dst.copy_(view, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if tail_ids is not None:
            n, end = tail_ids.numel(), len(ids)
            self.buf["tok"][0, end - n : end].copy_(tail_ids.reshape(-1))
        if ids_at is not None:
            self.buf["tok"][0].index_copy_(0, *ids_at)

    def run(self, ids: np.ndarray, positions: np.ndarray, q_lens: np.ndarray,
            seq_lens: np.ndarray, table: np.ndarray, variant: str = "plain",
            tail_ids: torch.Tensor | None = None, write_kv: bool = True,
            ids_at: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, ...] | None:
        """The variant's outputs over the step's t tokens (each [t, ...], views of the graph's
        output buffers, valid until the next replay) through its bucket's graph, or None
        when no bucket holds the step. Without captured graphs (capture=False: CPU tests)
        the same padded call runs eagerly."""
        t = self.bucket(len(ids), len(q_lens))
        if t is None:
            return None
        self.load(t, ids, positions, q_lens, seq_lens, table, tail_ids, write_kv, ids_at)
        self.replays[variant] += 1
        graph = self.graphs.get((variant, t))
        if graph is None:
            # uncaptured (CPU): the same buffer reuse as a replay's, so that a caller holding
            # an output past the next run sees it overwritten here too
            fresh = self._call(variant, t)
            outs = self.outputs.setdefault((variant, t), tuple(torch.empty_like(o) for o in fresh))
            for o, f in zip(outs, fresh):
                o.copy_(f)
        else:
            graph.replay()
            outs = self.outputs[variant, t]
        return tuple(o[: len(ids)] for o in outs)


def build_token_graphs(runner) -> TokenGraphs | None:  # noqa: ANN001 (a ModelRunner)
    """The runner's token graphs (buckets up to `cuda_graph_max_tokens`, at most the token
    budget plus, with speculation, the verify nodes of every row), or None: the option 0,
    no decode graphs (CPU, --enforce-eager, a backend that is not graph-safe) or attention
    that is not MHA / GQA."""
    cfg = runner.config
    budget = cfg.scheduler.max_num_batched_tokens
    if cfg.spec.enabled:  # a chain's verify forward carries the chunks beside its nodes
        budget += cfg.scheduler.max_num_seqs * (cfg.spec.verify_tokens - 1)
    max_tokens = min(cfg.cuda_graph_max_tokens, budget)
    if max_tokens <= 0 or runner.decode_graphs is None:
        return None
    layers = runner.attn_layers
    if not all(getattr(m, "takes_split", False) for m in layers):
        log.info("token CUDA graphs off: only MHA/GQA attention takes them")
        return None
    heads, kv_heads = layers[0].num_heads, layers[0].num_kv_heads
    return TokenGraphs(runner.forward, max_tokens, cfg.scheduler.max_num_seqs, runner.max_pages,
                       runner.max_positions, heads // kv_heads, kv_heads, runner.page_size,
                       runner.spare_page, runner.device)


def forward_step(runner, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # noqa: ANN001
    """(hidden states [T, H], the rows of them that sample, those rows' step indices) of the
    target's forward over a plain step: a token graph's replay where one holds the step (its
    output buffer: use it before the next replay), else the eager forward."""
    graphed = run_step(runner, step, "plain")
    if graphed is not None:
        return graphed[0][0], graphed[1], graphed[2]
    batch = runner.prepare(step)
    hidden = runner.forward(batch.input_ids, batch.positions, batch.md)
    return hidden, batch.sample_rows, batch.sample_index


def run_step(runner, step: StepInput, variant: str  # noqa: ANN001
             ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, list[int]] | None:
    """(the variant's outputs over the step's tokens, the token rows that sample, those rows'
    step indices) through the runner's token graphs, or None: no graphs, no such variant, or
    no bucket holds the step."""
    graphs: TokenGraphs | None = getattr(runner, "token_graphs", None)
    if graphs is None or not graphs.has(variant):
        return None
    table, _ = step.page_table(runner.spare_page)
    outs = graphs.run(step.token_ids, step.positions(), step.num_new_tokens, step.seq_lens,
                      table, variant)
    if outs is None:
        return None
    sampled = SampleRows.of(runner, step)
    return outs, sampled.sample_rows, sampled.sample_index


@dataclass
class SampleRows:
    """The token rows of a step's hidden states that sample, and those rows' step indices
    (what the samplers read of a BatchInputs; no attention metadata built)."""

    sample_rows: torch.Tensor
    sample_index: list[int]

    @classmethod
    def of(cls, runner, step: StepInput) -> SampleRows:  # noqa: ANN001
        index = np.flatnonzero(step.samples)
        return cls(runner.tensor(step.tok_off[1:][index] - 1), index.tolist())


def page_array(pages: list[list[int]], pad: int) -> np.ndarray:
    """[rows, longest] int32 page tables from lists, padded with `pad`."""
    table = np.full((len(pages), max(1, max(len(p) for p in pages))), pad, dtype=np.int32)
    for r, p in enumerate(pages):
        table[r, : len(p)] = p
    return table
