"""One run of the speculation-policy benchmark (scripts/bench_spec_policy.py): prompts fed
through the engine with a fixed number in flight, its steady-state tokens per second, steps
per mode and kind, catch-ups and Triton compiles; in a traced adaptive run, the engine's
record of each observed step beside the policy's."""

from __future__ import annotations

import time
from collections import deque

from specserve.bench.jit_watch import triton_compiles
from specserve.sampling_params import SamplingParams


def _engine_marks(engine, trace: list | None) -> tuple | None:
    """Before a step of a traced run: the trace's length and the drafter's counters that the
    step's engine record reports as differences (None: not traced)."""
    if trace is None:
        return None
    d = engine.drafter
    return len(trace), d.counters.num_catch_up_tokens, d.cycles_launched_ahead


def _trace_engine(engine, trace: list, marks: tuple, compiled: int) -> None:
    """After a traced step that the policy observed: what the engine did beside the policy's
    view, as one record after the step's (positions caught up, whether the step's cycle was
    the one launched ahead, Triton compiles so far in the run)."""
    n, caught, ahead = marks
    if len(trace) == n or "observed" not in trace[-1]:
        return  # nothing scheduled: no step to describe
    d = engine.drafter
    trace.append({"engine": {"caught_up": d.counters.num_catch_up_tokens - caught,
                             "ahead": d.cycles_launched_ahead - ahead, "compiled": compiled}})


def run(engine, prompts: list[list[int]], output_lens: list[int], concurrency: int) -> dict:
    """Feed the prompts with at most `concurrency` in flight; output tok/s and mode steps.
    Prompt i is seeded i: its synthetic acceptance rate and per-cycle draws are the same in
    every configuration. tok_s is the steady state: tokens emitted from the first finish (the
    first wave's prefill burst is behind) until the last prompt is admitted (every slot busy
    all along), over that time: admissions then match finishes, so the window carries the
    prefills of the requests whose decodes it counts. (A window from the start would charge
    a configuration whose requests finish at staggered times with the next wave's prefills
    but not their tokens.) tok_s_all counts the whole run, whose tail (the last, slowest
    requests on few slots) depends on how acceptance varies between requests rather than on
    the load. step_seconds: (steps, seconds, decode rows) per kind of step in the run
    (mode, "+mixed" when it carried prefill chunks)."""
    pending = deque((p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=i))
                    for i, (p, n) in enumerate(zip(prompts, output_lens)))
    in_flight, done_tokens = 0, 0
    first: tuple[float, int] | None = None  # (time, tokens) at the first finish
    last: tuple[float, int] | None = None  # at the last admission
    stats = engine.stats()
    before = dict(stats.get("mode_steps", {}))
    in_verify = stats.get("num_chunks_in_verify", 0)
    caught_up = stats.get("num_catch_up_tokens", 0)
    seconds_before = dict(stats.get("step_seconds", {}))
    trace = getattr(engine.spec_policy, "trace", None)  # a traced adaptive run
    t0 = time.perf_counter()
    with triton_compiles() as compiles:  # each a slow step of this run
        while pending or in_flight:
            while pending and in_flight < concurrency:
                engine.add_request(None, *pending.popleft())
                in_flight += 1
                if not pending:
                    last = time.perf_counter() - t0, done_tokens
            marks = _engine_marks(engine, trace)
            for out in engine.step():
                done_tokens += len(out.new_token_ids)
                in_flight -= out.finished
                if out.finished and first is None:
                    first = time.perf_counter() - t0, done_tokens
            if marks is not None:
                _trace_engine(engine, trace, marks, len(compiles.details))
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    after = stats.get("mode_steps", {})
    steps = {m: after[m] - before.get(m, 0) for m in after}
    by_kind = {}
    for kind, (n, t, b) in stats.get("step_seconds", {}).items():
        n0, t0_, b0 = seconds_before.get(kind, (0, 0.0, 0))
        if n > n0:
            by_kind[kind] = [n - n0, t - t0_, b - b0]
    assert last is not None
    # with no more prompts than slots (or no finish before the last admission) the whole
    # run counts
    if first is not None and last[0] > first[0] and last[1] > first[1]:
        window, tokens = last[0] - first[0], last[1] - first[1]
    else:
        window, tokens = seconds, done_tokens
    return {"tok_s": tokens / window, "tok_s_all": done_tokens / seconds, "seconds": seconds,
            "window_s": window, "tokens": done_tokens,
            "mode_steps": {m: n for m, n in steps.items() if n}, "step_seconds": by_kind,
            # steps whose prefill chunks ran in a chain's verify forward
            "chunks_in_verify": stats.get("num_chunks_in_verify", 0) - in_verify,
            # positions a drafter's catch-up forwards ran the target over (after off steps)
            "catch_up_tokens": stats.get("num_catch_up_tokens", 0) - caught_up,
            "triton_compiles": compiles,  # {kernel: compilations inside the run}
            "triton_compile_keys": compiles.details}  # which specialization each was
