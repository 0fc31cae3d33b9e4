"""When to speculate: a policy decides before each step is scheduled (torch-free).

The decision reaches the workers in StepInput.speculate; with it off, a step is the plain
step (decode graphs, no draft forward) and the scheduler reserves no lookahead for it. The
speculative worker catches the proposer up when speculation comes back (speculative/worker.py).
"""

from __future__ import annotations

from specserve.engine.acceptance import AcceptanceEstimates
from specserve.engine.chunk_cost import ChunkCost
from specserve.engine.fixed_policy import ScriptedPolicy, SpecPolicy, StaticPolicy
from specserve.engine.goodput import GoodputModel, _extra_cap, _interpolate

__all__ = ["AcceptanceEstimates", "AdaptivePolicy", "ScriptedPolicy", "SpecPolicy",
           "StaticPolicy"]


class AdaptivePolicy(GoodputModel):
    """Per step, the mode of highest expected tokens per second (None: off):

        goodput(mode) = sum_r E_r(mode) / T(mode, B)        goodput(off) = B / T(off, B)

    over the B requests about to decode (each mode at the batch the step's token budget lets it
    hold beside the prefill its tokens bring: GoodputModel.batches), E_r from
    AcceptanceEstimates, T from the start-up cost table (speculative/profile.py) interpolated in
    B and rescaled per mode by the ratio of measured to tabled step times of pure decode steps
    (decayed, each ratio clipped to [1/4, 4]: a host-bound model's steps run 2-3x its
    graph replays alone), plus, weighted by the share of steps that also
    carry prefill chunks, the extra time such steps take in that mode (learnt: a speculative
    step runs the chunks in its verify forward, or, a tree's on an MLA target, as a forward of
    their own; a plain step in its one forward). A speculative mode's step that carries chunks
    may also fold: its decodes run one token each in the chunks' forward, feeding the drafter
    (no catch-up after), at the plain step's time plus a learnt extra; fold() picks the better
    of the two per such step, and a mode's score counts its mixed steps at that better rate.

    A switch costs: the step launched ahead for the old mode is discarded, and a proposer coming
    back from off catches up over the tokens made meanwhile (a target forward over every
    position the decoding requests' drafter state lacks, prompts prefilled while off included:
    the engine counts them, `behind`). The policy learns that cost per kind of switch (on, off,
    between modes) from the steps that switched, in step times of the new mode, the catch-up
    apart as seconds per position behind, and keeps those steps out of the rescaling: coming
    back on after a long stretch off at a large batch costs tens of steps, which the gain must
    pay for, and so must a probe from off. It switches when the gain exceeds `hysteresis`,
    `dwell` steps passed since the last switch (or the gain exceeds `leap`, or the decode batch
    has halved or doubled since that switch: a load that changes fast must not wait out the
    dwell mode by mode), and the gain over `horizon` steps pays for the switch. Acceptance is
    learnt by running a mode (a tree's cycles also teach its drafter's chains,
    verify.chain_runs, which are then not probed while it runs): every `explore_every` steps at
    most, one step of a drafter family (method, topk) not run for that long is tried (a family
    never run: once the first dwell passed, so that a tree whose acceptance beats the chains' is
    seen early), and no more often than its two switches' learnt cost spends `probe_budget` of
    the steps (4x rarer when it scores below `probe_margin` of the current mode). The
    granularity is the step: one mode for every speculating row, because the verify width of a
    captured graph is fixed, so excluding rows would save their drafting but not their verify
    slots.
    """

    needs_batch = True

    def __init__(self, modes: dict[str, tuple], costs: dict[str, dict[int, float]],
                 hysteresis: float = 0.05, dwell: int = 8, explore_every: int = 128,
                 rescale: float = 0.1, horizon: int = 64, probe_margin: float = 0.25,
                 probe_budget: float = 0.005, leap: float = 0.25, score_every: int = 4,
                 off_score_every: int | None = None,
                 widths: dict[str, int] | None = None, token_budget: int | None = None,
                 max_rows: int | None = None,
                 mixed_priors: dict[str, dict[int, float]] | None = None) -> None:
        """modes: {name: (topk, num_steps)} or {name: (method, topk, num_steps)} (several
        drafters: acceptance is learnt per method); costs: {mode or "off": {batch: seconds}};
        rescale, widths, token_budget, max_rows, mixed_priors: see GoodputModel (widths
        default to a chain's, steps + 1)."""
        # name -> (acceptance family's method, topk, steps); the first mode's method is ""
        first = next(iter(modes.values()))
        primary = first[0] if len(first) == 3 else ""
        self.modes = {name: ("", *m) if len(m) == 2 else ("" if m[0] == primary else m[0],
                                                          *m[1:])
                      for name, m in modes.items()}
        widths = {name: (widths or {}).get(name, m[2] + 1) for name, m in self.modes.items()}
        super().__init__(costs, rescale, widths, token_budget, max_rows, mixed_priors)
        self.hysteresis, self.dwell, self.explore_every = hysteresis, dwell, explore_every
        self.horizon, self.probe_margin = horizon, probe_margin
        self.probe_budget, self.leap, self.score_every = probe_budget, leap, score_every
        self.off_score_every = 4 * score_every if off_score_every is None else off_score_every
        self.acceptance = AcceptanceEstimates(max(m[2] for m in self.modes.values()))
        # extra time of a step that switched, in step times of its mode (priors: the
        # discarded launch ahead; a catch-up forward on the way back on)
        self.switch_steps = {"on": 2.0, "off": 1.0, "mode": 1.0}
        # coming back on, the catch-up's seconds per position the drafters are behind: a
        # line (fixed + per position) fitted to the steps that switched on (before any, the
        # prefill's cost per chunk token)
        self.catch_up_line = ChunkCost()
        self.catch_up_per_token: float | None = None
        self.behind = 0  # positions behind at the last choose() (its step catches them up)
        self.current: str | None = next(iter(modes))
        self.since_switch = dwell  # the first decision needs no dwell: the start is no switch
        self.switch_batch = 0  # the decode batch of the last switch (the dwell's load)
        self.steps = 0
        self.families = {self._family(m) for m in self.modes}
        # step a family last ran (-1: never). The first mode's family counts as never run
        # until a step of it is observed: a policy that leaves it before its first decode
        # step (priors that favour off) must still look at it once the dwell passed, not a
        # probe interval later (rate 0.3, C = 64 on an H100: off for the whole run, while
        # chain1 ran 1.10x plain)
        self.family_run = dict.fromkeys(self.families, -1)
        self.mode_run: dict[str, int] = {}  # step each mode last ran (observed)
        self.tried: set[str] = set()  # modes given a trial dwell (see _trial)
        self.off_tried = -10**9  # step of the last trial dwell off (see _off_trial)
        self.last_scores: dict[str, float] = {}
        self.scored_at, self.scored_ids = -1, []  # the step (and requests) last scored
        self._prev: str | None = None  # the last observed step's mode ("off" for off)
        # a list: every choose() and observe() appends a record (benchmarks' decision traces)
        self.trace: list[dict] | None = None
        self._inputs: dict = {}  # the last scores' inputs (traced)

    def _family(self, mode: str) -> tuple[str, int]:
        method, topk, _ = self.modes[mode]
        return method, topk

    def _totals(self, decoding: list[str], family: tuple[str, int]) -> list[float]:
        """Expected tokens of one cycle summed over the rows, at every depth 0 .. max."""
        method, topk = family
        return self.acceptance.totals(decoding, topk, method)

    def fold(self, mode: str, decoding: list[str]) -> bool:
        tokens = self._totals(decoding, self._family(mode))[self.modes[mode][2]]
        # one step's choice: its extra tokens against the rate of the other steps
        return self.goodput(mode, tokens, len(decoding), max(self.mixed_share, 1e-3))[1]

    def scores(self, decoding: list[str], others: int = 0) -> dict[str, float]:
        """Expected tokens per second of every mode ("off" included) for this batch, each
        at the decode batch it would hold (GoodputModel.batches; others: requests
        prefilling or waiting)."""
        b = len(decoding)
        per_row = {"off": 1.0}
        for family in self.families:  # summed expected tokens at every depth, per family
            totals = self._totals(decoding, family)
            for name, (m, k, steps) in self.modes.items():
                if (m, k) == family:
                    per_row[name] = totals[steps] / b
        key = "off" if self.current is None else self.current
        rows = self.batches(per_row, b, others, key)
        if self.trace is not None:  # the inputs of the scores: tokens a row, rows, shares
            rho = self.prompt_per_output()
            self._inputs = {
                "E": {m: round(e, 3) for m, e in per_row.items()},
                "rows": {m: round(r, 1) for m, r in rows.items()},
                "share": {m: round(self.share_of(m, per_row[m] * rows[m], rho), 3)
                          for m in per_row if self.chunk_cost.mean_tokens},
                "line_ms": {k: (round(ln[0] * 1e3, 2), round(ln[1] * 1e6, 1))
                            for k in per_row for ln in [self.mixed_line(k)]},
                "scale": {m: round(self.scale_of(m), 3) for m in self.scale}}
        return {name: self.goodput(name, per_row[name] * rows[name], rows[name],
                                   self.mixed_share)[0] for name in per_row}

    def ran_lately(self, name: str) -> bool:
        """A mode ran within the last `horizon` steps (GoodputModel.ran_lately)."""
        return self.steps - self.mode_run.get(name, -10**9) <= self.horizon

    def _kind(self, old: str, new: str) -> str:
        """A switch's kind: "on" (off -> a mode), "off" (a mode -> off) or "mode"."""
        return "on" if old == "off" else "off" if new == "off" else "mode"

    def _per_token(self) -> float:
        if self.catch_up_per_token is not None:
            return self.catch_up_per_token
        return self._prefill_slope()

    def _prefill_slope(self) -> float:
        """Seconds a chunk token adds to a plain step (pooled over kinds until plain steps
        with chunks were seen): a catch-up's cost a position before any was measured, and the
        prior its fitted line shrinks toward (a few switches at similar positions behind
        cannot tell the fixed part from the slope)."""
        line = self.chunk_cost.line("off")
        return line[1] if line is not None else self.chunk_cost.pooled_slope() or 0.0

    def switch_cost(self, old: str, new: str, b: int) -> float:
        """A switch's cost in steps of the new mode: what switches of its kind cost beyond
        their step (learnt), and coming back on, the catch-up over the positions the
        drafters are behind (a target forward over them: after a long stretch off at a
        large batch, tens of steps; H100, 8B, 128 rows: 19k positions, ~20 us each)."""
        kind = self._kind(old, new)
        cost = self.switch_steps[kind]
        if kind == "on" and self.behind:
            cost += self._per_token() * self.behind / self.step_time(new, max(b, 1))
        return cost

    def _pays(self, key: str, best: str, scores: dict[str, float], b: int) -> bool:
        """The gain beats the hysteresis, and over `horizon` steps covers the switch."""
        gain, now = scores[best], scores[key]
        if gain <= (1.0 + self.hysteresis) * now:
            return False
        return self.horizon * (gain - now) >= self.switch_cost(key, best, b) * gain

    def _probe(self, scores: dict[str, float], key: str, b: int) -> str | None:
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
            cost = self.switch_cost(key, mode, b) + self.switch_cost(mode, key, b)
            every = max(self.explore_every, cost / self.probe_budget)
            if self.family_run[fam] < 0:  # never run: one look once `dwell` steps passed
                every = self.dwell + 1
            elif scores[mode] < (1.0 - self.probe_margin) * scores[key]:
                every *= 4
            if self.steps - self.family_run[fam] >= every \
                    and (best is None or scores[mode] > best[0]):
                best = scores[mode], mode
        return None if best is None else best[1]

    def _trial(self, scores: dict[str, float], key: str) -> str | None:
        """A speculative mode worth a dwell of its own: one whose pure steps were never
        measured (its step time is the start-up table's times a borrowed ratio), scoring
        within `probe_margin` of the current mode, given one trial in the policy's life, and
        only where the modes measured so far ran off their table by ratios more than
        `probe_margin` apart (else the borrowed ratio is a fair guess: on the 8B shape every
        ratio is 1.0-1.05). A probe's one step is a switch, which teaches the switch cost,
        not the mode's step time: a mode whose table overstates it (the bundled pair at C=1
        on an H100: chain 3 ran 0.6 ms a step against its table's 0.8, the tree 0.8 against
        0.9) would never run, while the tree it trailed ran at 0.80x of it."""
        seen = [self.scale[m] for m in self.scaled]
        if len(seen) < 2 or max(seen) < (1.0 + self.probe_margin) * min(seen):
            return None  # the table's error the same for every mode seen: a fair guess
        fresh = [m for m in self.modes if m != key and m not in self.scaled
                 and m not in self.tried and scores[m] >= (1.0 - self.probe_margin) * scores[key]]
        return max(fresh, key=scores.get) if fresh else None

    def _off_trial(self, scores: dict[str, float], key: str, b: int) -> bool:
        """A dwell off where off's score rests on mixed steps of another load: off not run
        within `horizon` steps, its share of mixed steps read at 0.3 or more (b rows), its
        score within half of `probe_margin` of the current mode, at most once every 4
        horizons. Plain steps' prompts arrive in waves (rows finish together) and, after a
        decode launched ahead, wait a step and join the next: their chunks grow with the
        load, and a mean chunk measured at a light load prices most plain steps as mixed at
        a heavy one (the bundled pair's model engine at C = 128: off read a share of 1.0 and
        scored 0.93x the tree, where 0.28 of its steps were mixed, 4 prompts a chunk, and it
        ran 1.33x the tree; the policy stayed on the tree). One dwell, its stale mean chunk
        forgotten first (_choose), measures them at this load. The gate: the fitted models
        of the pair and the 8B sweeps (scripts/simulate_spec_policy.py, 5 seeds x 3 runs)
        gained with 0.3 (pair C = 64 / 128: 0.91 / 0.79 -> 0.99 / 1.0; 8B rate 0.3 C = 32:
        0.92 -> 0.97) and lost nowhere; at 0.6 the pair's C = 64 kept 0.91."""
        if key == "off" or self.ran_lately("off") or not self.chunk_cost.mean_tokens:
            return False
        if self.steps - self.off_tried < 4 * self.horizon:
            return False
        if self.share_of("off", float(b), self.prompt_per_output()) < 0.3:
            return False
        return scores["off"] >= (1.0 - self.probe_margin / 2) * scores[key]

    def choose(self, decoding: list[str], others: int = 0, behind: int = 0) -> str | None:
        mode = self._choose(decoding, others, behind)
        if self.trace is not None:
            rec = {"step": self.steps, "b": len(decoding), "others": others,
                   "behind": behind, "mode": mode or "off"}
            if self.scored_at == self.steps:  # scored this step
                rec["scores"] = {m: round(v, 1) for m, v in self.last_scores.items()}
                rec["rho"] = round(self.prompt_per_output(), 3)
                rec.update(self._inputs)
                key = "off" if self.current is None else self.current
                best = max(self.last_scores, key=self.last_scores.get)
                if best != key:
                    rec["switch_cost"] = round(self.switch_cost(key, best, len(decoding)), 2)
            self.trace.append(rec)
        return mode

    def _due(self, decoding: list[str]) -> bool:
        """Whether this step rescores the modes. Scoring costs 60-160 us on the host (more
        with a trace), which a small model's step shows in full (the bundled pair on an H100:
        plain steps 0.67 ms of GPU; scored on 42% of its off steps, they took 1.12 ms where
        the engine forced off took 0.8). So: every `score_every` steps while a mode
        speculates (each cycle moves the acceptance estimates), every `off_score_every`
        (default 4x that) while off (nothing but the step times and the prefill load move
        them); sooner where the batch changed (up to 8 rows: any other request, past that by
        more than an eighth) outside the dwell of a steady load; for a probe that may be due,
        no more often than every `score_every` steps (a family never run: at once)."""
        since = self.steps - self.scored_at
        every = self.off_score_every if self.current is None else self.score_every
        if since >= every:
            return True
        sw = self.switch_steps
        soonest = max(self.explore_every, min(2 * sw["mode"], sw["on"] + sw["off"])
                      / self.probe_budget)  # the shortest interval _probe allows
        run = self.family_run.values()
        if any(t < 0 for t in run) and self.steps >= self.dwell:
            return True  # a family never run: its one look is due (it sets the family's step)
        if since >= self.score_every and any(self.steps - t >= soonest for t in run):
            return True
        b, b0 = len(decoding), self.switch_batch
        if self.since_switch < self.dwell and b0 <= 2 * b <= 4 * b0:
            return False  # the dwell of a steady load: only a leap could switch
        n = len(self.scored_ids)
        if b <= 8 or n <= 8:
            return decoding != self.scored_ids
        return abs(b - n) > n // 8

    def _choose(self, decoding: list[str], others: int = 0, behind: int = 0) -> str | None:
        self.behind = behind
        self.steps += 1
        self.since_switch += 1
        if not decoding:
            return self.current
        if not self._due(decoding):
            return self.current
        b, b0 = len(decoding), self.switch_batch
        steady = b0 <= 2 * b <= 4 * b0  # the load neither halved nor doubled since the switch
        scores = self.last_scores = self.scores(decoding, others)
        self.scored_at, self.scored_ids = self.steps, list(decoding)
        key = "off" if self.current is None else self.current
        probe = self._probe(scores, key, len(decoding))
        if probe is not None:  # one step of it; the current mode stays
            self.family_run[self._family(probe)] = self.steps
            return probe
        best = max(scores, key=scores.get)
        settled = (self.since_switch >= self.dwell or not steady
                   or scores[best] > (1.0 + self.leap) * scores[key])
        if best != key and settled and self._pays(key, best, scores, b):
            self.since_switch, self.switch_batch = 0, b
            self.current = None if best == "off" else best
        elif self.since_switch >= self.dwell and (trial := self._trial(scores, key)):
            self.tried.add(trial)
            self.since_switch, self.switch_batch = 0, b
            self.current = trial
        elif self.since_switch >= self.dwell and self._off_trial(scores, key, b):
            self.off_tried = self.steps
            self.chunk_cost.forget_chunks("off")  # the dwell's own steps measure them anew
            self.since_switch, self.switch_batch = 0, b
            self.current = None
        return self.current

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None, chain_runs: dict | None = None) -> None:
        if self.trace is not None:
            self.trace.append({"observed": "fold" if folded else mode or "off", "b": batch,
                               "ms": None if seconds is None else round(seconds * 1e3, 3),
                               "mixed": mixed, "chunk": chunk_tokens,
                               "accepted": sum(accepted.values())})
        if folded:  # no cycle ran and no switch: the fold's time over the plain step's
            if chunk_tokens is not None:
                self.count_tokens(chunk_tokens, batch)
            if seconds is not None and batch:
                self.mixed_share += 0.05 * (1.0 - self.mixed_share)
                extra = min(_extra_cap(_interpolate(self.costs["off"], batch), chunk_tokens),
                            max(0.0, seconds - self.step_time(None, batch)))
                self.learn_mixed("fold", extra, chunk_tokens, batch)
            return
        key = "off" if mode is None else mode
        prev, self._prev = self._prev, key
        self.mode_run[key] = self.steps
        if mode is not None:
            method, topk, steps = self.modes[mode]
            # a tree's chain runs keep its chains' acceptance fresh: no probe needed for it
            for fam in {(method, topk), (method, 1 if chain_runs else topk)} & self.families:
                self.family_run[fam] = self.steps
            self.acceptance.observe_step(accepted, topk, steps, method, chain_runs)
        if chunk_tokens is not None:
            self.count_tokens(chunk_tokens, batch + sum(accepted.values()))
        if seconds is None or not batch:
            return
        self.mixed_share += 0.05 * (float(mixed) - self.mixed_share)
        tabled = _interpolate(self.costs[key], batch)
        if prev is not None and prev != key:  # a switch: its extra time, not the mode's
            kind = self._kind(prev, key)
            t = self.step_time(mode, batch) + (self.mixed_extra[key] if mixed else 0.0)
            # at most 4x what the switch was expected to cost: a one-off (a compile) must not
            # price every later switch (H200, the bundled pair: one 558 ms step, off after)
            cap = 4.0 * (1.0 + self.switch_cost(prev, key, batch))
            extra = max(0.0, min(seconds / t, cap) - 1.0)
            if kind == "on":  # the catch-up's share: per position behind, from the fitted line
                self.catch_up_line.observe("on", self.behind, extra * t)
                self.catch_up_per_token = self.catch_up_line.line("on", self._prefill_slope())[1]
                extra = max(0.0, extra - self.catch_up_per_token * self.behind / t)
            self.switch_steps[kind] += 0.2 * (extra - self.switch_steps[kind])
            return
        if mixed:  # the prefill chunks' time on top of the decode step (clipped: _extra_cap)
            extra = min(_extra_cap(tabled, chunk_tokens),
                        max(0.0, seconds - self.step_time(mode, batch)))
            self.learn_mixed(key, extra, chunk_tokens, batch)
            return
        # clipped to [1/4, 4]: an outlier (a compile) moves the scale little, but a host-bound
        # model's steps may take 3x the table's replays alone (H100, the bundled pair: off
        # 1.1 ms against 0.42, chain 3 2.2 against 0.97; clipped at 2x, off looked the faster)
        self.learn_scale(key, min(4.0, max(0.25, seconds / tabled)))

    def forget(self, request_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.acceptance.forget(request_id)
        self.finished(prompt_tokens, output_tokens)
