"""The adaptive policy's acceptance estimates (engine/acceptance.py) against hand-computed
values: per-request and global counts, their decay, the tree family's optimistic start, the
fading of depths a mode does not try, and the prior of a new request."""

from __future__ import annotations

import random

import pytest

from specserve.engine.acceptance import AcceptanceEstimates


def test_acceptance_estimates_follow_the_counts() -> None:
    est = AcceptanceEstimates(max_depth=3, decay=1.0, prior=0.5, prior_weight=2.0)
    assert est.expected_tokens("a", 1, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    for accepted in (3, 1, 0, 3):  # depth 1 tried 4x, hit 3x; depth 2 tried 3x, hit 2x; ...
        est.observe("a", 1, 3, accepted)
    # global counts (decay 0.99), each depth shrunk with weight 2 toward the one above it
    # (the first toward the prior 0.5), then a's own counts on top
    g, above = [], 0.5
    for h, t in zip(*est._global_counts[1]):
        g.append((h + 2.0 * above) / (t + 2.0))
        above = g[-1]
    want = [(3 + 2 * g[0]) / (4 + 2), (2 + 2 * g[1]) / (3 + 2), (2 + 2 * g[2]) / (2 + 2)]
    assert est.rates("a", 1) == pytest.approx(want)
    assert est.rates("new", 1) == pytest.approx(g)  # a new request starts from the global view
    est.forget("a")
    assert not est.tracks("a")


def test_global_acceptance_remembers_steps_not_rows() -> None:
    """At 256 rows a step, 0.99 a cycle alone would keep ~2 steps of the global counts: one
    bad step would erase the rest. The step decay floor keeps ~10 steps at any batch."""
    est = AcceptanceEstimates(max_depth=1, prior=0.5)
    for _ in range(20):  # 20 steps of 256 rows accepting 80%
        est.observe_step({f"r{i}": int(i % 5 != 0) for i in range(256)}, 1, 1)
    est.observe_step({f"r{i}": 0 for i in range(256)}, 1, 1)  # one step accepting nothing
    hits, trials = est._global_counts[1]
    assert 0.65 < hits[0] / trials[0] < 0.75  # (0.9 of ~0.8 + 0.1 of 0): not ~0.1
    one = AcceptanceEstimates(max_depth=1, prior=0.5)  # one row a step: 0.99 a cycle
    for _ in range(50):
        one.observe_step({"a": 1}, 1, 1)
    assert one._global_counts[1][1][0] == pytest.approx((1 - 0.99 ** 50) / (1 - 0.99))


def test_a_tree_family_starts_optimistic_and_learns() -> None:
    """A tree family with no counts of its own: each of its topk candidates as likely as the
    chain's draft (1 - (1 - a)^topk); its own cycles then pull it to what they show."""
    est = AcceptanceEstimates(max_depth=2, decay=1.0, prior=0.5, prior_weight=2.0)
    chain = est._global(1)
    assert est._global(4) == pytest.approx([1 - (1 - a) ** 4 for a in chain])
    for _ in range(200):
        est.observe_step({"r": 0}, 4, 2)  # the tree never accepted
    assert est._global(4)[0] < 0.05


def test_depths_a_shallow_mode_does_not_try_fade_toward_the_tried_ones() -> None:
    """Deep chains once accepted little at depth 2; then only chain1 runs (depth 1 accepted
    80%): the depth-2 estimate must not stay frozen at the old value (a mode that runs one
    depth would keep looking best), it fades toward depth 1's."""
    est = AcceptanceEstimates(max_depth=2, prior=0.5)
    for i in range(30):  # chain2 cycles: depth 1 passes, depth 2 fails
        est.observe(f"a{i}", 1, 2, 1)
        est.forget(f"a{i}")
    assert est._global(1)[1] < 0.2
    for i in range(60):  # chain1 cycles only, 80% accepted, requests finishing
        est.observe_step({f"b{i}-{j}": int(j % 5 != 0) for j in range(8)}, 1, 1)
        for j in range(8):
            est.forget(f"b{i}-{j}")
    d1, d2 = est._global(1)
    assert d1 > 0.65 and d2 > 0.55, (d1, d2)


def test_a_new_request_starts_from_the_mean_of_finished_requests_rates() -> None:
    """Fast requests (rate 0.9, few cycles) and slow ones (0.1, many cycles): the cycle
    counts lean to the slow ones, which a batch keeps longest; a new request's prior is the
    mean over requests, each once. A running request's counts stay out of it."""
    est = AcceptanceEstimates(1, prior=0.5)
    rng = random.Random(0)
    for i in range(40):
        rid, rate, cycles = (f"f{i}", 0.9, 5) if i % 2 else (f"s{i}", 0.1, 50)
        for _ in range(cycles):
            est.observe(rid, 1, 1, int(rng.random() < rate))
        est.forget(rid)
    hits, trials = est._global_counts[1]
    assert hits[0] / trials[0] < 0.25  # the cycle-weighted view
    assert 0.42 < est.rates("new", 1)[0] < 0.58
    before = est.rates("new", 1)
    for _ in range(30):
        est.observe("running", 1, 1, 0)
    assert est.rates("new", 1)[0] >= 0.97 * before[0]  # the cycles moved it, a little


class _LoopEstimates:
    """The per-request counts as plain Python loops, one request at a time (the reference
    for the batched tables): decay every depth of each observed request, a trial at each
    depth tried, a hit at each accepted one; the global counts once a step."""

    def __init__(self, max_depth: int, decay: float) -> None:
        self.max_depth, self.decay = max_depth, decay
        self.counts: dict = {}

    def observe(self, accepted: dict, fam: object, depth: int, untested=()) -> None:
        tried, hit = [0.0] * self.max_depth, [0.0] * self.max_depth
        for rid, m in accepted.items():
            hits, trials = self.counts.setdefault((rid, fam), ([0.0] * self.max_depth,
                                                               [0.0] * self.max_depth))
            for d in range(self.max_depth):
                hits[d] *= self.decay
                trials[d] *= self.decay
            for d in range(min(m + (rid not in untested), depth)):
                trials[d] += 1.0
                tried[d] += 1.0
                if d < m:
                    hits[d] += 1.0
                    hit[d] += 1.0
        if accepted:
            hits, trials = self.counts.setdefault((None, fam), ([0.0] * self.max_depth,
                                                                [0.0] * self.max_depth))
            decay = max(0.99 ** len(accepted), 0.9)
            for d in range(self.max_depth):
                hits[d] = hits[d] * decay + hit[d]
                trials[d] = trials[d] * decay + tried[d]


def test_batched_counts_equal_request_by_request_loops() -> None:
    """Random steps of a chain mode and a tree mode (whose chain runs teach the chains, some
    rows with their next depth untried), requests arriving and finishing (rows reused):
    every request's counts, the global counts, each request's rates and the batch's summed
    expected tokens at every depth (totals) equal the loops' (rates per request, then
    1 + sum of running products), to 1e-12."""
    rng = random.Random(3)
    est = AcceptanceEstimates(max_depth=4, decay=0.9)
    ref = _LoopEstimates(4, 0.9)
    live = [f"r{i}" for i in range(40)]
    next_id = 40
    for step in range(120):
        batch = rng.sample(live, rng.randint(1, len(live)))
        if step % 3:  # a chain-3 step
            acc = {rid: rng.randint(0, 3) for rid in batch}
            est.observe_step(acc, 1, 3)
            ref.observe(acc, 1, 3)
        else:  # a tree step (topk 4, depth 4) and its chain runs (2 r + o)
            acc = {rid: rng.randint(0, 4) for rid in batch}
            runs = {rid: 2 * rng.randint(0, acc[rid]) + rng.randint(0, 1) for rid in batch}
            est.observe_step(acc, 4, 4, chain_runs=runs)
            ref.observe(acc, 4, 4)
            ref.observe({rid: r >> 1 for rid, r in runs.items()}, 1, 4,
                        {rid for rid, r in runs.items() if r & 1})
        for rid in rng.sample(live, rng.randint(0, 4)):  # some finish, new ones come
            est.forget(rid)
            ref.counts = {k: v for k, v in ref.counts.items() if k[0] != rid}
            live.remove(rid)
            live.append(f"r{next_id}")
            next_id += 1
        for fam in (1, 4):
            for mine, theirs in zip(est._global_counts[fam], ref.counts[(None, fam)]):
                assert mine == pytest.approx(theirs, abs=1e-12)
    w = est.prior_weight
    for fam in (1, 4):
        base = est._global(fam)
        want_totals = [0.0] * 5
        for rid in live:
            own = ref.counts.get((rid, fam))
            assert est.tracks(rid) == any((rid, f) in ref.counts for f in (1, 4))
            want = base if own is None else [(h + w * g) / (t + w) for h, t, g in zip(*own, base)]
            assert est.rates(rid, fam) == pytest.approx(want, abs=1e-12)
            run, total = 1.0, 1.0
            want_totals[0] += 1.0
            for d, a in enumerate(want, 1):
                run *= a
                total += run
                want_totals[d] += total
        assert est.totals(live, fam) == pytest.approx(want_totals, abs=1e-9)
