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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from specserve.worker.step_input import StepInput

PROFILE_CONTEXT = 256  # positions the profiled rows attend over


def profile_costs(
    worker, batch_sizes: list[int], repeats: int = 3, context: int = PROFILE_CONTEXT,
) -> dict[str, dict[int, float]]:
    """{mode: {batch size: median seconds}}; mode "off" is the plain decode step.
    worker: SpecWorker. Each entry is one launch waited for; the engine's steps at the same
    rows took 0.94-1.03x it (median; H100, 8B) and back-to-back launches within 2-4% of it
    (experiments/2026-12-06-policy-trace.md)."""
    runner = worker.runner
    context = min(context, runner.max_positions - worker.lookahead - worker.keep_ahead - 2)
    table: dict[str, dict[int, float]] = {"off": {}}
    for bs in batch_sizes:
        rows = _rows(runner, bs, context, context + worker.lookahead + worker.keep_ahead + 1)
        table["off"][bs] = _median_time(runner.device, partial(_plain, runner, rows), repeats)
        for name, mode in worker.modes.items():
            with _histories(runner, mode, bs, context):
                fn = partial(_cycle, worker, mode, rows)
                table.setdefault(name, {})[bs] = _median_time(runner.device, fn, repeats)
    return table


@contextmanager
def _histories(runner, mode, bs: int, context: int) -> Iterator[None]:
    """For a drafter that builds its trees on the host: a history behind each of the bs
    profiled rows while timing (as a decoding request has), dropped after."""
    proposer = _proposer(mode)
    host = getattr(proposer, "host_drafts", False)
    if host:
        proposer.observe(_rows(runner, bs, 0, context, new_tokens=context),
                         [[] for _ in range(bs)])  # fmt: skip
    try:
        yield
    finally:
        if host:
            for i in range(bs):
                proposer.release(f"profile-{i}")


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
    return _step(runner, [(start, new_tokens, True)] * bs, num_slots)


def _step(runner, specs: list[tuple[int, int, bool]], num_slots: int) -> StepInput:
    """Rows (start, tokens, decode) over the spare page only (page tables of num_slots
    slots): decode rows speculate, prefill rows (decode False) are a prompt's last chunk."""
    bs = len(specs)
    pages = -(-num_slots // runner.page_size)
    starts = np.array([a for a, _, _ in specs], dtype=np.int64)
    new = np.array([n for _, n, _ in specs], dtype=np.int64)
    decode = np.array([d for _, _, d in specs], dtype=bool)
    ones = np.ones(bs, dtype=np.int64)
    return StepInput(
        request_ids=[f"profile-{i}" for i in range(bs)],
        starts=starts,
        num_new_tokens=new,
        next_token_ids=-ones,
        samples=ones.astype(bool),
        is_decode=decode,
        speculate=decode,
        lookahead=ones * 0,
        from_cache=np.zeros(bs, dtype=bool),
        num_tokens=starts + new,
        tokens_left=ones * (1 << 30),
        page_counts=ones * pages,
        temperature=np.zeros(bs),
        top_k=-ones,
        top_p=np.ones(bs),
        min_p=np.zeros(bs),
        seed=np.arange(bs),
        token_ids=np.arange(int(new.sum())) % 7 + 3,
        page_ids=np.full(bs * pages, runner.spare_page),
    )


MIXED_CHUNKS = (128, 512)  # prefill chunk tokens of the profiled mixed steps


def profile_mixed(worker, bs: int, chunks: tuple[int, ...] = MIXED_CHUNKS, repeats: int = 3,
                  context: int = PROFILE_CONTEXT) -> dict[str, dict[int, float]]:
    """{kind ("off" or a mode): {chunk tokens: seconds}}: what a step of bs decode rows takes
    beyond its decode step when it also carries one prefill chunk of that many tokens, each
    as the engine runs it: a plain step in one forward over the rows and the chunk (a token
    graph where one holds it), a speculative mode's chunk in a forward of its own that
    captures the drafters' features, the drafter fed over it, then the cycle (where both
    replay graphs; speculative/worker.py). The policy's priors for its fitted lines of mixed
    steps (engine/chunk_cost.py): a kind it rarely runs, as plain steps under load, would
    otherwise be priced from a few steps (on an H100 four plain mixed steps read a 0.7 ms
    fixed part where 150 read 5.4 ms, and the policy went off at C = 128 where chain2 ran
    1.15x plain: experiments/2026-12-06-policy-trace.md)."""
    runner = worker.runner
    dev = runner.device
    ahead = worker.lookahead + worker.keep_ahead + 1
    # each chunk within a prompt's length and the step's token budget beside the rows
    room = min(runner.max_positions - 1,
               runner.config.scheduler.max_num_batched_tokens - bs * (1 + worker.lookahead))
    chunks = tuple(sorted({min(n, room) for n in chunks if min(n, room) >= 1}))
    if not chunks:
        return {}
    context = min(context, runner.max_positions - ahead - 1)
    slots = max(context + ahead, max(chunks) + 1)
    rows = _step(runner, [(context, 1, True)] * bs, slots)
    base = {"off": _median_time(dev, partial(_plain, runner, rows), repeats)}
    out: dict[str, dict[int, float]] = {"off": {}}
    chunk_rows = {n: _step(runner, [(0, n, False)], slots) for n in chunks}
    for n in chunks:
        mixed = _step(runner, [(context, 1, True)] * bs + [(0, n, False)], slots)
        t = _median_time(dev, partial(_plain, runner, mixed), repeats)
        out["off"][n] = max(0.0, t - base["off"])
    for name, mode in worker.modes.items():
        with _histories(runner, mode, bs, context):
            t0 = _median_time(dev, partial(_cycle, worker, mode, rows), repeats)
            for n in chunks:
                fn = partial(_chunk_then_cycle, worker, mode, rows, chunk_rows[n])
                out.setdefault(name, {})[n] = max(0.0, _median_time(dev, fn, repeats) - t0)
    return out


def _chunk_then_cycle(worker, mode, rows: StepInput, chunk: StepInput) -> None:
    """A speculative mixed step: the chunk's forward with the drafters' features, the mode's
    drafter fed over its tokens (a state-keeping drafter), then the cycle."""
    from specserve.worker.token_graphs import forward_step, run_step

    proposer = _proposer(mode)
    view = worker.views.get(mode.method)
    feats = None
    if view is None:
        forward_step(worker.runner, chunk)
    elif (graphed := run_step(worker.runner, chunk, "features")) is not None:
        feats = view.select(graphed[0][1])
    else:
        batch = worker.runner.prepare(chunk)
        feats = view.select(worker._features_forward(batch.input_ids, batch.positions,
                                                     batch.md)[1])
    if feats is not None and mode.draft is not None and mode.draft.keeps_state:
        n = int(chunk.num_new_tokens[0])
        proposer.extend([0], chunk.page_lists(), [chunk.token_ids[1:n].tolist() + [3]], feats)
    _cycle(worker, mode, rows)


def _median_time(device: torch.device, fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of fn over `repeats` calls, each waited for (fn is warmed up first:
    kernel compilation, allocator)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
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
