"""Per-request acceptance estimates of the adaptive speculation policy (engine/spec_policy.py):
decayed counts per request and drafter family, shrunk toward global estimates (torch-free).
Each family's per-request counts are rows of numpy tables, updated and read for a whole batch
at once: at 256 decoding requests, per-request Python loops cost ~0.35-0.45 ms of host time a
step on a 2-core CPU box (~2% of an 8B step at that batch)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

GLOBAL_STEP_DECAY = 0.9  # the global counts remember at least ~10 steps, whatever the batch


class _Table:
    """One family's per-request counts: [hits per depth, trials per depth] a request (counts
    [rows, 2, depth]), rows reused after a request is forgotten."""

    def __init__(self, depth: int) -> None:
        self.index: dict[str, int] = {}
        self.counts = np.zeros((16, 2, depth))
        self.free: list[int] = []

    def rows(self, ids: Sequence[str], new: list[str]) -> np.ndarray:
        """The rows of `ids`, zero rows made for the ones not seen yet (appended to `new`)."""
        index = self.index
        out = np.empty(len(ids), dtype=np.int64)
        for i, rid in enumerate(ids):
            row = index.get(rid)
            if row is None:
                new.append(rid)
                if not self.free:
                    n = len(self.counts)
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                    self.free = list(range(2 * n - 1, n - 1, -1))
                row = index[rid] = self.free.pop()
                self.counts[row] = 0.0
            out[i] = row
        return out

    def pop(self, rid: str) -> list[list[float]] | None:
        """The request's [hits, trials] per depth, its row freed (None: it had none)."""
        row = self.index.pop(rid, None)
        if row is None:
            return None
        self.free.append(row)
        return self.counts[row].tolist()


