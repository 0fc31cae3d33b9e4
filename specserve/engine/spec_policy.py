"""When to speculate: a policy decides before each step is scheduled (torch-free).

The decision reaches the workers in StepInput.speculate; with it off, a step is the plain
step (decode graphs, no draft forward) and the scheduler reserves no lookahead for it. The
speculative worker catches the proposer up when speculation comes back (speculative/worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from specserve.engine.acceptance import AcceptanceEstimates
from specserve.engine.chunk_cost import ChunkCost

__all__ = ["AcceptanceEstimates", "AdaptivePolicy", "ScriptedPolicy", "SpecPolicy",
           "StaticPolicy"]


class SpecPolicy(Protocol):
    needs_batch: bool  # choose() reads the ids of the requests about to decode

    def choose(self, decoding: list[str]) -> str | bool | None:
        """Before scheduling a step: the draft mode it runs (a DraftShape name; True: the
        configured one), None or False: off. decoding: ids of the running requests about to
        decode ([] unless needs_batch)."""
        ...

    def fold(self, mode: str, decoding: list[str]) -> bool:
        """A step of `mode` that carries prefill chunks beside the decodes `decoding`: True
        runs the decodes one token each in the chunks' forward (feeding the drafter) rather
        than a verify forward beside it."""
        ...

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None) -> None:
        """After a step: per speculating request the drafts it accepted; the step's wall time
        (None: not measured) with `batch` decode rows; mixed: prefill chunks ran in it too
        (chunk_tokens of them, when known); folded: fold() said so for it."""
        ...

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted."""
        ...


