"""The adaptive policy's model of a mode's tokens per second (engine/goodput.py): the cost
table's interpolation and the share of a kind's steps that carry prefill chunks."""

from __future__ import annotations

import math

import pytest

from specserve.engine.goodput import _interpolate
from specserve.engine.spec_policy import AdaptivePolicy


def test_interpolation() -> None:
    row = [(1, 1.0), (4, 4.0), (8, 6.0)]
    assert [_interpolate(row, b) for b in (1, 2, 4, 6, 8, 12)] == [1.0, 2.0, 4.0, 5.0, 6.0, 8.0]
    assert _interpolate([(2, 3.0)], 4) == 6.0


def test_a_kinds_share_of_mixed_steps_is_its_own_even_when_another_kind_ran_since() -> None:
    """Plain steps met 100-155-token chunks (extra 5 ms + 20 us a token); then chain1 ran 40
    steps, 2 in 5 with a 260-token chunk. Off's share stays rho x tokens over its own mean
    chunk (not a rate carried over from chain1's steps), so the charge its mixed steps add
    per emitted token is what they measured per chunk token (mean extra over mean chunk)
    times rho, however the fitted line splits into fixed part and slope."""
    costs = {"off": {1: 0.01, 64: 0.02, 128: 0.03}, "chain1": {1: 0.011, 64: 0.024, 128: 0.04}}
    m = AdaptivePolicy({"chain1": (1, 1)}, costs)
    t_off, t_c1 = m.step_time(None, 64), m.step_time("chain1", 83)
    for i in range(12):  # plain steps of an older load, each with a chunk
        n = 100 + 5 * i
        m.observe(None, {}, t_off + 0.005 + 20e-6 * n, 64, mixed=True, chunk_tokens=n)
    for i in range(40):
        mixed = i % 5 < 2
        m.observe("chain1", {f"r{j}": 1 for j in range(83)}, t_c1 + (0.012 if mixed else 0.0),
                  83, mixed=mixed, chunk_tokens=260 if mixed else 0)
    rho = 2.0
    w = [0.97 ** (11 - i) for i in range(12)]  # ChunkCost's decay a new observation
    nbar = sum(wi * (100 + 5 * i) for i, wi in enumerate(w)) / sum(w)
    assert m.chunk_cost.mean_chunk("off") == pytest.approx(nbar)
    assert m.share_of("off", 32, rho) == pytest.approx(rho * 32 / nbar)  # 0.49
    assert m.share_of("off", 80, rho) == 1.0
    assert m.share_of("chain1", 83, rho) == pytest.approx(rho * 83 / 260)
    a, c = m.mixed_line("off")
    s = m.share_of("off", 32, rho)
    ybar = 0.005 + 20e-6 * nbar
    assert s * a + c * rho * 32 == pytest.approx(rho * 32 * ybar / nbar, rel=1e-6)


def test_a_speculative_mode_with_no_mixed_steps_of_its_own_takes_the_poisson_share() -> None:
    """Plain steps ran with one 128-token prompt a chunk; a tree never carried a chunk. At
    rho x tokens / prompt = lam prompts a step the tree's steps are 1 - e^-lam mixed (its
    finishes arrive apart), not min(1, rho x tokens / 128) as the running mode's chunks
    would say; plain steps (whose finishes arrive together) and a mode with chunks of its own
    keep the measured ratio (the Poisson share is only ever the lower one) while they ran
    lately."""
    costs = {"off": {1: 0.01, 64: 0.02}, "tree": {1: 0.012, 64: 0.03},
             "chain2": {1: 0.011, 64: 0.024}}
    m = AdaptivePolicy({"tree": (4, 3), "chain2": (1, 2)}, costs)
    rho, tokens = 2.0, 90.0
    for i in range(20):
        m.observe(None, {}, 0.02, 32, mixed=i % 2 == 0, chunk_tokens=128 if i % 2 == 0 else 0)
    assert m.share_of("tree", tokens, rho) == 1.0  # no request finished yet: the ratio
    for i in range(20):
        m.forget(f"r{i}", prompt_tokens=128, output_tokens=64)
    lam = rho * tokens / 128
    assert m.share_of("tree", tokens, rho) == pytest.approx(1.0 - math.exp(-lam))  # 0.75
    assert m.share_of("tree", 16.0, rho) == pytest.approx(1.0 - math.exp(-rho * 16 / 128))
    assert m.share_of("off", 90.0, rho) == 1.0
    for _ in range(4):  # chain2's own steps: one prompt a chunk, its measured ratio
        m.observe("chain2", {"x": 1}, 0.05, 32, mixed=True, chunk_tokens=128)
    assert m.share_of("chain2", tokens, rho) == 1.0
    # a stretch of plain steps longer than the horizon: chain2's own chunks are stale (they
    # age only with its group's mixed steps), the Poisson share again
    m.steps += m.horizon + 1
    assert m.share_of("chain2", tokens, rho) == pytest.approx(1.0 - math.exp(-lam))


