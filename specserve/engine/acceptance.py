"""Per-request acceptance estimates of the adaptive speculation policy (engine/spec_policy.py):
decayed counts per request and drafter family, shrunk toward global estimates (torch-free)."""

from __future__ import annotations

from collections.abc import Collection

GLOBAL_STEP_DECAY = 0.9  # the global counts remember at least ~10 steps, whatever the batch


class AcceptanceEstimates:
    """Per request and per draft family (the mode's drafter and topk), the conditional
    acceptance at each depth d: P(depth d accepted | depth d - 1 was), from decayed counts of
    the request's own cycles, shrunk toward the family's global estimate (new requests start
    there). A family is (method, topk); `method` "" is the primary drafter."""

    def __init__(self, max_depth: int, decay: float = 0.9, prior: float = 0.6,
                 prior_weight: float = 4.0) -> None:
        self.max_depth = max_depth
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        # (request id | None for global, topk | (method, topk)) -> ([hits per depth],
        # [trials per depth]); the primary drafter's family is its bare topk
        self._counts: dict[tuple[str | None, object], tuple[list[float], list[float]]] = {}
        # family -> ([sum of finished requests' own rates], [their weight]) per depth, each
        # request once (decayed per request): the prior of a new request. The cycle counts
        # weight requests by their cycles, so they lean toward the slow, low-acceptance
        # requests that a batch keeps longest (all of them, in a run's tail).
        self._finished: dict[object, tuple[list[float], list[float]]] = {}

    def _row(self, key: tuple[str | None, object]) -> tuple[list[float], list[float]]:
        row = self._counts.get(key)
        if row is None:
            row = self._counts[key] = ([0.0] * self.max_depth, [0.0] * self.max_depth)
        return row

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
        """observe_step for one family; a request in `untested` had its next depth untried."""
        tried, hit = [0.0] * depth, [0.0] * depth
        for request_id, m in accepted.items():
            hits, trials = self._row((request_id, fam))
            for d in range(self.max_depth):  # depths this mode did not try fade too
                hits[d] *= self.decay
                trials[d] *= self.decay
            for d in range(min(m + (request_id not in untested), depth)):  # d + 1 was tried
                trials[d] += 1.0
                tried[d] += 1.0
                if d < m:
                    hits[d] += 1.0
                    hit[d] += 1.0
        if accepted:
            hits, trials = self._row((None, fam))
            decay = max(0.99 ** len(accepted), GLOBAL_STEP_DECAY)
            for d in range(self.max_depth):
                hits[d] *= decay
                trials[d] *= decay
            for d in range(depth):
                hits[d] += hit[d]
                trials[d] += tried[d]

    def rates(self, request_id: str, topk: int, method: str = "",
              base: list[float] | None = None) -> list[float]:
        """Estimated conditional acceptance at depths 1 .. max_depth (base: the family's
        global rates, when the caller computed them already)."""
        if base is None:
            base = self._global(topk, method)
        own = self._counts.get((request_id, self.family(topk, method)))
        if own is None:
            return base
        w = self.prior_weight
        return [(h + w * g) / (t + w) for h, t, g in zip(*own, base)]

    def _global(self, topk: int, method: str = "") -> list[float]:
        """The family's global rates, shrunk toward the same drafter's chains (topk 1) while
        it has few counts of its own (a tree family probed once must not jump to the prior),
        and those toward `prior`."""
        chain = self._counts.get((None, self.family(1, method)))
        w = self.prior_weight
        base = [self.prior] * self.max_depth
        if chain is not None:  # each depth shrunk toward the one above it (the first: prior)
            above = self.prior
            for d, (h, t) in enumerate(zip(*chain)):
                base[d] = above = (h + w * above) / (t + w)
        base = self._per_request(self.family(1, method), base)
        row = self._counts.get((None, self.family(topk, method)))
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
        total, run = 1.0, 1.0
        for a in self.rates(request_id, topk, method)[:depth]:
            run *= a
            total += run
        return total

    def forget(self, request_id: str) -> None:
        """A request finished (or was aborted): its own rates join the per-request means of
        their families (at the depths it tried at least once), its counts go."""
        for key in [k for k in self._counts if k[0] == request_id]:
            hits, trials = self._counts.pop(key)
            sums, weights = self._finished.setdefault(
                key[1], ([0.0] * self.max_depth, [0.0] * self.max_depth))
            for d in range(self.max_depth):  # every depth fades; the tried ones add
                sums[d] *= 0.97
                weights[d] *= 0.97
                if trials[d] >= 1.0:
                    sums[d] += hits[d] / trials[d]
                    weights[d] += 1.0
