"""What coming back on costs: the positions the drafters' state lacks after steps off (the
engine counts them from the worker's reports, Scheduler.decoding), and the adaptive
policy's switch cost, which charges the catch-up per position behind and learns its rate
from the steps that switched on."""

from __future__ import annotations

import pytest
from tiny_eagle import make_tiny_pair

from specserve.config import CacheConfig, SchedulerConfig
from specserve.engine.spec_policy import AdaptivePolicy, ScriptedPolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

MODES = {"chain3": (1, 3)}
COSTS = {"off": {1: 1.0, 8: 2.0}, "chain3": {1: 1.2, 8: 3.0}}


def test_switching_on_costs_the_catch_up_per_position_behind() -> None:
    policy = AdaptivePolicy(MODES, COSTS)
    policy.catch_up_per_token = 0.01  # seconds a position
    policy.behind = 0
    base = policy.switch_cost("off", "chain3", 8)
    assert base == pytest.approx(policy.switch_steps["on"])
    policy.behind = 600  # 6 s of catch-up: two chain3 steps at batch 8
    assert policy.switch_cost("off", "chain3", 8) == pytest.approx(base + 2.0)
    # only switching on catches up
    assert policy.switch_cost("chain3", "off", 8) == pytest.approx(policy.switch_steps["off"])
    # a 20% gain over a 64-step horizon pays ~10.7 steps of switch: not 600 positions more
    # at 0.1 s each (20 steps)
    scores = {"off": 1.0, "chain3": 1.2}
    policy.behind = 0
    assert policy._pays("off", "chain3", scores, 8)
    policy.catch_up_per_token, policy.behind = 0.1, 600
    assert not policy._pays("off", "chain3", scores, 8)


def test_the_catch_up_rate_is_learnt_from_the_steps_that_switched_on() -> None:
    """Each off -> chain3 step takes its step time, 1 step of fixed switch cost and 2 ms per
    position behind (which varies): the policy separates the two."""
    policy = AdaptivePolicy(MODES, COSTS, dwell=1, explore_every=10**6)
    policy.observe("chain3", {"r0": 3}, 1.2, 1)
    for i in range(200):
        behind = 100 + 37 * (i % 7)
        policy.observe(None, {}, 1.0, 1)
        policy.behind = behind
        policy.observe("chain3", {"r0": 3}, 1.2 * (1 + 1.0) + 0.002 * behind, 1)
    assert policy.catch_up_per_token == pytest.approx(0.002, rel=0.1)
    assert policy.switch_steps["on"] == pytest.approx(1.0, rel=0.1)
    assert policy.step_time("chain3", 1) == pytest.approx(1.2)  # switch steps kept out


def test_before_the_switches_tell_the_slope_the_prefill_cost_stands_for_it() -> None:
    """A catch-up runs the target over its positions as a prefill does: before any switch
    the plain steps' cost a chunk token prices the positions behind, and one switch (no
    spread in positions behind to fit a slope to) keeps that slope, its fixed part taking
    the rest."""
    policy = AdaptivePolicy(MODES, COSTS, dwell=1, explore_every=10**6)
    for n in (100, 300, 200, 400):  # plain steps with chunks: 10 ms + 2 ms a chunk token
        policy.chunk_cost.observe("off", n, 0.01 + 0.002 * n)
    policy.behind = 500
    assert policy.switch_cost("off", "chain3", 1) == pytest.approx(
        policy.switch_steps["on"] + 0.002 * 500 / 1.2, rel=0.01)
    policy.observe("chain3", {"r0": 3}, 1.2, 1)
    policy.observe(None, {}, 1.0, 1)
    policy.observe("chain3", {"r0": 3}, 1.2 * 2 + 0.5, 1)  # 500 behind: 1 ms a position
    assert policy.catch_up_per_token == pytest.approx(0.002, rel=0.01)


class _Recorder(ScriptedPolicy):
    needs_batch = True  # the engine counts the positions behind only for such a policy

    def __init__(self, pattern) -> None:
        super().__init__(pattern)
        self.calls: list[tuple[bool, list[str], int]] = []

    def choose(self, decoding, others=0, behind=0):
        mode = super().choose(decoding, others, behind)
        self.calls.append((bool(mode), list(decoding), behind))
        return mode


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("behind"))


def test_the_engine_counts_positions_the_drafter_is_behind(pair) -> None:
    """One request, 9 prompt tokens: off for its prefill and 5 decode steps, then chain3.
    Before each off decode step the drafter lacks every position computed so far (the
    prompt and the tokens decoded while off: 9, 10, ...); after a speculative step, none
    (the step caught up and its cycle covers what it kept)."""
    policy = _Recorder([False] * 6 + [True] * 4)
    llm = LLM(pair[0], speculative_config=dict(algorithm="eagle3", draft_model=pair[1],
                                               num_steps=3),
              device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=256),
              scheduler=SchedulerConfig(max_num_seqs=4))
    llm.engine.spec_policy = policy
    llm.generate([list(range(3, 12))], SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True))
    calls = policy.calls
    assert calls[0] == (False, [], 0)  # the prefill step: nothing decoding yet
    assert [b for _, _, b in calls[1:6]] == [9, 10, 11, 12, 13], calls[:8]
    assert calls[6][0] and calls[6][2] == 14  # the first speculative step catches up 14
    ons = [b for on, ids, b in calls[7:10] if ids]
    assert ons and all(b == 0 for b in ons), calls[6:12]
    assert llm.engine.drafter.counters.num_catch_ups >= 1
