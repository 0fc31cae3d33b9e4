"""Start-up forwards over every shape class of an eager extend, so that no Triton kernel
compiles inside a serving step.

An attention launch's query block (BLOCK_M: the next power of two of its longest query, up to
a tile cap), whether it splits the KV and the split count's combine kernel follow the launch's
shape and are compile-time constants: the first eager forward of a new class compiles a
kernel, ~0.5 s on an H200 (one compiled inside a catch-up step was measured at 558 ms), inside
that step. Graph replays never meet one (capture compiled theirs), but eager forwards do: a
drafter's catch-up after plain steps (each row's missed positions, a few to a few dozen), a
draft extend over a prompt's tail, a target forward past the captured token graphs.
`extend_shapes` lists forwards that meet every class (query class x grid widths doubling
from one row to the limits) and the start-up runs them before the first request. Triton keeps
what it compiled on disk, so a later start on the same machine pays only the forwards.

Every row's pages are the pool's spare page (the CUDA-graph padding rows' page): the forwards
write their K/V there (a row longer than a page overwrites its own earlier positions) and read
only what they wrote, never a page the allocator hands out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from specserve.layers.attention_metadata import AttentionMetadata
from specserve.worker.forward_batch import build_attention_metadata

log = logging.getLogger(__name__)

# longest query of each class: the attention kernels' query blocks are powers of two capped at
# 64 rows (paged_attention's TARGET_ROWS, mla_attention's max_rows), so 1 .. 64 covers them
QUERY_CLASSES = (1, 2, 4, 8, 16, 32, 64)


def extend_shapes(max_tokens: int, max_rows: int, max_len: int | None = None) -> list[list[int]]:
    """Query lengths per row of each warm-up forward: per class L (up to max_tokens), one row
    of L followed by 0, 1, 3, 7, ... one-token rows (1, 2, 4, 8, ... rows), up to as many as
    max_rows and max_tokens allow; then the longest class's row doubled on (2L, 4L, ... up
    to max_tokens) beside as many one-token rows as allowed. The grid grows 2x a forward, so
    each KV split count a launch of that class can take (a power of two from the grid:
    kernels/split_kv.py), and the combine kernel compiled per count, comes up once.

    max_len (default max_tokens): the longest row, the positions a row may reach (the
    runner's RoPE tables end there: a longer row would grow them after the CUDA graphs
    captured the old ones, and the replays would read freed memory)."""
    max_len = max_tokens if max_len is None else max_len
    out = []
    for q in QUERY_CLASSES:
        if q > min(max_tokens, max_len):
            break
        cap = min(max_rows, max_tokens - q + 1)
        rows = 1
        while True:
            out.append([q] + [1] * (rows - 1))
            if rows >= cap:
                break
            rows = min(2 * rows, cap)
    # past the longest class a query adds query blocks, not a new block size: with few rows
    # allowed only such queries make the grids that split the KV fewer ways (none at all: a
    # kernel of its own). So the longest class's first row doubles on, beside as many
    # one-token rows as fit, up to the token budget (at 16 rows, a catch-up over hundreds of
    # positions a row compiled one inside a timed step: H100, the bundled pair at C = 16)
    q = out[-1][0] if out else max_tokens + 1
    while 2 * q <= min(max_tokens, max_len):
        q *= 2
        out.append([q] + [1] * (min(max_rows, max_tokens - q + 1) - 1))
    return out


def warm_extends(run: Callable[[list[int], list[list[int]], AttentionMetadata], object],
                 page: int, page_size: int, device: torch.device, max_tokens: int,
                 max_rows: int, label: str, max_len: int | None = None) -> int:
    """Call run(q_lens, pages, md) over each of extend_shapes(max_tokens, max_rows, max_len):
    every row starts at position 0, its pages all `page`. Returns the forwards run."""
    t0 = time.perf_counter()
    shapes = extend_shapes(max_tokens, max_rows, max_len)
    with torch.inference_mode():  # as the engine's steps run (no autograd state, ever)
        for q_lens in shapes:
            pages = [[page] * -(-q // page_size) for q in q_lens]
            md = build_attention_metadata(q_lens, q_lens, pages, page_size, device)
            run(q_lens, pages, md)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("%s: %d eager extend shapes warmed in %.2f s", label, len(shapes),
             time.perf_counter() - t0)
    return len(shapes)


def warm_target(runner) -> int:
    """The target's eager forwards (ModelRunner: its page size, spare page, token budget and
    row limit); returns the forwards run."""
    sched = runner.config.scheduler

    def run(q_lens: list[int], pages: list[list[int]], md: AttentionMetadata) -> None:
        positions = runner.tensor([i for q in q_lens for i in range(q)])  # one copy
        runner.forward(torch.zeros_like(positions), positions, md)

    return warm_extends(run, runner.spare_page, runner.page_size, runner.device,
                        sched.max_num_batched_tokens, sched.max_num_seqs, "target",
                        runner.max_positions)


def warm_drafters(runner, proposers: dict) -> int:
    """Each drafter's eager extends (method -> Proposer; Proposer.extend over positions
    [0, L) of each row, on the spare page, with zero target features where it reads them);
    returns the forwards run."""
    sched = runner.config.scheduler
    page, hidden = runner.spare_page, runner.model_config.hidden_size
    total = 0
    for method, proposer in proposers.items():
        width = len(proposer.aux_layer_ids) * hidden if proposer.needs_target_features else 0

        def run(q_lens: list[int], pages: list[list[int]], md: AttentionMetadata,
                proposer=proposer, width=width) -> None:
            feats = None
            if width:
                feats = torch.zeros(sum(q_lens), width, dtype=runner.dtype,
                                    device=runner.device)
            proposer.extend([0] * len(q_lens), pages, [[0] * q for q in q_lens], feats)

        total += warm_extends(run, page, runner.page_size, runner.device,
                              sched.max_num_batched_tokens, sched.max_num_seqs,
                              f"drafter {method}", runner.max_positions)
    return total


def warms(runner) -> bool:
    """Whether this runner's eager forwards compile kernels (Triton attention on a GPU)."""
    return runner.device.type == "cuda" and getattr(runner.backend, "name", "") == "triton"
