"""The adaptive policy's start-up cost table within its time budget
(speculative/profile_budget.py): which batch sizes and chunk sizes are timed under a fake
clock, the extrapolation of the others, and through the engine, a small budget that still
gives a complete table and greedy output equal to plain decoding."""

from __future__ import annotations

import logging

import pytest
from tiny_eagle import make_tiny_pair

from specserve.config import CacheConfig, SchedulerConfig
from specserve.config_flags import ConfigError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_config import PROFILE_BUDGET, SpecConfig
from specserve.speculative.profile_budget import at, extrapolate, profile_within

SIZES = [1, 2, 4, 8, 16, 32]


def step_seconds(mode: str, b: int) -> float:
    """A fake step time: linear in the batch, the draft mode dearer per row."""
    return {"off": 0.010 + 0.002 * b, "chain3": 0.015 + 0.005 * b}[mode]


def calls_seconds(b: int) -> float:
    """A fake call timing both kinds at batch b: a warm-up and 3 repeats of each."""
    return 4 * (step_seconds("off", b) + step_seconds("chain3", b))


def chunk_extra(n: int) -> float:
    return 1e-4 * n


class FakeProfiler:
    """measure_costs / measure_mixed over step_seconds, each call advancing a fake clock by
    `call_seconds(b)` per batch size b, or per chunk size n beside `rows` by what
    profile_mixed times 4 times per kind: the decode step, and it with the chunk."""

    def __init__(self, call_seconds=calls_seconds, room: int = 1 << 20) -> None:
        self.now = 0.0
        self.call_seconds, self.room = call_seconds, room
        self.cost_calls: list[list[int]] = []
        self.mixed_calls: list[tuple[int, list[int]]] = []

    def clock(self) -> float:
        return self.now

    def costs(self, sizes: list[int]) -> dict[str, dict[int, float]]:
        self.cost_calls.append(sizes)
        self.now += sum(self.call_seconds(b) for b in sizes)
        return {m: {b: step_seconds(m, b) for b in sizes} for m in ("off", "chain3")}

    def mixed(self, rows: int, chunks: list[int]) -> dict[str, dict[int, float]]:
        self.mixed_calls.append((rows, chunks))
        self.now += sum(4 * (2 * step_seconds(m, rows) + chunk_extra(n))
                        for n in chunks for m in ("off", "chain3"))
        cut = [min(n, self.room) for n in chunks]
        return {m: {n: chunk_extra(n) for n in cut} for m in ("off", "chain3")}

    def run(self, budget: float, sizes: list[int] = SIZES, mixed_rows: int = 64):
        return profile_within(budget, sizes, mixed_rows, self.costs, self.mixed,
                              clock=self.clock)


def test_extrapolation_is_linear_through_the_last_two_measured_never_below_the_last() -> None:
    measured = {"off": {1: step_seconds("off", 1), 2: step_seconds("off", 2)},
                "chain3": {1: 0.030, 2: 0.025}}  # a noisy pair: shrinking with the batch
    full = extrapolate(measured, SIZES)
    assert {m: sorted(row) for m, row in full.items()} == {m: SIZES for m in measured}
    for b in SIZES:  # the fake step time is linear: extrapolated exactly
        assert full["off"][b] == pytest.approx(step_seconds("off", b))
    assert full["chain3"] == {1: 0.030, 2: 0.025, **dict.fromkeys(SIZES[2:], 0.025)}
    # between measured points: linear; below the first: the first
    assert at({2: 1.0, 8: 4.0}, 4) == pytest.approx(2.0)
    assert at({2: 1.0, 8: 4.0}, 1) == 1.0


def test_budget_stops_before_a_size_whose_predicted_time_would_pass_it() -> None:
    """Calls take b seconds at batch b: 1 + 2 spent, 4 predicted (the growth of 1 -> 2)
    fits in 10 s; 8 more would not. The rest is extrapolated, mixed steps not timed."""
    fake = FakeProfiler(call_seconds=float)
    prof = fake.run(budget=10.0)
    assert fake.cost_calls == [[1], [2], [4]]
    assert (prof.measured, prof.extrapolated) == ([1, 2, 4], [8, 16, 32])
    assert {m: sorted(row) for m, row in prof.table.items()} == {"off": SIZES,
                                                                 "chain3": SIZES}
    for m in ("off", "chain3"):  # measured as they came, the others on the linear rule
        assert prof.table[m][4] == step_seconds(m, 4)
        assert prof.table[m][32] == pytest.approx(step_seconds(m, 32))
    assert fake.mixed_calls == [] and prof.mixed == {}
    assert prof.seconds == 7.0 <= 10.0
    unset = FakeProfiler(call_seconds=float)  # no budget given: the adaptive default, 10 s
    assert unset.run(budget=None).measured == [1, 2, 4] and PROFILE_BUDGET == 10.0
    assert "1, 2, 4 measured, 8, 16, 32 extrapolated" in prof.describe()
    assert "mixed steps not timed" in prof.describe()


