"""The adaptive policy's model of a mode's tokens per second (engine/goodput.py): the cost
table's interpolation and the share of a kind's steps that carry prefill chunks."""

from __future__ import annotations

import pytest

from specserve.engine.goodput import FRESH_STEPS, GoodputModel, _interpolate


def test_interpolation() -> None:
    row = [(1, 1.0), (4, 4.0), (8, 6.0)]
    assert [_interpolate(row, b) for b in (1, 2, 4, 6, 8, 12)] == [1.0, 2.0, 4.0, 5.0, 6.0, 8.0]
    assert _interpolate([(2, 3.0)], 4) == 6.0


def test_plain_steps_share_of_mixed_steps_is_carried_over_when_stale() -> None:
    """Plain steps' mixed share comes from their own mean chunk while they ran mixed steps
    recently; once stale (another kind ran since), from the running kind's measured share
    through a Poisson arrival rate per emitted token; speculative kinds keep their own."""
    m = GoodputModel({"off": {1: 0.01, 64: 0.02}, "chain1": {1: 0.011, 64: 0.024}})
    for _ in range(10):  # an old load: one 128-token prompt with every plain step
        m.count_tokens(128, 64, "off")
        m.chunk_cost.observe("off", 128, 0.005)
    rho = 2.0
    assert m.share_of("off", 64, rho) == 1.0  # fresh: its own mean chunk (128)
    for i in range(FRESH_STEPS + 8):  # then chain1: 2 steps in 5 carry a 260-token chunk
        mixed = i % 5 < 2
        m.count_tokens(260 if mixed else 0, 83, "chain1")
        if mixed:
            m.chunk_cost.observe("chain1", 260, 0.012)
    n, k, e = m.kind_steps["chain1"]
    want = 1.0 - (1.0 - k / n) ** (64 / (e / n))
    assert 0.3 < want < 0.4
    assert m.share_of("off", 64, rho) == pytest.approx(want)
    assert m.share_of("chain1", 83, rho) == pytest.approx(rho * 83 / 260)  # its own chunks
    m.count_tokens(128, 64, "off")  # plain steps ran a mixed step again: their own
    own = min(1.0, rho * 64 / m.chunk_cost.mean_chunk("off"))
    assert m.share_of("off", 64, rho) == pytest.approx(own)
