"""What prefill chunks add to a step, per kind of step, for the adaptive speculation policy
(engine/spec_policy.py; torch-free).

A step that carries prefill chunks takes longer than its decode step by about
a + c x (chunk tokens): a fixed part of the kind (a speculative cycle that runs eagerly, a
fold's drafter feed) and the chunks' own forward work. Kinds differ in how much room they
leave the chunks (a deeper draft reserves more lookahead tokens of the step's budget), so
their raw extras are not comparable: a kind whose mixed steps carry fewer tokens looks
cheaper while it leaves more prefill for later steps. Each kind's line is fitted by
decayed least squares, its slope shrunk toward the slope pooled over every kind; the policy
charges a kind its fixed part per mixed step and its slope per chunk token, the chunk tokens
being a share of the tokens the kind emits (prompt tokens per output token do not depend on
the mode).
"""

from __future__ import annotations

from collections.abc import Callable

RATIO_CLIP = (0.25, 4.0)  # bounds of one step's measured extra over its prior line's


class ChunkCost:
    def __init__(self, decay: float = 0.97, token_scale: float = 64.0,
                 group: Callable[[str], str] | None = None) -> None:
        """decay: weight kept by earlier observations of a kind per new one; token_scale:
        the chunk-size spread one pseudo-observation of the pooled slope stands for; group:
        the kinds whose priors one measured step corrects together (default: each its own).

        Priors (a start-up profile) read a group's kinds alike wrong: the profile times the
        chunk forward and the cycle back to back, where the engine's mixed step also pays the
        host work a launch ahead hides and the step after it that launches nothing. On an
        H100 every speculative mode's mixed steps ran ~1.3x their profiled extra; learnt one
        mode at a time, the policy tried chain3, chain2, the tree and chain1 in turn (~40
        steps of mixed speculative steps at 20-27 ms where plain ran 10-14 ms) before it
        went off (experiments/2026-12-06-plain-prefill-deferral.md). So each measured step of
        a kind that has priors also corrects, by its ratio to its prior line, the priors of
        every kind of its group."""
        self.decay, self.token_scale = decay, token_scale
        self.group = group or (lambda kind: kind)
        self.stats: dict[str, list[float]] = {}  # kind -> [w, w N, w N^2, w y, w N y] measured
        self.pooled = [0.0] * 5
        self.mean_tokens: float | None = None  # chunk tokens of recent mixed steps
        self.chunks: dict[str, list[float]] = {}  # kind -> [w, w N] of its measured steps
        self.priors: dict[str, list[float]] = {}  # kind -> its prior points' sums (undecayed)
        self.prior_left: dict[str, float] = {}  # kind -> the share of its priors' weight left
        self.ratios: dict[str, list[float]] = {}  # group -> [w, w r]: measured / prior extra
        self.group_chunks: dict[str, list[float]] = {}  # group -> [w, w N], decayed per step
        self.full_chunks: dict[str, list[float]] = {}  # kind -> [w, w N] of budget-cut steps

    def prior(self, kind: str, tokens: int, extra: float, weight: float) -> None:
        """A point of the kind's line measured apart (the start-up profile of mixed steps),
        worth `weight` observations, decayed as they are: it shapes the fitted line, not
        the kind's mean chunk (no step carried it); scaled by its group's measured ratio to
        the priors."""
        n = float(tokens)
        point = (weight, weight * n, weight * n * n, weight * extra, weight * n * extra)
        st = self.priors.setdefault(kind, [0.0] * 5)
        self.prior_left[kind] = 1.0
        for acc in (st, self.pooled):
            for i, v in enumerate(point):
                acc[i] += v

    def observe(self, kind: str, tokens: int, extra: float, arrival: bool = True) -> None:
        """A mixed step of `kind` with `tokens` chunk tokens took `extra` seconds more than
        its decode step. arrival: its chunks are what arrived, not a backlog the step's
        budget cut (a load's first wave): only such steps measure the mean chunk, unless
        none does (a budget that prefill fills on every step)."""
        n = float(tokens)
        self.mean_tokens = n if self.mean_tokens is None else \
            self.mean_tokens + 0.1 * (n - self.mean_tokens)
        if not arrival:
            full = self.full_chunks.setdefault(kind, [0.0, 0.0])
            full[0], full[1] = full[0] * self.decay + 1.0, full[1] * self.decay + n
        if kind in self.priors:
            nbar, ybar, slope = self._line(self.priors[kind], 0.0)
            expected = ybar + slope * (n - nbar)
            if expected > 0.0:
                r = min(RATIO_CLIP[1], max(RATIO_CLIP[0], extra / expected))
                acc = self.ratios.setdefault(self.group(kind), [0.0, 0.0])
                acc[0], acc[1] = acc[0] * 0.9 + 1.0, acc[1] * 0.9 + r
            self.prior_left[kind] *= self.decay
        point = (1.0, n, n * n, extra, n * extra)
        g = self.group(kind)
        for k, ch in self.chunks.items():  # a kind's own chunks age with every step of its group
            if arrival and k != kind and self.group(k) == g:
                ch[0], ch[1] = ch[0] * self.decay, ch[1] * self.decay
        if arrival:
            for ch in (self.chunks.setdefault(kind, [0.0, 0.0]),
                       self.group_chunks.setdefault(g, [0.0, 0.0])):
                ch[0], ch[1] = ch[0] * self.decay + 1.0, ch[1] * self.decay + n
        st = self.stats.setdefault(kind, [0.0] * 5)
        for acc in (st, self.pooled):
            for i, v in enumerate(point):
                acc[i] = acc[i] * self.decay + v

    def forget_chunks(self, kind: str) -> None:
        """Drop the mean chunk the kind's (and its group's) steps measured: it stood for another
        load; until its steps carry chunks again, mean_chunk reads the recent steps'."""
        self.chunks.pop(kind, None)
        self.group_chunks.pop(self.group(kind), None)

    def ratio(self, kind: str) -> float:
        """Measured over prior extra of the kind's group (decayed; one pseudo-step at 1)."""
        w, wr = self.ratios.get(self.group(kind), (0.0, 0.0))
        return (wr + 1.0) / (w + 1.0)

    def kinds(self) -> set[str]:
        """Kinds with a line: measured steps or priors."""
        return set(self.stats) | set(self.priors)

    def _points(self, kind: str) -> list[float] | None:
        """The kind's measured points plus its priors (their weight left, scaled by the
        group's ratio); None: neither."""
        st, pr = self.stats.get(kind), self.priors.get(kind)
        if pr is None:
            return st
        m, r = self.prior_left[kind], self.ratio(kind)
        scaled = [m * pr[0], m * pr[1], m * pr[2], m * r * pr[3], m * r * pr[4]]
        return scaled if st is None else [a + b for a, b in zip(st, scaled)]

    def _line(self, st: list[float], slope_prior: float) -> tuple[float, float, float]:
        """(mean N, mean y, slope) of a kind's decayed points, the slope shrunk toward
        slope_prior by one pseudo-observation of spread token_scale; never negative."""
        w, sn, snn, sy, sny = st
        nbar, ybar = sn / w, sy / w
        sxx = max(0.0, snn - w * nbar * nbar)
        sxy = sny - w * nbar * ybar
        lam = self.token_scale ** 2
        return nbar, ybar, max(0.0, (sxy + lam * slope_prior) / (sxx + lam))

    def extra(self, kind: str) -> float | None:
        """The kind's expected extra seconds at the mean chunk size (None: never seen)."""
        st = self._points(kind)
        if st is None or st[0] <= 0.0 or self.mean_tokens is None:
            return None
        pooled = self._line(self.pooled, 0.0)[2]
        nbar, ybar, slope = self._line(st, pooled)
        return max(0.0, ybar + slope * (self.mean_tokens - nbar))

    def mean_chunk(self, kind: str) -> float | None:
        """Chunk tokens a mixed step of the kind carries: its own steps' mean (decayed), while
        they are worth a step (they age with every step of its group); else its group's recent
        steps' (decayed per step of the group); else, where only steps whose budget cut their
        chunks were seen (every step prefill-bound), theirs; else every kind's recent ones.

        Kinds differ: requests that finish together (plain steps, one token each) leave in
        waves and their prompts arrive as one large chunk; a speculative mode's finish apart
        and trickle in one prompt a step. The kind's own mean also keeps its charge per chunk
        token at what its steps measured, however its line splits into fixed part and slope
        (one large chunk and a slope borrowed from the other kinds read as a 14 ms fixed
        part). A speculative mode not run lately takes the run ones' mean, not its old one
        nor every step's: a load's first wave of prompts (2k-token chunks) or an earlier
        load's chunks read a share of mixed steps of 0.3-0.56 where the running mode
        measured 0.9-1 (H100, C = 64)."""
        ch = self.chunks.get(kind)
        if ch is not None and ch[0] >= 1.0:
            return ch[1] / ch[0]
        gc = self.group_chunks.get(self.group(kind))
        if gc is not None and gc[0] > 0.0:
            return gc[1] / gc[0]
        full = self.full_chunks.get(kind)
        if full is not None and full[0] > 0.0:
            return full[1] / full[0]
        return self.mean_tokens

    def pooled_slope(self) -> float | None:
        """Seconds per chunk token pooled over every kind (None: no mixed step seen)."""
        return self._line(self.pooled, 0.0)[2] if self.pooled[0] > 0.0 else None

    def line(self, kind: str, slope_prior: float | None = None) -> tuple[float, float] | None:
        """(fixed seconds, seconds per chunk token) of the kind's extra (None: never seen),
        its slope shrunk toward slope_prior (default: the slope pooled over every kind).
        It passes through the kind's mean point: where the fitted slope would make the
        fixed part negative (a steep slope read off chunks of nearly one size), the line
        through the origin and that point."""
        st = self._points(kind)
        if st is None or st[0] <= 0.0:
            return None
        prior = slope_prior if slope_prior is not None else self.pooled_slope() or 0.0
        nbar, ybar, slope = self._line(st, prior)
        fixed = ybar - slope * nbar
        if fixed < 0.0:
            return 0.0, max(0.0, ybar) / nbar if nbar > 0.0 else 0.0
        return fixed, slope