class _Fixed:
    """A policy that learns nothing."""

    needs_batch = False

    def fold(self, mode: str, decoding: list[str]) -> bool:
        return False

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class StaticPolicy(_Fixed):
    """Speculate on every step with one mode (the configured draft shape)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def choose(self, decoding: list[str]) -> str | None:
        return self.mode


class ScriptedPolicy(_Fixed):
    """A fixed pattern of modes (True: the configured one; None or False: off), repeated
    step after step (switch-cost benchmarks, tests)."""

    def __init__(self, pattern: Sequence[str | bool | None]) -> None:
        if not pattern:
            raise ValueError("the pattern needs at least one step")
        self.pattern = list(pattern)
        self.steps = 0

    def choose(self, decoding: list[str]) -> str | bool | None:
        mode = self.pattern[self.steps % len(self.pattern)]
        self.steps += 1
        return mode


class AdaptivePolicy:
    """Per step, the mode of highest expected tokens per second (None: off):

        goodput(mode) = sum_r E_r(mode) / T(mode, B)        goodput(off) = B / T(off, B)

    over the B requests about to decode, E_r from AcceptanceEstimates, T from the start-up
    cost table (speculative/profile.py) interpolated in B and rescaled per mode by the ratio
    of measured to tabled step times of pure decode steps (decayed, each ratio clipped to
    [1/2, 2]), plus, weighted by the share of steps that also carry prefill chunks, the
    extra time such steps take in that mode (learnt: a speculative step runs the chunks in
    its verify forward, or, a tree's on an MLA target, as a forward of their own; a plain
    step in its one forward). A speculative
    mode's step that carries chunks may also fold: its decodes run one token each in the
    chunks' forward, feeding the drafter (no catch-up after), at the plain step's time plus
    a learnt extra; fold() picks the better of the two per such step, and a mode's score
    counts its mixed steps at that better rate.

    A switch costs: the step launched ahead for the old mode is discarded, and a proposer
    coming back from off catches up over the tokens made meanwhile. The policy learns that
    cost per kind of switch (on, off, between modes) from the steps that switched, in step
    times of the new mode, and keeps those steps out of the rescaling. It switches when the
    gain exceeds `hysteresis`, `dwell` steps passed since the last switch (or the gain
    exceeds `leap`, or the decode batch has halved or doubled since that switch: a load
    that changes fast must not wait out the dwell mode by mode), and
    the gain over `horizon` steps pays for the switch. Acceptance is only learnt by running a mode: every
    `explore_every` steps at most, one step of a drafter family (method, topk) not run for
    that long is tried (a family never run: once the first dwell passed, so that a tree
    whose acceptance beats the chains' is seen early), and no more often than its two switches' learnt cost spends
    `probe_budget` of the steps (4x rarer when it scores below `probe_margin` of the current
    mode). The granularity is the step: one mode for every speculating row, because the
    verify width of a captured graph is fixed, so excluding rows would save their drafting
    but not their verify slots.
    """

    needs_batch = True

    def __init__(self, modes: dict[str, tuple], costs: dict[str, dict[int, float]],
                 hysteresis: float = 0.05, dwell: int = 8, explore_every: int = 128,
                 rescale: float = 0.1, horizon: int = 64, probe_margin: float = 0.25,
                 probe_budget: float = 0.005, leap: float = 0.25) -> None:
        """modes: {name: (topk, num_steps)} or {name: (method, topk, num_steps)} (several
        drafters: acceptance is learnt per method); costs: {mode or "off": {batch: seconds}};
        rescale: weight of each measured step time in a mode's scale (0: the table as is)."""
        # name -> (acceptance family's method, topk, steps); the first mode's method is ""
        first = next(iter(modes.values()))
        primary = first[0] if len(first) == 3 else ""
        self.modes = {name: ("", *m) if len(m) == 2 else ("" if m[0] == primary else m[0],
                                                          *m[1:])
                      for name, m in modes.items()}
        self.costs = {m: sorted(row.items()) for m, row in costs.items()}
        self.hysteresis, self.dwell, self.explore_every = hysteresis, dwell, explore_every
        self.rescale, self.horizon, self.probe_margin = rescale, horizon, probe_margin
        self.probe_budget, self.leap = probe_budget, leap
        self.acceptance = AcceptanceEstimates(max(m[2] for m in self.modes.values()))
        self.scale = dict.fromkeys(costs, 1.0)  # measured / tabled step time, per mode
        # extra time of a step that switched, in step times of its mode (priors: the
        # discarded launch ahead; a catch-up forward on the way back on)
        self.switch_steps = {"on": 2.0, "off": 1.0, "mode": 1.0}
        # steps with prefill chunks: their share (decayed) and, per mode, their extra seconds
        # over the decode step (prior: a speculative step runs the chunks in its verify
        # forward, eagerly: a quarter of a small step; a plain step folds them into its
        # forward)
        self.mixed_share = 0.0
        off_1 = _interpolate(self.costs["off"], 1)
        self.mixed_extra = {m: 0.0 if m == "off" else off_1 / 4 for m in costs}
        self.mixed_extra["fold"] = 0.0  # a folded step over the plain one (the drafter's feed)
        self.mixed_prior = dict(self.mixed_extra)
        # with steps' chunk tokens known: each kind's extra as fixed + per token, and the
        # chunk tokens per emitted token (decayed sums over steps)
        self.chunk_cost = ChunkCost()
        self.chunk_ema = self.emitted_ema = 0.0
        self.current: str | None = next(iter(modes))
        self.since_switch = dwell  # the first decision needs no dwell: the start is no switch
        self.switch_batch = 0  # the decode batch of the last switch (the dwell's load)
        self.steps = 0
        self.families = {self._family(m) for m in self.modes}
        # step a family last ran (-1: never; the first mode's runs from the start)
        self.family_run = dict.fromkeys(self.families, -1)
        self.family_run[self._family(self.current)] = 0
        self.last_scores: dict[str, float] = {}
        self._prev: str | None = None  # the last observed step's mode ("off" for off)

    def _family(self, mode: str) -> tuple[str, int]:
        method, topk, _ = self.modes[mode]
        return method, topk

    def step_time(self, mode: str | None, batch: int) -> float:
        row = self.costs["off" if mode is None else mode]
        return self.scale["off" if mode is None else mode] * _interpolate(row, batch)

    def _totals(self, decoding: list[str], family: tuple[str, int]) -> list[float]:
        """Expected tokens of one cycle summed over the rows, at every depth 0 .. max."""
        est = self.acceptance
        method, topk = family
        totals = [0.0] * (est.max_depth + 1)
        base = est._global(topk, method)
        for rid in decoding:
            run = total = 1.0
            totals[0] += 1.0
            for d, a in enumerate(est.rates(rid, topk, method, base), 1):
                run *= a
                total += run
                totals[d] += total
        return totals

    def _mixed_line(self, kind: str) -> tuple[float, float]:
        """(fixed seconds, seconds per chunk token) of a mixed step of `kind` over its decode
        step: fitted, or for a kind not seen yet its prior fixed part and the pooled slope."""
        line = self.chunk_cost.line(kind)
        if line is not None:
            return line
        return self.mixed_prior[kind], self.chunk_cost.pooled_slope() or 0.0

    def _goodput(self, name: str, tokens: float, b: int, share: float) -> tuple[float, bool]:
        """Tokens per second of mode `name` (`tokens` a cycle for the batch of b; "off":
        b tokens) counting the steps that carry prefill chunks, and whether those steps
        should fold: the choice that maximizes the whole rate (not the mixed step's own: a
        verify beside the chunks may yield more per second than the fold and still cost
        more than its extra tokens are worth at the rate the other steps run).

        With steps' chunk tokens known: the prompt tokens to prefill per emitted token
        (rho) do not depend on the mode, so a mode emitting E tokens a step carries rho E
        of them a step, in a share s = min(1, rho E / mean chunk) of its steps, each paying
        the kind's fixed part, plus its per-token cost on all of them. Else `share` of the
        steps (the recent share of mixed steps) pays the kind's mean extra."""
        t = self.step_time(None if name == "off" else name, b)
        t_off = self.step_time(None, b)
        if self.chunk_cost.mean_tokens and self.emitted_ema > 0.0:
            rho = self.chunk_ema / self.emitted_ema
            s = min(1.0, rho * tokens / self.chunk_cost.mean_tokens)
            a, c = self._mixed_line(name)
            rates = [tokens / (t + s * a + c * rho * tokens)]
            if name != "off":  # its mixed steps folded: b tokens, the plain step's time
                a_f, c_f = self._mixed_line("fold")
                x = (1.0 - s) * tokens + s * b
                rates.append(x / ((1.0 - s) * t + s * (t_off + a_f) + c_f * rho * x))
        else:
            spec = tokens, t + self.mixed_extra[name]
            kinds = [spec] if name == "off" else [
                spec, (float(b), t_off + self.mixed_extra["fold"])]
            rates = [((1.0 - share) * tokens + share * x) / ((1.0 - share) * t + share * y)
                     for x, y in kinds]
        return max(rates), len(rates) > 1 and rates[1] > rates[0]

    def fold(self, mode: str, decoding: list[str]) -> bool:
        tokens = self._totals(decoding, self._family(mode))[self.modes[mode][2]]
        # one step's choice: its extra tokens against the rate of the other steps
        return self._goodput(mode, tokens, len(decoding), max(self.mixed_share, 1e-3))[1]

    def scores(self, decoding: list[str]) -> dict[str, float]:
        """Expected tokens per second of every mode ("off" included) for this batch."""
        b = len(decoding)
        out = {"off": self._goodput("off", float(b), b, self.mixed_share)[0]}
        for family in self.families:  # summed expected tokens at every depth, per family
            totals = self._totals(decoding, family)
            for name, (m, k, steps) in self.modes.items():
                if (m, k) == family:
                    out[name] = self._goodput(name, totals[steps], b, self.mixed_share)[0]
        return out

    def _kind(self, old: str, new: str) -> str:
        """A switch's kind: "on" (off -> a mode), "off" (a mode -> off) or "mode"."""
        return "on" if old == "off" else "off" if new == "off" else "mode"

    def _pays(self, key: str, best: str, scores: dict[str, float]) -> bool:
        """The gain beats the hysteresis, and over `horizon` steps covers the switch."""
        gain, now = scores[best], scores[key]
        if gain <= (1.0 + self.hysteresis) * now:
            return False
        return self.horizon * (gain - now) >= self.switch_steps[self._kind(key, best)] * gain

    def _probe(self, scores: dict[str, float], key: str) -> str | None:
        """The best mode of a stale drafter family worth one step of trial, if any: stale
        once neither `explore_every` steps nor the steps its two switches cost over
        `probe_budget` have passed since the family last ran (4x that when it scores below
        `probe_margin` of the current mode)."""
        here = None if key == "off" else self._family(key)
        best: tuple[float, str] | None = None
        for fam in self.families:
            if fam == here:
                continue
            mode = max((m for m in self.modes if self._family(m) == fam), key=scores.get)
            cost = self.switch_steps[self._kind(key, mode)] + self.switch_steps[
                self._kind(mode, key)]
            every = max(self.explore_every, cost / self.probe_budget)
            if self.family_run[fam] < 0:  # never run: one look once `dwell` steps passed
                every = self.dwell + 1
            elif scores[mode] < (1.0 - self.probe_margin) * scores[key]:
                every *= 4
            if self.steps - self.family_run[fam] >= every \
                    and (best is None or scores[mode] > best[0]):
                best = scores[mode], mode
        return None if best is None else best[1]

    def choose(self, decoding: list[str]) -> str | None:
        self.steps += 1
        self.since_switch += 1
        if not decoding:
            return self.current
        # scoring costs ~3 us a request on the host: while no probe can happen (no family
        # stale for explore_every), done every 4th step only during the dwell (where only a
        # leap may switch) and past 64 rows
        sw = self.switch_steps
        soonest = max(self.explore_every, min(2 * sw["mode"], sw["on"] + sw["off"])
                      / self.probe_budget)  # the shortest interval _probe allows
        stale = any(self.steps - t >= soonest or (t < 0 and self.steps >= self.dwell)
                    for t in self.family_run.values())
        b, b0 = len(decoding), self.switch_batch
        steady = b0 <= 2 * b <= 4 * b0  # the load neither halved nor doubled since the switch
        if not stale and self.steps % 4 and (self.since_switch < self.dwell and steady
                                             or b > 64):
            return self.current
        scores = self.last_scores = self.scores(decoding)
        key = "off" if self.current is None else self.current
        probe = self._probe(scores, key)
        if probe is not None:  # one step of it; the current mode stays
            self.family_run[self._family(probe)] = self.steps
            return probe
        best = max(scores, key=scores.get)
        settled = (self.since_switch >= self.dwell or not steady
                   or scores[best] > (1.0 + self.leap) * scores[key])
        if best != key and settled and self._pays(key, best, scores):
            self.since_switch, self.switch_batch = 0, b
            self.current = None if best == "off" else best
        return self.current

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None) -> None:
        if folded:  # no cycle ran and no switch: the fold's time over the plain step's
            if chunk_tokens is not None:
                self._count_tokens(chunk_tokens, batch)
            if seconds is not None and batch:
                self.mixed_share += 0.05 * (1.0 - self.mixed_share)
                extra = min(_extra_cap(_interpolate(self.costs["off"], batch), chunk_tokens),
                            max(0.0, seconds - self.step_time(None, batch)))
                self._learn_mixed("fold", extra, chunk_tokens)
            return
        key = "off" if mode is None else mode
        prev, self._prev = self._prev, key
        if mode is not None:
            method, topk, steps = self.modes[mode]
            self.family_run[(method, topk)] = self.steps
            self.acceptance.observe_step(accepted, topk, steps, method)
        if chunk_tokens is not None:
            self._count_tokens(chunk_tokens, batch + sum(accepted.values()))
        if seconds is None or not batch:
            return
        self.mixed_share += 0.05 * (float(mixed) - self.mixed_share)
        tabled = _interpolate(self.costs[key], batch)
        if prev is not None and prev != key:  # a switch: its extra time, not the mode's
            kind = self._kind(prev, key)
            extra = max(0.0, seconds / (self.step_time(mode, batch) + (
                self.mixed_extra[key] if mixed else 0.0)) - 1.0)
            self.switch_steps[kind] += 0.2 * (extra - self.switch_steps[kind])
            return
        if mixed:  # the prefill chunks' time on top of the decode step (clipped: _extra_cap)
            extra = min(_extra_cap(tabled, chunk_tokens),
                        max(0.0, seconds - self.step_time(mode, batch)))
            self._learn_mixed(key, extra, chunk_tokens)
            return
        ratio = min(2.0, max(0.5, seconds / tabled))
        self.scale[key] += self.rescale * (ratio - self.scale[key])

    def _count_tokens(self, chunk_tokens: int, emitted: int) -> None:
        """A step's prefill chunk tokens and decode tokens emitted (decayed per step)."""
        self.chunk_ema = 0.98 * self.chunk_ema + chunk_tokens
        self.emitted_ema = 0.98 * self.emitted_ema + emitted

    def _learn_mixed(self, key: str, extra: float, chunk_tokens: int | None) -> None:
        """A mixed step's extra seconds: with its chunk tokens known, every kind's extra is
        re-read from its fitted line at the recent mean chunk size (engine/chunk_cost.py);
        else a decayed mean of the kind's extras."""
        if chunk_tokens is None:
            self.mixed_extra[key] += 0.1 * (extra - self.mixed_extra[key])
            return
        self.chunk_cost.observe(key, chunk_tokens, extra)
        for kind in self.chunk_cost.stats:
            self.mixed_extra[kind] = self.chunk_cost.extra(kind)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)


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
