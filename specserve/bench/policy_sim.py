"""A step-level simulation of load-adaptive speculation (torch-free): the real policy
(engine/spec_policy.py) driving a modelled engine, to see what the policy's own logic costs
(exploration, dwell, hysteresis, learning) apart from GPU noise, and to tune it without a GPU.

The model, per step:
- a closed loop of `concurrency` slots: a finished request's slot takes the next prompt;
  prompts prefill in chunks within the step's token budget (decode rows take theirs first:
  the mode's verified nodes a row), and a request's last chunk also samples its first token;
- time = the cost table's decode-step time of the step's mode at its decode batch
  (interpolated as the policy does), plus, when the step carries prefill chunks,
  `prefill_ms_per_token` per chunk token and a fixed extra: `mixed_ms` for a speculative step
  (the cycle then runs eagerly, chunks in its verify forward), `fold_ms` for a folded step,
  `plain_mixed_ms` for a plain one (its forward runs eagerly too), or per kind a line of
  its own (`mixed_lines`: a tree's verify beside the chunks costs more a token than a plain
  forward);
  plus, for rows whose drafter state is behind (tokens made while off), a catch-up of
  `catchup_ms` + `catchup_ms_per_token` per missed token (an off step's prefill chunks are
  missed too; a speculative or folded step's feed the drafter); plus, when the mode changes away
  from a speculative mode, that mode's step (the cycle launched ahead is discarded), and
  coming on from a plain step that launched its next decode ahead, a plain step;
  everything times a random factor (1 + noise * N(0, 1)); a mixed step right after a pure
  step of its mode never folds (that cycle was launched ahead: the engine keeps it);
- a plain step launches ahead unless a prompt is mid-prefill after it; the plain step after
  one that did runs decodes only (prompts that arrived wait a step: the engine's
  defer_prefill);
- acceptance as the engine's synthetic model: request r's rate is uniform on [a - d, a + d]
  (d = min(a, 1 - a)); a cycle walks its draft's deepest path, depth i passing with
  1 - (1 - rate)^c_i (c_i: the path node's candidates, 1 for a chain).

tok/s is the benchmark's steady window (scripts/bench_spec_policy.py): from the first finish
to the last admission. The model's numbers (costs of mixed steps, catch-ups, switches) are
inputs: fit them to a GPU run's per-kind step times before reading its absolute tok/s.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from specserve.bench.prompts import output_lengths
from specserve.engine.goodput import _interpolate
from specserve.engine.spec_policy import AdaptivePolicy, StaticPolicy

ADAPTIVE, OFF = "adaptive", "off"


@dataclass
class SimConfig:
    costs: dict[str, dict[int, float]]  # {mode | "off": {batch: seconds}} decode steps
    modes: dict[str, tuple[int, int]]  # {mode: (topk, num_steps)}
    accept_rate: float = 0.65
    prompt_len: int = 128
    output_len: int = 64
    output_spread: float = 0.0  # request i's output: output_len x U[1 - s, 1 + s] (bench/prompts)
    token_budget: int = 2048
    prefill_ms_per_token: float = 0.03
    mixed_ms: float = 2.0
    fold_ms: float = 1.0
    plain_mixed_ms: float = 0.0
    catchup_ms: float = 1.0
    catchup_ms_per_token: float = 0.02  # a target forward over them: H100, 8B, ~20 us each
    noise: float = 0.02
    overlap: bool = True  # cycles launched ahead (decode overlap): no fold where one holds
    children: dict[str, list[int]] = field(default_factory=dict)  # candidates per depth
    verify_tokens: dict[str, int] = field(default_factory=dict)  # a row's lookahead per mode
    # per kind of step ("off" for plain, a mode, "fold"): (fixed ms, ms a chunk token) of a
    # mixed step over its decode step, in place of the shared prefill_ms_per_token and the
    # kind's fixed part above (fitted to a sweep's static runs: scripts/simulate_spec_policy.py
    # --fit-static; a tree's verify beside the chunks costs ~2x a plain step's per token)
    mixed_lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per kind: its decode steps' mean time over the table's at their rows, which the policy
    # does not see in its table (an H100's plain steps under load: ~1.25x, mostly a few slow
    # ones; speculative: ~1.05x: scripts/simulate_spec_policy.py --fit-static)
    step_scale: dict[str, float] = field(default_factory=dict)
    # the start-up profile's mixed steps the policy starts from ({kind: {chunk tokens: ms}},
    # e.g. a sweep report's mixed_table_ms); empty: the model's own costs at 128 and 512
    # tokens (a profile that reads the steps exactly, which an engine's does not)
    mixed_priors: dict[str, dict[int, float]] = field(default_factory=dict)

    def mixed_ms_of(self, kind: str, tokens: int) -> float:
        """Milliseconds a step of `kind` carrying `tokens` chunk tokens takes over its
        decode step."""
        if kind in self.mixed_lines:
            fixed, per = self.mixed_lines[kind]
            return fixed + per * tokens
        fixed = {OFF: self.plain_mixed_ms, "fold": self.fold_ms}.get(kind, self.mixed_ms)
        return fixed + self.prefill_ms_per_token * tokens

    def lookahead(self, mode: str | None) -> int:
        """Tokens of the step's budget a decode row takes: the verified nodes (default: a
        chain's, steps + 1)."""
        if mode is None:
            return 1
        return self.verify_tokens.get(mode, self.modes[mode][1] + 1)

    def path_children(self, mode: str) -> list[int]:
        """Candidates at each depth of a mode's deepest path (default: topk at the root,
        halving per depth, at least 1)."""
        if mode in self.children:
            return self.children[mode]
        topk, steps = self.modes[mode]
        return [max(1, topk >> i) for i in range(steps)]


