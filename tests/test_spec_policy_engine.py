"""The adaptive speculation policy through the engine (the policy itself:
tests/test_spec_policy.py): the start-up cost table, a policy that turns speculation off under
load and back on as the batch drains with greedy output equal to plain decoding, its flags and
bad modes, and a cost table that sees emulated communication."""

from __future__ import annotations

import random

import pytest
from tiny_eagle import make_tiny_pair

from specserve.config import CacheConfig, SchedulerConfig
from specserve.engine.spec_policy import AdaptivePolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("pol"))


def test_adaptive_engine_switches_with_load_and_stays_lossless(pair) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    # staggered lengths: the batch drains from 8 decodes to 1
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(8)
    ]
    kw = dict(
        device="cpu",
        dtype="float32",
        cache=CacheConfig(page_size=4, num_pages=512),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    ref = [o.token_ids for o in LLM(pair[0], **kw).generate(prompts, params)]
    llm = LLM(
        pair[0],
        speculative_config=dict(
            algorithm="eagle3", draft_model=pair[1], num_steps=3, modes="chain1", policy="adaptive"
        ),
        **kw,
    )
    table = llm.engine.spec_cost_table
    assert set(table) == {"off", "chain3", "chain1"}
    assert set(table["off"]) == {1, 2, 4, 8}
    assert all(t > 0 for row in table.values() for t in row.values())
    # a table where speculation pays at small batches only (on this CPU it never does),
    # taken as is
    costs = {"off": {1: 1.0, 8: 1.6}, "chain3": {1: 1.1, 8: 9.0}, "chain1": {1: 1.05, 8: 5.0}}
    llm.engine.spec_policy = AdaptivePolicy(
        {"chain3": (1, 3), "chain1": (1, 1)}, costs, dwell=2, explore_every=1000, rescale=0.0
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    steps = llm.engine.drafter.counters.mode_steps
    assert steps["off"] > 3 and steps["chain3"] > 3, steps
    c = llm.engine.drafter.counters
    assert c.num_catch_ups > 0, "speculation resumed after off steps without a catch-up"
    stats = llm.engine.stats()
    assert set(stats["spec_mode_scores"]) == {"off", "chain3", "chain1"}


def test_policy_flags_and_bad_modes(pair) -> None:
    import argparse

    from specserve.config_flags import ConfigError, add_cli_args, config_from_cli_args
    from specserve.spec_config import SpecConfig

    parser = argparse.ArgumentParser()
    add_cli_args(parser, SpecConfig)
    args = parser.parse_args(["--speculative-policy", "adaptive", "--spec-modes", "chain1",
                              "--spec-algorithm", "eagle3", "--spec-draft-model", "dummy"])
    spec = config_from_cli_args(args, SpecConfig)
    assert (spec.policy, spec.modes) == ("adaptive", "chain1")
    with pytest.raises(ConfigError, match="draft mode 'chainx'"):
        SpecConfig(algorithm="eagle3", draft_model=pair[1], modes="chain1,chainx")
    with pytest.raises(ConfigError, match="needs speculation"):
        SpecConfig(policy="adaptive")
    with pytest.raises(ValueError, match="draft mode 'tree2x1x9'"):
        LLM(pair[0], device="cpu", speculative_config=dict(
            method="eagle3", model=pair[1], modes="tree2x1x9"))


def test_cost_table_sees_emulated_communication(pair, tmp_path) -> None:
    """With the comm emulator charging every all-reduce, the start-up table grows by at least
    the target's reductions per step, plain and speculative alike (the policy sees a
    comm-bound verify)."""
    import json

    from specserve.config import CommConfig
    from specserve.distributed import comm

    table_path = tmp_path / "flat.json"
    table_path.write_text(json.dumps({"name": "flat", "latency_us": {"8": [[256, 5000.0]]}}))
    spec = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, policy="adaptive")
    kw = dict(
        device="cpu",
        dtype="float32",
        cache=CacheConfig(page_size=4, num_pages=256),
        scheduler=SchedulerConfig(max_num_seqs=2),
    )
    base = LLM(pair[0], speculative_config=spec, **kw)
    plain_table = base.engine.spec_cost_table
    base.close()
    llm = LLM(pair[0], speculative_config=spec, comm=CommConfig(emulate_comm=str(table_path)), **kw)
    try:
        table = llm.engine.spec_cost_table
        floor = 4 * 2 * 5e-3 * 0.9  # 4 target layers x 2 all-reduces x 5 ms
        for b in (1, 2):
            off_gain = table["off"][b] - plain_table["off"][b]
            assert off_gain > floor, (table, plain_table)
            # the cycle reduces in the verify and in every draft-head forward too
            assert table["chain3"][b] - plain_table["chain3"][b] > 1.5 * off_gain
    finally:
        llm.close()
        comm.reset()