def test_profiled_mixed_steps_are_the_first_points_of_each_kinds_line() -> None:
    """The start-up profile's mixed steps (a chunk's extra over each kind's decode step at
    two chunk sizes) give every kind its line before any step of it carried chunks: off's
    through its two points, not a few measured steps that happened to be cheap. They count
    PRIOR_WEIGHT steps each, decayed as measured steps come; no step carried them, so the
    kinds' mean chunks stay the measured ones."""

    costs = {"off": {1: 0.01, 64: 0.02}, "chain2": {1: 0.011, 64: 0.024}}
    priors = {"off": {128: 0.005 + 128 * 20e-6, 512: 0.005 + 512 * 20e-6},
              "chain2": {128: 0.007 + 128 * 24e-6, 512: 0.007 + 512 * 24e-6}}
    pol = AdaptivePolicy({"chain2": (1, 2)}, costs, mixed_priors=priors)
    for kind, (a, c) in (("off", (0.005, 20e-6)), ("chain2", (0.007, 24e-6))):
        fixed, slope = pol.mixed_line(kind)
        assert fixed == pytest.approx(a, rel=0.02) and slope == pytest.approx(c, rel=0.02)
    assert pol.chunk_cost.mean_chunk("off") is None  # no measured step yet
    # four cheap plain mixed steps (0.7 ms + 20 us a token, as an H100's few were) move off's
    # fixed part part of the way: 4 steps against 2 x PRIOR_WEIGHT
    t = pol.step_time(None, 64)
    for n in (200, 250, 300, 350):
        pol.observe(None, {}, t + 0.0007 + 20e-6 * n, 64, mixed=True, chunk_tokens=n)
    fixed, _ = pol.mixed_line("off")
    assert 0.0028 < fixed < 0.0040
    assert pol.chunk_cost.mean_chunk("off") == pytest.approx(
        sum(0.97 ** (3 - i) * n for i, n in enumerate((200, 250, 300, 350)))
        / sum(0.97 ** (3 - i) for i in range(4)))
    # without priors the same four steps make the line: ~1 ms
    bare = AdaptivePolicy({"chain2": (1, 2)}, costs)
    for n in (200, 250, 300, 350):
        bare.observe(None, {}, t + 0.0007 + 20e-6 * n, 64, mixed=True, chunk_tokens=n)
    assert bare.mixed_line("off")[0] < 0.0015 < fixed
    # thirty more measured steps outweigh the profile: the line follows them
    for i in range(30):
        n = 200 + 10 * (i % 16)
        pol.observe(None, {}, t + 0.0007 + 20e-6 * n, 64, mixed=True, chunk_tokens=n)
    assert pol.mixed_line("off")[0] < 0.0022  # nearer 0.7 ms than the profile's 5 ms


def test_a_fold_not_measured_yet_costs_what_a_plain_mixed_step_does() -> None:
    """A folded step runs the chunks in the plain step's forward, so until one is measured
    it is priced as a plain step with chunks, never as free. The case: the PCIe-table sweep
    at concurrency 2 (H100, 8B shape, 128-token prompts): a chunk adds ~28 ms to a plain
    step and ~31 ms to a chain-1 step of 15.3 ms (plain 8.6 ms); chain 1 emits 1.72 tokens a
    row. Counting its mixed steps as free folds, chain 1 scored 228 tok/s against plain's
    210 and ran at 0.94x plain; priced at the plain mixed step's cost, plain wins. Both the
    fitted-line path (chunk tokens known, the engine's) and the decayed-mean one are checked."""
    costs = {"off": {1: 0.0061, 2: 0.0086}, "chain1": {1: 0.0097, 2: 0.0153}}
    priors = {"off": {128: 0.028, 512: 0.028}, "chain1": {128: 0.0307, 512: 0.0307}}
    pol = AdaptivePolicy({"chain1": (1, 1)}, costs, mixed_priors=priors)
    for i in range(40):  # a plain load: 2 rows a step, a 128-token prompt every 29 steps
        mixed = i % 29 == 0
        pol.observe(None, {}, 0.0086 + (0.028 if mixed else 0.0), 2, mixed=mixed,
                    chunk_tokens=128 if mixed else 0)
    assert pol.chunk_cost.line("fold") is None
    assert pol.mixed_line("fold") == pytest.approx(pol.mixed_line("off"))
    share = pol.mixed_share
    off = pol.goodput("off", 2.0, 2, share)[0]
    chain1 = pol.goodput("chain1", 2 * 1.72, 2, share)[0]
    assert chain1 < off
    # measured folds then price themselves (here: cheaper than the plain mixed step)
    for _ in range(30):
        pol.observe("chain1", {}, 0.0086 + 0.010, 2, mixed=True, folded=True, chunk_tokens=128)
    fixed, slope = pol.mixed_line("fold")
    assert fixed + 128 * slope == pytest.approx(0.010, rel=0.05)

    blind = AdaptivePolicy({"chain1": (1, 1)}, costs)  # chunk tokens unknown: decayed means
    for i in range(60):
        mixed = i % 3 == 0
        blind.observe(None, {}, 0.0086 + (0.028 if mixed else 0.0), 2, mixed=mixed)
    # a fold (its chunks in a plain step: 8.6 + 28 ms) no longer beats running the chunks in
    # chain 1's verify (15.3 ms + its unmeasured prior); priced free, it did
    assert not blind.goodput("chain1", 2.0, 2, blind.mixed_share)[1]
