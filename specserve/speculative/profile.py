"""Start-up cost table: seconds per step of each draft mode and of the plain step, per batch.

Each entry times the step exactly as it runs (the CUDA graph of the batch's bucket where
graphs are captured, the eager path otherwise) over rows that read and write only the pool's
spare page: no request's KV is touched and no per-request state is made. The rows sit at a
fixed context, so attention over long contexts is not in the table; the adaptive policy
rescales it by the step times it measures online (engine/spec_policy.py).
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
    worker, batch_sizes: list[int], repeats: int = 3, context: int = PROFILE_CONTEXT
) -> dict[str, dict[int, float]]:
    """{mode: {batch size: median seconds}}; mode "off" is the plain decode step.
    worker: SpecWorker."""
    runner = worker.runner
    context = min(context, runner.max_positions - worker.lookahead - worker.keep_ahead - 2)
    table: dict[str, dict[int, float]] = {"off": {}}
    for bs in batch_sizes:
        rows = _rows(runner, bs, context, context + worker.lookahead + worker.keep_ahead + 1)
        table["off"][bs] = _median_time(runner.device, partial(_plain, runner, rows), repeats)
        for name, mode in worker.modes.items():
            fn = partial(_cycle, worker, mode, rows)
            table.setdefault(name, {})[bs] = _median_time(runner.device, fn, repeats)
    return table


def _plain(runner, rows: StepInput) -> None:
    runner.launch(rows)


def _cycle(worker, mode, rows: StepInput) -> None:
    proposer = mode.cycle.proposer if mode.draft is None else mode.draft.proposer
    state = torch.zeros(rows.bs, proposer.state_dim, dtype=proposer.state_dtype,
                        device=worker.runner.device)
    inputs = {"state": state, "root_pos": rows.starts.copy(), "root_tokens": rows.token_ids.copy()}
    mode.cycles.run(rows, inputs)


def _rows(runner, bs: int, start: int, num_slots: int) -> StepInput:
    """bs greedy decode rows at position `start` whose page tables are the spare page only."""
    pages = -(-num_slots // runner.page_size)
    ones = np.ones(bs, dtype=np.int64)
    return StepInput(
        request_ids=[f"profile-{i}" for i in range(bs)],
        starts=ones * start,
        num_new_tokens=ones,
        next_token_ids=-ones,
        samples=ones.astype(bool),
        is_decode=ones.astype(bool),
        speculate=ones.astype(bool),
        lookahead=ones * 0,
        from_cache=np.zeros(bs, dtype=bool),
        num_tokens=ones * (start + 1),
        tokens_left=ones * (1 << 30),
        page_counts=ones * pages,
        temperature=np.zeros(bs),
        top_k=-ones,
        top_p=np.ones(bs),
        min_p=np.zeros(bs),
        seed=np.arange(bs),
        token_ids=(np.arange(bs) % 7) + 3,
        page_ids=np.full(bs * pages, runner.spare_page),
    )


def _median_time(device: torch.device, fn: Callable[[], None], repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up (kernel compilation, allocator)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def format_table(table: dict[str, dict[int, float]]) -> str:
    """The cost table as text, milliseconds (logged once at start-up)."""
    sizes = sorted(next(iter(table.values())))
    lines = ["mode        " + " ".join(f"{b:>8}" for b in sizes)]
    for mode, row in table.items():
        lines.append(f"{mode:<12}" + " ".join(f"{row[b] * 1e3:8.2f}" for b in sizes))
    return "\n".join(lines)