def test_a_tiny_budget_still_times_the_two_smallest_sizes() -> None:
    fake = FakeProfiler(call_seconds=float)
    prof = fake.run(budget=1e-9)
    assert fake.cost_calls == [[1], [2]] and fake.mixed_calls == []
    assert (prof.measured, prof.extrapolated) == ([1, 2], [4, 8, 16, 32])
    assert all(sorted(row) == SIZES for row in prof.table.values())
    one = FakeProfiler().run(budget=1e-9, sizes=[1])  # max_num_seqs 1: the one size
    assert (one.measured, one.extrapolated, sorted(one.table["off"])) == ([1], [], [1])


def test_no_budget_times_every_size_and_both_chunks_at_the_rows_asked() -> None:
    fake = FakeProfiler()
    prof = fake.run(budget=0.0, mixed_rows=16)
    assert fake.cost_calls == [[b] for b in SIZES] and prof.extrapolated == []
    assert fake.mixed_calls == [(16, [128]), (16, [512])]
    assert prof.mixed == {m: {n: chunk_extra(n) for n in (128, 512)} for m in ("off", "chain3")}
    assert "no budget" in prof.describe()


def test_mixed_steps_at_the_largest_measured_batch_while_chunks_fit() -> None:
    """Every size is timed in 2.36 s. The 128-token chunk is predicted at 4.12 s (a decode
    step of 128 rows for its extra) and fits in 6.6 s; it takes 2.09 s, and the 512 one's
    prediction (the 128 one's extras scaled by tokens, beside the steps) of 2.40 s does not
    fit."""
    fake = FakeProfiler()
    prof = fake.run(budget=6.6)
    assert prof.extrapolated == [] and fake.mixed_calls == [(32, [128])]
    assert sorted(prof.mixed["chain3"]) == [128] and prof.skipped_chunks == [512]
    assert prof.seconds == pytest.approx(2.364 + 2.0944) and "mixed steps timed at 32 rows, chunks " \
        "of 512 tokens not" in prof.describe()
    # 64 rows asked for, but batch 64 over the budget (32 took 3 s): beside 32 rows
    fake = FakeProfiler(call_seconds=lambda b: 3.0 if b == 32 else calls_seconds(b))
    prof = fake.run(budget=20.0, sizes=[*SIZES, 64], mixed_rows=64)
    assert prof.extrapolated == [64] and fake.mixed_calls == [(32, [128]), (32, [512])]
    # a chunk cut to the room beside the rows: a larger one would be cut alike, not timed
    fake = FakeProfiler(call_seconds=lambda b: 0.0, room=100)
    assert fake.run(budget=0.0).mixed == {m: {100: 0.01} for m in ("off", "chain3")}
    assert fake.mixed_calls == [(32, [128])]


def test_profile_budget_option() -> None:
    import argparse

    from specserve.config_flags import add_cli_args, config_from_cli_args

    assert SpecConfig().profile_budget is None  # PROFILE_BUDGET (10 s) when adaptive
    parser = argparse.ArgumentParser()
    add_cli_args(parser, SpecConfig)
    args = parser.parse_args(["--spec-profile-budget", "2.5", "--spec-policy", "adaptive",
                              "--spec-algorithm", "eagle3", "--spec-draft-model", "dummy"])
    assert config_from_cli_args(args, SpecConfig).profile_budget == 2.5
    with pytest.raises(ConfigError, match="profile.budget"):
        SpecConfig(profile_budget=-1.0)
    # a static policy profiles nothing: a budget given to it is refused, not ignored
    eagle = dict(algorithm="eagle3", draft_model="dummy")
    with pytest.raises(ConfigError, match="profile.budget.*adaptive policy only"):
        SpecConfig(**eagle, profile_budget=2.5)
    with pytest.raises(ConfigError, match="profile.budget.*adaptive policy only"):
        SpecConfig(profile_budget=0.0)  # speculation off
    with pytest.raises(ConfigError, match="profile.budget.*adaptive policy only"):
        SpecConfig(**eagle, profile_budget=10.0)  # the default's value, given: refused too
    assert SpecConfig(**eagle).profile_budget is None
    assert SpecConfig(**eagle, policy="adaptive").profile_budget is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("budget"))


