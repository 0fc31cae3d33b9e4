"""The adaptive policy's start-up cost table (speculative/profile.py) within a time budget.

The full table (every mode and the plain step at batch sizes 1, 2, 4, .. max_num_seqs, then
steps that also carry a prefill chunk) takes ~0.6 s on a GPU but ~90 s on a CPU (SmolLM2-135M
with its EAGLE-3 head, 128 rows). Within a budget the batch sizes are timed from the smallest
up while the seconds spent plus the next size's predicted seconds fit (the last size's
seconds grown as they grew from the size before), the two smallest always; the sizes left
are extrapolated per mode from the measured ones (`extrapolate`), so the table still has
every batch size. The mixed steps are then timed at the largest measured batch up to the
rows asked for, one chunk size at a time, smallest first, while each fits; with none timed
the policy starts from its own priors of what a chunk adds (engine/goodput.py).

Every decision is made in the engine's process from rank 0's clock: each measurement is one
control call that every tensor-parallel rank runs (engine/executor.py), so the other ranks
run exactly the calls rank 0 decided on and cannot disagree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.spec_config import PROFILE_BUDGET
from specserve.speculative.profile import MIXED_CHUNKS

MIN_MEASURED = 2  # batch sizes always timed (the smallest ones): a slope to extrapolate

Table = dict[str, dict[int, float]]


@dataclass
class Profile:
    table: Table  # {mode or "off": {batch size: seconds}}, every size asked for
    mixed: Table  # {kind: {chunk tokens: extra seconds}} (empty: none timed)
    measured: list[int]  # the batch sizes timed; the others are extrapolated
    extrapolated: list[int]
    mixed_rows: int  # decode rows beside the timed chunks
    seconds: float
    budget: float  # 0: no limit
    skipped_chunks: list[int] = field(default_factory=list)  # chunk sizes over the budget

    def describe(self) -> str:
        """One line for the start-up log: what was measured, what extrapolated, how long."""
        text = f"batch sizes {_join(self.measured)} measured"
        if self.extrapolated:
            text += f", {_join(self.extrapolated)} extrapolated"
        if self.mixed:
            text += f"; mixed steps timed at {self.mixed_rows} rows"
            if self.skipped_chunks:
                text += f", chunks of {_join(self.skipped_chunks)} tokens not (over the budget)"
        elif self.skipped_chunks:
            text += "; mixed steps not timed (over the budget: the policy's own priors)"
        budget = f"budget {self.budget:g} s" if self.budget > 0 else "no budget"
        return f"{text}; {self.seconds:.1f} s to measure, {budget}"


def _join(values: list[int]) -> str:
    return ", ".join(map(str, values))


def profile_within(
    budget: float | None, sizes: list[int], mixed_rows: int,
    measure_costs: Callable[[list[int]], Table],
    measure_mixed: Callable[[int, list[int]], Table],
    chunks: tuple[int, ...] = MIXED_CHUNKS, clock: Callable[[], float] = time.perf_counter,
) -> Profile:
    """The cost table at `sizes` (ascending) and the mixed-step table at up to `mixed_rows`
    decode rows within `budget` seconds (0: no limit; None: PROFILE_BUDGET). measure_costs(batch
    sizes) and measure_mixed(rows, chunk sizes) time on every rank (profile_costs,
    profile_mixed). The engine's steps hold at most max_num_seqs rows, decodes and chunks
    alike: mixed_rows + 1 beyond it is a step no token graph holds, whose eager forward an
    H100 timed at 4.3 ms over a tiny pair's plain step where its real mixed steps added ~1.1
    ms (so the policy priced plain steps out). mixed_rows below 1 (one request a step): no
    mixed step is timed."""
    budget = PROFILE_BUDGET if budget is None else budget
    limit = budget if budget > 0 else math.inf
    start = clock()
    table: Table = {}
    spent: list[float] = []  # seconds of each measured size's call
    for i, bs in enumerate(sizes):
        if i >= MIN_MEASURED and clock() - start + _next_cost(sizes, spent, bs) > limit:
            break
        t0 = clock()
        for mode, row in measure_costs([bs]).items():
            table.setdefault(mode, {}).update(row)
        spent.append(clock() - t0)
    measured = list(sizes[:len(spent)])
    full = extrapolate(table, sizes)
    rows = max([b for b in measured if b <= mixed_rows] or measured[:1])
    # calls per table entry (a warm-up and the repeats), read off the call at those rows
    tabled = sum(row[rows] for row in table.values())
    per_entry = spent[measured.index(rows)] / tabled if tabled > 0 else 1.0
    mixed: Table = {}
    todo = sorted(chunks) if mixed_rows >= 1 else []
    while todo:
        n = todo[0]  # per kind: its decode step alone and beside the chunk, the chunk's extra
        guess = per_entry * sum(2 * full[k][rows] + _chunk_extra(mixed.get(k), full["off"], n)
                                for k in full)
        if clock() - start + guess > limit:
            break
        todo.pop(0)
        out = measure_mixed(rows, [n])
        for kind, row in out.items():
            mixed.setdefault(kind, {}).update(row)
        if n not in out.get("off", {}):  # cut to the room beside the rows (or none fit):
            todo = []  # every larger chunk would be cut alike
    return Profile(full, mixed, measured, [b for b in sizes if b not in measured], rows,
                   clock() - start, budget, todo)


def _next_cost(sizes: list[int], spent: list[float], bs: int) -> float:
    """Predicted seconds of timing batch size bs: the last size's, grown by the power of the
    batch ratio by which the last two sizes' seconds grew (not shrinking)."""
    (s0, s1), (t0, t1) = sizes[len(spent) - 2:len(spent)], spent[-2:]
    growth = math.log(t1 / t0) / math.log(s1 / s0) if t0 > 0 and t1 > 0 and s1 > s0 else 1.0
    return t1 * (bs / s1) ** max(0.0, growth)


def _chunk_extra(measured: dict[int, float] | None, off: dict[int, float], n: int) -> float:
    """Predicted extra seconds of a chunk of n tokens: a measured chunk's, scaled by tokens,
    else a plain decode step of n rows (its tokens as rows: an overestimate on a CPU)."""
    if measured:
        m = max(measured)
        return measured[m] * n / m
    return at(off, n)


def extrapolate(table: Table, sizes: list[int]) -> Table:
    """The table at every size: measured entries as they are, the others `at` them."""
    return {mode: {b: row[b] if b in row else at(row, b) for b in sizes}
            for mode, row in table.items()}


def at(row: dict[int, float], b: int) -> float:
    """Seconds at batch b from measured {batch: seconds}: linear between the points around
    it; past the last, linear through the last two but never below the last; below the
    first, the first."""
    points = sorted(row.items())
    if b <= points[0][0] or len(points) == 1:
        return points[0][1] if b <= points[0][0] else points[-1][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2:]
    return max(t1, t1 + (t1 - t0) * (b - b1) / (b1 - b0))
