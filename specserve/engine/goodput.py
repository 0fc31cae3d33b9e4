"""The adaptive speculation policy's model of a mode's tokens per second (torch-free): step
times from the start-up cost table, rescaled by what steps measure; the extra time of steps
that carry prefill chunks (engine/chunk_cost.py); and the decode batch each mode holds when
the step's token budget, not the number of requests, bounds it.

The policy (engine/spec_policy.py) builds on this model and adds what to run and when to
switch.
"""

from __future__ import annotations

import math

from specserve.engine.chunk_cost import ChunkCost

SPEC = "spec"  # the group of the speculative modes' mixed steps (_group)
PRIOR_WEIGHT = 4.0  # steps' worth of each profiled mixed-step point (decayed as steps are)


class GoodputModel:
    """Expected tokens per second of each mode ("off" for plain steps) at a decode batch."""

    def __init__(self, costs: dict[str, dict[int, float]], rescale: float = 0.1,
                 widths: dict[str, int] | None = None, token_budget: int | None = None,
                 max_rows: int | None = None,
                 mixed_priors: dict[str, dict[int, float]] | None = None) -> None:
        """costs: {mode or "off": {batch: seconds}}; rescale: weight of each measured step
        time in a mode's scale (0: the table as is); widths: the step-budget tokens a decode
        row of each mode takes (its verified nodes; default: a chain's, steps + 1, set by the
        policy); token_budget, max_rows: the scheduler's tokens a step and running requests
        (None: the budget bounds no mode's batch); mixed_priors: {kind: {chunk tokens:
        seconds}} a prefill chunk added to a step of each kind at start-up
        (speculative/profile.py: profile_mixed), the first points of the kinds' lines."""
        self.costs = {m: sorted(row.items()) for m, row in costs.items()}
        self.rescale = rescale
        self.widths = dict(widths or {})
        self.token_budget, self.max_rows = token_budget, max_rows
        self.scale = dict.fromkeys(costs, 1.0)  # measured / tabled step time, per mode
        self.scaled: set[str] = set()  # the modes whose pure decode steps were measured
        # steps with prefill chunks: their share (decayed) and, per mode, their extra seconds
        # over the decode step (prior: a speculative step runs the chunks in its verify
        # forward, eagerly: a quarter of a small step; a plain step folds them into its
        # forward)
        self.mixed_share = 0.0
        off_1 = _interpolate(self.costs["off"], 1)
        self.mixed_extra = {m: 0.0 if m == "off" else off_1 / 4 for m in costs}
        self.mixed_extra["fold"] = 0.0  # a folded step over the plain one (the drafter's feed)
        self.mixed_prior = dict(self.mixed_extra)
        # a fold runs the chunks in the plain step's forward (plus the drafter's feed): until
        # one is measured, it costs what a plain mixed step does, never less (mixed_line).
        # Priced free before, a chain beside arrivals looked cheap: on the PCIe table at
        # concurrency 2 the policy ran chain 1 at 0.94x plain
        self.fold_seen = False
        # with steps' chunk tokens known: each kind's extra as fixed + per token, and the
        # chunk tokens per emitted token (decayed sums over steps)
        self.chunk_cost = ChunkCost(group=_group)
        for kind, row in (mixed_priors or {}).items():
            for tokens, extra in row.items():
                self.chunk_cost.prior(kind, int(tokens), extra, PRIOR_WEIGHT)
        self.chunk_ema = self.emitted_ema = 0.0
        # prompt tokens prefilled and output tokens of finished requests (decayed per
        # request): the load's prompt tokens per output token, which no mode changes
        self.done_prompt = self.done_output = self.done_n = 0.0

    def step_time(self, mode: str | None, batch: int) -> float:
        key = "off" if mode is None else mode
        return self.scale_of(key) * _interpolate(self.costs[key], batch)

    def scale_of(self, key: str) -> float:
        """A mode's measured / tabled ratio; for one not measured yet the mean of the measured
        speculative modes' (a speculative one) or of all measured (off), else 1: on a
        host-bound model every step runs 2-3x the table, and an unmeasured mode left at 1
        looks 2-3x cheaper than it is."""
        if key in self.scaled or not self.scaled:
            return self.scale[key]
        seen = [m for m in self.scale if m in self.scaled]  # table order: a set's varies
        kin = [m for m in seen if m != "off"] if key != "off" else []
        pool = kin or seen
        return sum(self.scale[m] for m in pool) / len(pool)

    def learn_scale(self, key: str, ratio: float) -> None:
        """One pure decode step's measured / tabled ratio into the mode's decayed scale (the
        first from scale_of's borrowed value, not from 1)."""
        if key not in self.scaled:
            self.scale[key] = self.scale_of(key)
            self.scaled.add(key)
        self.scale[key] += self.rescale * (ratio - self.scale[key])

    def mixed_line(self, kind: str) -> tuple[float, float]:
        """(fixed seconds, seconds per chunk token) of a mixed step of `kind` over its decode
        step: fitted, or for a kind not seen yet the pooled slope and, for a speculative mode,
        the mean fixed part of the speculative modes seen (each runs its cycle eagerly beside
        the chunks: on an H100 8B all of them 13-16 ms, where the prior says a quarter of a
        plain step), else its prior."""
        line = self.chunk_cost.line(kind)
        if line is not None:
            return line
        if kind == "fold":  # runs the chunks in the plain step's forward: at least its cost
            return self.mixed_line("off")
        slope = self.chunk_cost.pooled_slope() or 0.0
        if _group(kind) == SPEC:  # a speculative kind: as the ones seen (one eager cycle)
            seen = [ln[0] for k in self.chunk_cost.kinds() if _group(k) == SPEC
                    for ln in [self.chunk_cost.line(k)] if ln is not None]
            if seen:
                return sum(seen) / len(seen), slope
        return self.mixed_prior[kind], slope

    def goodput(self, name: str, tokens: float, b: int, share: float) -> tuple[float, bool]:
        """Tokens per second of mode `name` (`tokens` a cycle for the batch of b; "off":
        b tokens) counting the steps that carry prefill chunks, and whether those steps
        should fold: the choice that maximizes the whole rate (not the mixed step's own: a
        verify beside the chunks may yield more per second than the fold and still cost
        more than its extra tokens are worth at the rate the other steps run).

        With steps' chunk tokens known: the prompt tokens to prefill per emitted token
        (rho) do not depend on the mode, so a mode emitting E tokens a step carries rho E
        of them a step, in a share s = min(1, rho E / its mean chunk) of its steps, each paying
        the kind's fixed part, plus its per-token cost on all of them. Else `share` of the
        steps (the recent share of mixed steps) pays the kind's mean extra."""
        t = self.step_time(None if name == "off" else name, b)
        t_off = self.step_time(None, b)
        if self.chunk_cost.mean_tokens and self.emitted_ema > 0.0:
            rho = self.prompt_per_output()
            s = self.share_of(name, tokens, rho)
            a, c = self.mixed_line(name)
            rates = [tokens / (t + s * a + c * rho * tokens)]
            if name != "off":  # its mixed steps folded: b tokens, the plain step's time
                a_f, c_f = self.mixed_line("fold")
                x = (1.0 - s) * tokens + s * b
                rates.append(x / ((1.0 - s) * t + s * (t_off + a_f) + c_f * rho * x))
        else:
            spec = tokens, t + self.mixed_extra[name]
            fold = self.mixed_extra["fold" if self.fold_seen else "off"]
            kinds = [spec] if name == "off" else [spec, (float(b), t_off + fold)]
            rates = [((1.0 - share) * tokens + share * x) / ((1.0 - share) * t + share * y)
                     for x, y in kinds]
        return max(rates), len(rates) > 1 and rates[1] > rates[0]

    def count_tokens(self, chunk_tokens: int, emitted: int) -> None:
        """A step's prefill chunk tokens and decode tokens emitted (decayed per step)."""
        self.chunk_ema = 0.98 * self.chunk_ema + chunk_tokens
        self.emitted_ema = 0.98 * self.emitted_ema + emitted

    def share_of(self, name: str, tokens: float, rho: float) -> float:
        """The share of a kind's steps that carry prefill chunks, emitting `tokens` a step:
        rho x tokens / its mean chunk (its own mixed steps', else the recent ones' of every
        kind). Charged the kind's fixed part per mixed step and its slope per chunk token,
        the kind pays what its mixed steps measured per chunk token (ybar / nbar), however
        its fitted line splits into fixed part and slope.

        Plain steps whose own mixed steps were stale once took their share from the running
        kind's instead (a Poisson rate of prompts per emitted token), with their stale line's
        fixed part: on an H100 (8B, 128-token prompts, 64 out, rate 0.65) that share read
        0.61 where plain steps ran ~0.86 mixed, off's fixed part 1.6 ms where its steps took
        4.4-5.4 ms; off scored 14% above chain2 at C = 128 (it ran 0.87 of chain2) and the
        policy went off and stayed (the catch-up back grew with every step): 0.84-0.88 of
        the best; at C = 64 a like excursion cost the tree 8 steps and 1.5k positions of
        catch-up (experiments/2026-12-06-policy-trace.md)."""
        share = min(1.0, rho * tokens / self.chunk_cost.mean_chunk(name))
        own = self.chunk_cost.chunks.get(name)
        if _group(name) != SPEC or self.done_prompt <= 0.0 or (
                own is not None and own[0] >= 1.0 and self.ran_lately(name)):
            return share
        # a speculative mode with no mixed steps of its own lately: its chunks were measured
        # at another mode's rate of arrivals (the running one's, fewer tokens a step: one
        # prompt a chunk). Its own rate lam = rho x tokens / prompt prompts a step, apart
        # (finishes trickle in: a speculative step's rows finish apart), leaves 1 - e^-lam
        # of its steps mixed, each carrying lam / (1 - e^-lam) prompts: on an H100 (8B,
        # rate 0.65, C = 32, started cold) the tree read 1.0 here and scored 5% under
        # off where, run, it made 1.09x off's tokens a second
        lam = rho * tokens * self.done_n / self.done_prompt
        return min(share, -math.expm1(-lam))

    def ran_lately(self, name: str) -> bool:
        """Whether the mode's own mixed steps are recent enough to stand for its share
        (the policy: it ran within its horizon). Its own chunks age only with the mixed steps
        of its group, so through a stretch off a mode keeps what it measured long ago, at
        another load: on the bundled pair (H100, C = 16) a tree's one-prompt chunks from an
        earlier stretch read a share of 0.5 where it ran 0.25, and it scored 0.86x off while
        delivering 1.1x."""
        return True

    def learn_mixed(self, key: str, extra: float, chunk_tokens: int | None,
                    batch: int = 0) -> None:
        """A mixed step's extra seconds (beside `batch` decode rows): with its chunk tokens
        known, every kind's extra is re-read from its fitted line at the recent mean chunk
        size (engine/chunk_cost.py); else a decayed mean of the kind's extras. A step whose
        chunks filled what its budget left beside the rows carried a backlog, not arrivals."""
        self.fold_seen = self.fold_seen or key == "fold"
        if chunk_tokens is None:
            self.mixed_extra[key] += 0.1 * (extra - self.mixed_extra[key])
            return
        width = self.widths.get(key, 1)
        full = bool(self.token_budget) and chunk_tokens + batch * width >= self.token_budget
        self.chunk_cost.observe(key, chunk_tokens, extra, arrival=not full)
        for kind in self.chunk_cost.kinds():
            self.mixed_extra[kind] = self.chunk_cost.extra(kind)

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request ended having prefilled `prompt_tokens` and made `output_tokens`."""
        if output_tokens > 0:
            self.done_prompt = 0.95 * self.done_prompt + prompt_tokens
            self.done_n = 0.95 * self.done_n + 1.0
            self.done_output = 0.95 * self.done_output + output_tokens

    def prompt_per_output(self) -> float:
        """Prompt tokens to prefill per output token: of the ~20 requests that finished
        last; before any did, of the recent steps (whose mix of prefill and decode
        in a load's first wave says little)."""
        if self.done_output > 0.0:
            return self.done_prompt / self.done_output
        return self.chunk_ema / self.emitted_ema if self.emitted_ema > 0.0 else 0.0

    def batches(self, per_row: dict[str, float], b: int, others: int,
                current: str) -> dict[str, float]:
        """The decode batch each mode would hold, from the b rows decoding now under
        `current` while `others` requests prefill or wait (per_row: a mode's expected
        tokens a decode row emits per step).

        A mode of width w emitting E a row brings rho E prompt tokens a row per step to
        prefill (rho: prompt tokens per emitted token, the same for every mode), so the
        budget sustains at most budget / (w + rho E) decode rows; the b + others requests
        (at most max_rows) bound it too. b relates to the current mode's bound as every
        mode's batch to its own: requests in their prefill are a share of all whatever the
        mode, so b scales by the ratio of the two bounds. A deeper draft on a budget that
        prefill fills holds fewer rows than plain decoding would, which a score at today's
        batch does not see."""
        if not self.token_budget or not b:
            return dict.fromkeys(per_row, float(b))
        rho = self.prompt_per_output()
        n = b + max(0, others)
        if self.max_rows:
            n = min(n, self.max_rows)

        def bound(name: str) -> float:
            width = 1 if name == "off" else self.widths[name]
            return min(float(n), self.token_budget / (width + rho * per_row[name]))

        here = bound(current)
        return {name: b * bound(name) / here for name in per_row}


def _group(kind: str) -> str:
    """The kinds of mixed step whose profiled priors one measured step corrects together:
    the speculative modes (each a cycle beside the chunks), apart from plain and folded
    steps."""
    return kind if kind in ("off", "fold") else SPEC


def _extra_cap(step: float, chunk_tokens: int | None) -> float:
    """The most a mixed step's extra counts (an outlier's weight): 4 decode steps, and
    with its chunk tokens known 4 more per 256 of them (the extra grows with them: a cap
    that did not would bend the fitted line)."""
    return 4.0 * step * (1.0 + (chunk_tokens or 0) / 256)


def _interpolate(row: list[tuple[int, float]], batch: int) -> float:
    """Seconds at `batch` from sorted (batch, seconds) points: linear between them, linear
    extrapolation past the last two."""
    if batch <= row[0][0]:
        return row[0][1]
    for (b0, t0), (b1, t1) in zip(row, row[1:]):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    if len(row) == 1:
        return row[0][1] * batch / row[0][0]
    (b0, t0), (b1, t1) = row[-2], row[-1]
    return t1 + (t1 - t0) * (batch - b1) / (b1 - b0)