@dataclass
class _Request:
    rid: str
    rate: float
    out_len: int = 64
    prefilled: int = 0
    emitted: int = 0
    behind: int = 0  # tokens made while the drafter was off (the next cycle catches up)


def _step_seconds(rows: dict[str, list[tuple[int, float]]], mode: str | None,
                  batch: int) -> float:
    return _interpolate(rows[OFF if mode is None else mode], max(batch, 1))


def simulate(cfg: SimConfig, policy, concurrency: int, num_requests: int,
             seed: int = 0, log: list | None = None) -> dict:
    """One run: `num_requests` prompts through `concurrency` slots under `policy` (an
    AdaptivePolicy, a StaticPolicy, or None: off on every step). Returns tok_s (the steady
    window's), tok_s_all, steps per mode ("fold" for folded steps) and seconds. log: gets
    each step's (kind, decode rows, chunk tokens, what it launched ahead or None)."""
    rng = random.Random(seed)
    rows = {m: sorted(row.items()) for m, row in cfg.costs.items()}  # the table, sorted once
    half = min(cfg.accept_rate, 1.0 - cfg.accept_rate)
    lens = output_lengths(num_requests, cfg.output_len, cfg.output_spread)
    pending = deque(_Request(f"s{seed}-{i}", cfg.accept_rate + (2 * rng.random() - 1) * half,
                             lens[i]) for i in range(num_requests))
    active: list[_Request] = []
    clock, tokens = 0.0, 0
    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    steps: dict[str, int] = {}
    prev_mode: str | None = None
    launched: str | None = None  # the mode of the cycle launched ahead, if any
    overhead = {"switch": 0.0, "catch_up": 0.0}  # seconds of the run spent on these
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(pending.popleft())
            if not pending:
                last = clock, tokens
        decoding = [r for r in active if r.prefilled == cfg.prompt_len]
        mode = (policy.choose([r.rid for r in decoding], len(active) - len(decoding),
                              sum(r.behind for r in decoding))
                if policy is not None else None)
        # the step's plan: decode rows first (with the mode's lookahead), then chunks (none
        # on a plain step after a plain one launched ahead: they wait a step, the engine's
        # defer_prefill)
        budget = cfg.token_budget - len(decoding) * cfg.lookahead(mode)
        defer = launched == OFF and mode is None and bool(decoding) and any(
            r.prefilled < cfg.prompt_len for r in active)
        chunks: list[tuple[_Request, int]] = []
        for r in active:
            if r.prefilled < cfg.prompt_len and budget > 0 and not defer:
                n = min(cfg.prompt_len - r.prefilled, budget)
                chunks.append((r, n))
                budget -= n
        mixed = bool(chunks)
        # the engine folds no step whose decodes a cycle launched ahead holds (it runs anyway)
        fold = bool(mode is not None and mixed and decoding and launched != mode
                    and policy.fold(mode, [r.rid for r in decoding]))
        spec = mode is not None and not fold
        b = len(decoding)
        kind_now = mode if spec else None
        seconds = (_step_seconds(rows, kind_now, b) * cfg.step_scale.get(kind_now or OFF, 1.0)
                   if b else 0.0)
        if mixed:
            kind = mode if spec else "fold" if fold else OFF
            seconds += 1e-3 * cfg.mixed_ms_of(kind, sum(n for _, n in chunks))
        behind = sum(r.behind for r in decoding) if spec else 0
        if behind:
            extra = 1e-3 * (cfg.catchup_ms + cfg.catchup_ms_per_token * behind)
            seconds += extra
            overhead["catch_up"] += extra
        if b and (launched == OFF and spec or prev_mode is not None and mode != prev_mode):
            # the discarded launch ahead (a plain one: a plain step's time)
            extra = _step_seconds(rows, None if launched == OFF else prev_mode, b)
            seconds += extra
            overhead["switch"] += extra
        seconds *= max(0.5, 1.0 + cfg.noise * rng.gauss(0.0, 1.0))
        clock += seconds
        key = "fold" if fold else mode or OFF
        steps[key] = steps.get(key, 0) + 1
        accepted: dict[str, int] = {}
        chain: dict[str, int] = {}  # a tree's chain runs (2 r + o, as the engine's)
        finished: list[_Request] = []
        for r in decoding:
            n = 1
            if spec:
                r.behind = 0
                acc = run = 0
                alive = True
                for c in cfg.path_children(mode):
                    u = rng.random()  # the same draw decides the chain (one candidate)
                    alive = alive and u < r.rate
                    run += alive
                    if u >= 1.0 - (1.0 - r.rate) ** c:
                        break
                    acc += 1
                accepted[r.rid] = acc
                chain[r.rid] = 2 * run + alive  # o: the chain passed the whole path
                n += acc
            elif not fold:
                r.behind += 1
            n = min(n, r.out_len - r.emitted)
            r.emitted += n
            tokens += n
            if r.emitted >= r.out_len:
                finished.append(r)
        for r, n in chunks:
            r.prefilled += n
            if mode is None:  # an off step's chunks do not feed the drafter
                r.behind += n
            if r.prefilled == cfg.prompt_len:  # the last chunk samples the first token
                r.emitted = 1
                tokens += 1
        if policy is not None:
            policy.observe(mode, accepted, seconds, b, mixed=mixed, folded=fold,
                           chunk_tokens=sum(n for _, n in chunks),
                           chain_runs=chain if spec and cfg.modes[mode][0] > 1 else None)
        for r in finished:
            active.remove(r)
            if policy is not None:
                policy.forget(r.rid, cfg.prompt_len, r.out_len)
            if first is None:
                first = clock, tokens
        prev_mode = mode if spec else prev_mode if fold else None
        # a pure speculative step launches its mode's next cycle before the host reads it; a
        # plain one its next decode unless prefill is due next (a prompt not done, or one
        # deferred)
        launched = mode if spec and not mixed and cfg.overlap else None
        if mode is None and cfg.overlap and not defer and all(
                r.prefilled == cfg.prompt_len for r in active):
            launched = OFF
        if log is not None:
            log.append((key, b, sum(n for _, n in chunks), launched))
    if first is not None and last is not None and last[0] > first[0] and last[1] > first[1]:
        window, counted = last[0] - first[0], last[1] - first[1]
    else:
        window, counted = clock, tokens
    return {"tok_s": counted / window, "tok_s_all": tokens / clock, "seconds": clock,
            "steps": steps, "overhead_s": overhead}