class AcceptanceEstimates:
    """Per request and per draft family (the mode's drafter and topk), the conditional
    acceptance at each depth d: P(depth d accepted | depth d - 1 was), from decayed counts of
    the request's own cycles, shrunk toward the family's global estimate (new requests start
    there). A family is (method, topk); `method` "" is the primary drafter."""

    def __init__(self, max_depth: int, decay: float = 0.9, prior: float = 0.6,
                 prior_weight: float = 4.0) -> None:
        self.max_depth = max_depth
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        # a cycle's counts by (depths hit, depths tried): 1 at each depth below each
        at = np.arange(max_depth)
        below = (at[None, :] < np.arange(max_depth + 1)[:, None]).astype(np.float64)
        self._step_counts = np.stack(np.broadcast_arrays(below[:, None], below[None, :]), 2)
        # family (topk | (method, topk); the primary drafter's is its bare topk) -> the
        # requests' counts; and the global counts ([hits per depth], [trials per depth])
        self._tables: dict[object, _Table] = {}
        self._global_counts: dict[object, tuple[list[float], list[float]]] = {}
        self._families_of: dict[str, set] = {}  # request id -> the families it has counts in
        # family -> ([sum of finished requests' own rates], [their weight]) per depth, each
        # request once (decayed per request): the prior of a new request. The cycle counts
        # weight requests by their cycles, so they lean toward the slow, low-acceptance
        # requests that a batch keeps longest (all of them, in a run's tail).
        self._finished: dict[object, tuple[list[float], list[float]]] = {}

    def tracks(self, request_id: str) -> bool:
        """Whether the request has counts of its own (forget() drops them)."""
        return request_id in self._families_of

    @staticmethod
    def family(topk: int, method: str = "") -> object:
        return (method, topk) if method else topk

    def observe(self, request_id: str, topk: int, depth: int, accepted: int,
                method: str = "") -> None:
        """One cycle of a mode of this drafter, topk and depth that accepted `accepted`
        drafts."""
        self.observe_step({request_id: accepted}, topk, depth, method)

    def observe_step(self, accepted: dict[str, int], topk: int, depth: int,
                     method: str = "", chain_runs: dict[str, int] | None = None) -> None:
        """One step's cycles (request id -> drafts accepted) of one mode: each request's own
        counts as observe() does; the global counts once, decayed by 0.99 per cycle but by no
        less than GLOBAL_STEP_DECAY a step (at 256 rows 0.99 a cycle would keep ~2 steps).
        chain_runs (a tree mode's step: request id -> 2 r + o, speculative/verify.chain_runs):
        the same drafter's chains learn from it too, r accepted and then, unless o, a
        rejection (a tree-only run would otherwise teach its chains nothing)."""
        self._observe(accepted, self.family(topk, method), depth, ())
        if chain_runs and topk > 1:
            self._observe({rid: r >> 1 for rid, r in chain_runs.items()},
                          self.family(1, method), depth,
                          {rid for rid, r in chain_runs.items() if r & 1})

    def _observe(self, accepted: dict[str, int], fam: object, depth: int,
                 untested: Collection[str]) -> None:
        """observe_step for one family; a request in `untested` had its next depth untried:
        each request's counts fade (every depth, tried or not) and gain a trial at each depth
        tried (the first min(m + 1, depth) for m accepted, m without the next depth tried)
        and a hit at each accepted one."""
        if not accepted:
            return
        ids = list(accepted)
        m = np.fromiter(accepted.values(), dtype=np.int64, count=len(ids))
        if untested:
            m_next = m + 1 - np.fromiter((rid in untested for rid in ids), dtype=np.int64,
                                         count=len(ids))
        else:
            m_next = m + 1
        n = np.minimum(m_next, depth)
        step = self._step_counts[np.minimum(m, n), n]  # [rows, 2, depth]: hits, trials
        table = self._tables.get(fam)
        if table is None:
            table = self._tables[fam] = _Table(self.max_depth)
        new: list[str] = []
        rows = table.rows(ids, new)
        table.counts[rows] = table.counts[rows] * self.decay + step
        for rid in new:
            self._families_of.setdefault(rid, set()).add(fam)
        hits, trials = self._global_counts.setdefault(
            fam, ([0.0] * self.max_depth, [0.0] * self.max_depth))
        decay = max(0.99 ** len(ids), GLOBAL_STEP_DECAY)
        new_hits, new_trials = step.sum(axis=0).tolist()
        for d in range(self.max_depth):
            hits[d] = hits[d] * decay + new_hits[d]
            trials[d] = trials[d] * decay + new_trials[d]

    def rates(self, request_id: str, topk: int, method: str = "") -> list[float]:
        """Estimated conditional acceptance at depths 1 .. max_depth."""
        base = self._global(topk, method)
        table = self._tables.get(self.family(topk, method))
        row = None if table is None else table.index.get(request_id)
        if row is None:
            return base
        w = self.prior_weight
        return [(h + w * g) / (t + w)
                for h, t, g in zip(*table.counts[row].tolist(), base)]

    def totals(self, request_ids: Sequence[str], topk: int, method: str = "") -> list[float]:
        """Expected tokens of one cycle summed over the requests, at every depth 0 .. max
        (depth i: 1 + sum over j <= i of prod_{l <= j} a_l, per request; rates())."""
        n = len(request_ids)
        base = self._global(topk, method)
        run = 1.0
        at_base = [1.0]  # a request at the global rates: its expected tokens at each depth
        for a in base:
            run *= a
            at_base.append(at_base[-1] + run)
        table = self._tables.get(self.family(topk, method))
        if table is None or not table.index or not n:
            return [n * t for t in at_base]
        index = table.index
        rows = np.fromiter((index.get(rid, -1) for rid in request_ids), dtype=np.int64, count=n)
        rows = rows[rows >= 0]
        if not len(rows):
            return [n * t for t in at_base]
        w = self.prior_weight
        g = np.asarray(base)
        own = np.cumprod((table.counts[rows, 0] + w * g) / (table.counts[rows, 1] + w), axis=1)
        others = n - len(rows)
        return [n, *(others * np.asarray(at_base[1:]) + len(rows)
                     + np.cumsum(own, axis=1).sum(axis=0)).tolist()]

    def _global(self, topk: int, method: str = "") -> list[float]:
        """The family's global rates, shrunk toward the same drafter's chains (topk 1) while
        it has few counts of its own (a tree family probed once must not jump to the prior),
        and those toward `prior`."""
        chain = self._global_counts.get(self.family(1, method))
        w = self.prior_weight
        base = [self.prior] * self.max_depth
        if chain is not None:  # each depth shrunk toward the one above it (the first: prior)
            above = self.prior
            for d, (h, t) in enumerate(zip(*chain)):
                base[d] = above = (h + w * above) / (t + w)
        base = self._per_request(self.family(1, method), base)
        row = self._global_counts.get(self.family(topk, method))
        if topk == 1:
            return base
        # optimistic toward a tree: each of its topk candidates as likely as the chain's one
        # (an upper bound; the tree's own counts correct it), so a tree is tried early
        base = [1.0 - (1.0 - g) ** topk for g in base]
        if row is not None:
            base = [(h + w * g) / (t + w) for h, t, g in zip(*row, base)]
        return self._per_request(self.family(topk, method), base)

    def _per_request(self, fam: object, base: list[float]) -> list[float]:
        """`base` moved toward the mean of finished requests' own rates (each request once;
        two requests' worth of weight stay with base, two with `prior`: requests differ, and
        a few slow ones finished must not set every new request's start, or a policy that
        turned off would learn nothing more and stay off)."""
        done = self._finished.get(fam)
        if done is None:
            return base
        p = self.prior
        return [(s + 2.0 * g + 2.0 * p) / (n + 4.0) for s, n, g in zip(*done, base)]

    def expected_tokens(self, request_id: str, topk: int, depth: int,
                        method: str = "") -> float:
        """Tokens one cycle emits: 1 + sum over i <= depth of prod_{j <= i} a_j."""
        return self.totals([request_id], topk, method)[depth]

    def forget(self, request_id: str) -> None:
        """A request finished (or was aborted): its own rates join the per-request means of
        their families (at the depths it tried at least once), its counts go."""
        for fam in self._families_of.pop(request_id, ()):
            counts = self._tables[fam].pop(request_id)
            if counts is None:
                continue
            hits, trials = counts
            sums, weights = self._finished.setdefault(
                fam, ([0.0] * self.max_depth, [0.0] * self.max_depth))
            for d in range(self.max_depth):  # every depth fades; the tried ones add
                sums[d] *= 0.97
                weights[d] *= 0.97
                if trials[d] >= 1.0:
                    sums[d] += hits[d] / trials[d]
                    weights[d] += 1.0
