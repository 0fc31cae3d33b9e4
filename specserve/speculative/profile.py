"""Start-up cost table: seconds per step of each draft mode and of the plain step, per batch.

Each entry times the step exactly as it runs (the CUDA graph of the batch's bucket where
graphs are captured, the eager path otherwise) over rows that read and write only the pool's
spare page: no request's KV is touched and no per-request state is made. The rows sit at a
fixed context, so attention over long contexts is not in the table; the adaptive policy
rescales it by the step times it measures online (engine/spec_policy.py).

A drafter that builds its trees on the host (`host_drafts`: suffix decoding) has that work in
every step, so its modes are timed with it: each row's history is first filled with PROFILE
CONTEXT tokens of a repeating pattern (every match succeeds: full trees, the costly case), the
timed step builds the trees as a real step does, and the rows' histories are dropped after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from specserve.worker.step_input import StepInput

PROFILE_CONTEXT = 256  # positions the profiled rows attend over


def profile_costs(
    worker, batch_sizes: list[int], repeats: int = 3, context: int = PROFILE_CONTEXT,
    pipelined: bool = False,
) -> dict[str, dict[int, float]]:
    """{mode: {batch size: median seconds}}; mode "off" is the plain decode step.
    worker: SpecWorker. pipelined: each entry per launch of PIPELINED launches back to back
    with one synchronisation after them, median of `repeats` rounds (the device's rate when
    the host launches ahead, as the engine's overlap does), not of one launch waited for
    (a diagnostic: a sweep's measured steps of the speculative modes ran 20-50% under the
    waited-for entries at 128 rows on an H100, the plain step's at its entry)."""
    runner = worker.runner
    timed = _pipelined_time if pipelined else _median_time
    context = min(context, runner.max_positions - worker.lookahead - worker.keep_ahead - 2)
    table: dict[str, dict[int, float]] = {"off": {}}
    for bs in batch_sizes:
        rows = _rows(runner, bs, context, context + worker.lookahead + worker.keep_ahead + 1)
        table["off"][bs] = timed(runner.device, partial(_plain, runner, rows), repeats)
        for name, mode in worker.modes.items():
            proposer = _proposer(mode)
            host = getattr(proposer, "host_drafts", False)
            if host:  # a history behind each row, as a decoding request has
                proposer.observe(_rows(runner, bs, 0, context, new_tokens=context),
                                 [[] for _ in range(bs)])  # fmt: skip
            fn = partial(_cycle, worker, mode, rows)
            table.setdefault(name, {})[bs] = timed(runner.device, fn, repeats)
            if host:
                for rid in rows.request_ids:
                    proposer.release(rid)
    return table


def _proposer(mode):
    return mode.cycle.proposer if mode.draft is None else mode.draft.proposer


def _plain(runner, rows: StepInput) -> None:
    runner.launch(rows)


def _cycle(worker, mode, rows: StepInput) -> None:
    proposer = _proposer(mode)
    if getattr(proposer, "host_drafts", False):  # the host's trees, built every step
        state = proposer.host_states(mode.shape, rows)
    else:
        state = torch.zeros(rows.bs, proposer.state_dim, dtype=proposer.state_dtype,
                            device=worker.runner.device)
    inputs = {"state": state, "root_pos": rows.starts.copy(), "root_tokens": rows.token_ids.copy()}
    mode.cycles.run(rows, inputs)


def _rows(runner, bs: int, start: int, num_slots: int, new_tokens: int = 1) -> StepInput:
    """bs greedy decode rows at position `start` whose page tables are the spare page only
    (with new_tokens > 1: rows of that many tokens of a repeating pattern, for histories)."""
    pages = -(-num_slots // runner.page_size)
    ones = np.ones(bs, dtype=np.int64)
    pattern = np.arange(bs * new_tokens) % 7 + 3 if new_tokens > 1 else np.arange(bs) % 7 + 3
    return StepInput(
        request_ids=[f"profile-{i}" for i in range(bs)],
        starts=ones * start,
        num_new_tokens=ones * new_tokens,
        next_token_ids=-ones,
        samples=ones.astype(bool),
        is_decode=ones.astype(bool),
        speculate=ones.astype(bool),
        lookahead=ones * 0,
        from_cache=np.zeros(bs, dtype=bool),
        num_tokens=ones * (start + new_tokens),
        tokens_left=ones * (1 << 30),
        page_counts=ones * pages,
        temperature=np.zeros(bs),
        top_k=-ones,
        top_p=np.ones(bs),
        min_p=np.zeros(bs),
        seed=np.arange(bs),
        token_ids=pattern,
        page_ids=np.full(bs * pages, runner.spare_page),
    )


PIPELINED = 8  # launches a pipelined round times back to back


def _median_time(device: torch.device, fn: Callable[[], None], repeats: int,
                 launches: int = 1) -> float:
    """Median over `repeats` rounds of a round's seconds per launch: `launches` calls of fn
    back to back, one synchronisation after them (fn is warmed up first: kernel
    compilation, allocator)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / launches)
    return sorted(times)[len(times) // 2]


def _pipelined_time(device: torch.device, fn: Callable[[], None], repeats: int) -> float:
    return _median_time(device, fn, repeats, PIPELINED)


def format_table(table: dict[str, dict[int, float]]) -> str:
    """The cost table as text, milliseconds (logged once at start-up)."""
    sizes = sorted(next(iter(table.values())))
    lines = ["mode        " + " ".join(f"{b:>8}" for b in sizes)]
    for mode, row in table.items():
        lines.append(f"{mode:<12}" + " ".join(f"{row[b] * 1e3:8.2f}" for b in sizes))
    return "\n".join(lines)