def sweep(cfg: SimConfig, levels: list[int], requests_per_slot: int = 4,
          min_requests: int = 12, seed: int = 0, server: bool = True,
          repeats: int = 3) -> list[dict]:
    """Every configuration (off, each static mode, adaptive) at every concurrency, `repeats`
    runs each (their mean): [{concurrency, <config>: {tok_s, steps}, adaptive_vs_best}].
    server: one adaptive policy for the whole sweep, with a warm-up run at each
    concurrency first (the benchmark's default); else a fresh one every run."""
    shapes = dict(cfg.modes)

    # the engine's start-up profile of mixed steps: each kind's extra at two chunk sizes (its
    # 128 and 512 tokens: speculative/profile.py)
    priors = {k: {int(n): 1e-3 * ms for n, ms in row.items()}
              for k, row in cfg.mixed_priors.items()} or \
        {k: {n: 1e-3 * cfg.mixed_ms_of(k, n) for n in (128, 512)} for k in (OFF, *cfg.modes)}

    def adaptive() -> AdaptivePolicy:
        return AdaptivePolicy(shapes, cfg.costs, widths={m: cfg.lookahead(m) for m in shapes},
                              token_budget=cfg.token_budget, mixed_priors=priors)
    server_policy = adaptive()
    points = []
    for c in levels:
        n = max(c * requests_per_slot, min_requests)
        point: dict = {"concurrency": c}
        configs: list[tuple[str, object]] = [(OFF, None)]
        configs += [(m, StaticPolicy(m)) for m in cfg.modes]
        for name, pol in configs:
            runs = [simulate(cfg, pol, c, n, seed=seed + i) for i in range(repeats)]
            point[name] = _mean(runs)
        if server:
            simulate(cfg, server_policy, c, c, seed=seed + 1000 + c)  # the warm-up run
        runs = []
        for i in range(repeats):
            pol = server_policy if server else adaptive()
            runs.append(simulate(cfg, pol, c, n, seed=seed + i))
        point[ADAPTIVE] = _mean(runs)
        best = max(point[name]["tok_s"] for name, _ in configs)
        point["adaptive_vs_best"] = point[ADAPTIVE]["tok_s"] / best
        point["adaptive_vs_off"] = point[ADAPTIVE]["tok_s"] / point[OFF]["tok_s"]
        points.append(point)
    return points


def _mean(runs: list[dict]) -> dict:
    steps: dict[str, int] = {}
    for r in runs:
        for k, v in r["steps"].items():
            steps[k] = steps.get(k, 0) + v
    return {"tok_s": math.fsum(r["tok_s"] for r in runs) / len(runs), "steps": steps}