def test_adaptive_engine_within_a_tiny_budget_is_complete_and_lossless(pair, caplog) -> None:
    prompts = [[5, 9, 17, 33, 2, 7], [11, 4, 8, 100, 42, 3, 3, 60, 21]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=256),
              scheduler=SchedulerConfig(max_num_seqs=8))
    ref = [o.token_ids for o in LLM(pair[0], **kw).generate(prompts, params)]
    spec = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, policy="adaptive",
                profile_budget=1e-6)
    with caplog.at_level(logging.INFO, logger="specserve.engine.engine"):
        llm = LLM(pair[0], speculative_config=spec, **kw)
    table = llm.engine.spec_cost_table
    assert {m: sorted(row) for m, row in table.items()} == {"off": [1, 2, 4, 8],
                                                            "chain3": [1, 2, 4, 8]}
    for row in table.values():  # 4 and 8 extrapolated from 1 and 2, not measured
        slope = row[2] - row[1]
        assert row[4] == max(row[2], row[2] + 2 * slope)
        assert row[8] == max(row[2], row[2] + 6 * slope)
    assert llm.engine.spec_mixed_table == {}  # the policy's own priors
    assert "batch sizes 1, 2 measured, 4, 8 extrapolated" in caplog.text
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    llm.close()


@pytest.mark.slow
def test_tp2_ranks_follow_rank0s_budgeted_profile(tmp_path) -> None:
    """At TP 2 the budget is decided on rank 0 (one control call per size timed): the worker
    rank times the same sizes (their collectives meet), and the tokens are plain greedy's on
    both ranks."""
    from tiny_eagle import make_tiny_eagle3_head
    from tiny_models import make_tiny_checkpoint

    from specserve.config import ParallelConfig

    target = make_tiny_checkpoint(tmp_path / "target", family="llama", tokenizer=True,
                                  num_hidden_layers=3, num_attention_heads=8,
                                  num_key_value_heads=4, intermediate_size=128, hidden_size=64)
    head = make_tiny_eagle3_head(str(tmp_path / "head"), target, draft_vocab_size=128)
    prompts = [[5, 9, 17, 33, 2, 7], [11, 4, 8, 100, 42, 3, 3, 60, 21]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=64),
              scheduler=SchedulerConfig(max_num_seqs=4))
    ref = [o.token_ids for o in LLM(target, **kw).generate(prompts, params)]
    spec = dict(algorithm="eagle3", draft_model=head, policy="adaptive", profile_budget=1e-6)
    llm = LLM(target, speculative_config=spec, parallel=ParallelConfig(tp_size=2), **kw)
    try:
        row = llm.engine.spec_cost_table["chain3"]
        assert sorted(row) == [1, 2, 4] and row[4] == max(row[2], 3 * row[2] - 2 * row[1])
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        digests = llm.engine.executor.close()
        assert digests and all(d == llm.engine.executor.digest for d in digests.values())
    finally:
        llm.close()


def test_mixed_steps_are_timed_within_the_engines_row_limit(pair, monkeypatch) -> None:
    """A mixed step holds its decode rows and its chunk's row; the scheduler never runs more
    than max_num_seqs rows, and no token graph holds more. The profile times mixed steps at
    the largest measured batch that leaves the chunk its row (max_num_seqs 4: 2 rows, not
    4, whose 5-row step ran an eager forward on an H100 and priced plain steps out), and
    none at max_num_seqs 1 (a step of one request has no room for both); at max_num_seqs 8
    with no budget limit, 4 rows."""
    from specserve.speculative import profile

    seen: list[int] = []
    real = profile.profile_mixed

    def spy(worker, bs, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(bs)
        return real(worker, bs, *a, **kw)

    monkeypatch.setattr(profile, "profile_mixed", spy)
    spec = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, policy="adaptive",
                profile_budget=0.0)
    for top, rows in ((4, [2]), (1, []), (8, [4])):
        seen.clear()
        llm = LLM(pair[0], speculative_config=spec, device="cpu", dtype="float32",
                  cache=CacheConfig(page_size=4, num_pages=128),
                  scheduler=SchedulerConfig(max_num_seqs=top))
        assert sorted(set(seen)) == rows, (top, seen)
        assert bool(llm.engine.spec_mixed_table) == bool(rows)
        llm.close()
