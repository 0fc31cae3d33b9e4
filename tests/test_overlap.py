"""Decode overlap (the next decode step launched before the host reads this one) against
the same engine without it: identical tokens under arrivals, finishes, aborts, preemptions
and sampled requests, and every KV page back in the pool. Runs on the CPU (eager launches
ahead); the GPU form replays decode graphs through the same code."""

from __future__ import annotations

import pytest
from engine_drivers import random_workload, record_preemptions
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import Engine


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("o") / "m", tokenizer=True,
                                max_position_embeddings=256)


def drive(path: str, overlap: str, seed: int) -> tuple[dict, Engine, list]:
    """A scripted random workload: requests arrive over time, some are aborted."""
    engine = Engine(EngineConfig(
        model=path, device="cpu", dtype="float32", decode_overlap=overlap,
        cache=CacheConfig(page_size=4, num_pages=48),
        scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=6)))
    preempted = record_preemptions(engine.scheduler)
    return random_workload(engine, seed, max_tokens=40, arrival_p=0.25), engine, preempted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_gives_the_same_tokens(model: str, seed: int) -> None:
    ref, plain, _ = drive(model, "off", seed)
    got, eng, preempted = drive(model, "on", seed)
    assert got.keys() == ref.keys()
    for rid, (tokens, reason) in ref.items():
        other, why = got[rid]
        if "abort" in (reason, why):  # aborted at a step index: prefill may wait a step
            n = min(len(tokens), len(other))
            assert other[:n] == tokens[:n], rid
        else:
            assert (other, why) == (tokens, reason), rid
    assert sum(why == "abort" for _, why in got.values()) < len(got) // 4
    assert plain.runner.rows_launched_ahead == 0
    # the launched-ahead rows were actually used (the test would pass vacuously otherwise)
    decoded = sum(len(toks) for toks, _ in got.values())
    assert eng.runner.rows_launched_ahead > decoded // 3, (eng.runner.rows_launched_ahead,
                                                           decoded)
    assert eng.scheduler.keep_ahead == 1 and plain.scheduler.keep_ahead == 0
    for e in (plain, eng):
        assert e.allocator.num_free == e.allocator.num_total
    if seed == 0:
        assert preempted, "the pool was sized to force preemptions"


def test_auto_is_off_without_graphs(model: str) -> None:
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32",
                                 cache=CacheConfig(page_size=4, num_pages=48)))
    assert not engine.runner.overlap and engine.scheduler.keep_ahead == 0


@pytest.mark.parametrize("prompt_len", [5, 8])
def test_prompts_done_in_a_step_decode_next_from_its_launch(model: str, prompt_len: int) -> None:
    """A step whose chunks finish prompts launches their first decodes with the others: the
    next step takes every row from that launch (no second forward beside it), and the
    tokens equal the engine's without overlap. A prompt that fills its last page exactly
    (8 tokens, pages of 4) owns the slot its first decode writes from its last chunk on."""
    from specserve.sampling_params import SamplingParams

    outs = {}
    for overlap in ("off", "on"):
        engine = Engine(EngineConfig(
            model=model, device="cpu", dtype="float32", decode_overlap=overlap,
            cache=CacheConfig(page_size=4, num_pages=48),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6)))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 9, 11, 13 + i, 2, 7, 3, 4][:prompt_len], params)
        tokens: dict[str, list[int]] = {}
        launched = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            launched.append(engine.runner.rows_launched_ahead)
        outs[overlap] = tokens, launched
    assert outs["on"][0] == outs["off"][0]
    # step 1 prefills all three (and launches their first decodes); step 2 takes all three
    # from that launch
    assert outs["on"][1][:2] == [0, 3]
    assert outs["off"][1][-1] == 0


def _closed_loop(model: str, overlap: str, legacy: bool = False
                 ) -> tuple[dict, list[tuple[int, int]], Engine]:
    """A closed-loop load (a new request enters as one finishes, as a benchmark's clients
    do); returns the tokens, per step (rows taken from the launch ahead, rows run in a
    forward of the step's own), and the engine."""
    from specserve.sampling_params import SamplingParams

    engine = Engine(EngineConfig(
        model=model, device="cpu", dtype="float32", decode_overlap=overlap,
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)))
    if legacy:  # launch ahead whatever comes next, prefill as soon as it can
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda defer_prefill=False: schedule()
        engine.scheduler.expects_prefill = lambda out: False
    runner, launch = engine.runner, engine.runner.launch
    ran: list[int] = []

    def counting_launch(step):
        ran.append(step.bs)
        return launch(step)

    runner.launch = counting_launch
    tokens: dict[str, list[int]] = {}
    steps, n = [], 0
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i] * (4 + 3 * i), SamplingParams(
            temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
    n = 4
    while engine.has_unfinished():
        taken, ran[:] = runner.rows_launched_ahead, []
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and n < 12:
                engine.add_request(f"r{n}", [7 + n] * (2 + n % 9), SamplingParams(
                    temperature=0, max_tokens=2 + n % 7, ignore_eos=True))
                n += 1
        steps.append((runner.rows_launched_ahead - taken, sum(ran)))
    return tokens, steps, engine


def test_prefill_waits_a_step_rather_than_run_beside_a_launch(model: str) -> None:
    """Prompts that arrive while decodes were launched ahead prefill in the step after,
    with the decodes in one forward (nothing launched ahead for it), instead of a second
    forward beside the launched one (H100, 8B, 128 rows: 16-20 ms a step, not 8-11): no
    step both takes launched rows and runs rows of its own. The control: launching ahead
    whatever comes next splits steps so. Tokens equal the engine's without overlap."""
    from prometheus_client import CollectorRegistry

    from specserve.server.metrics import EngineMetrics

    ref, _, plain = _closed_loop(model, "off")
    got, steps, eng = _closed_loop(model, "on")
    assert got == ref and len(got) == 12
    deferred = eng.stats()["num_prefill_deferrals"]
    assert deferred >= 3 and plain.stats()["num_prefill_deferrals"] == 0
    registry = CollectorRegistry()
    EngineMetrics(registry).observe_engine_stats(eng.stats())
    assert registry.get_sample_value("specserve:num_prefill_deferrals_total") == deferred
    assert sum(t for t, _ in steps) > 20  # decodes did run launched ahead
    assert sum(1 for t, r in steps if r and not t) > 4  # and prefill joined their steps
    assert not [s for s in steps if s[0] and s[1]], steps
    always, split, _ = _closed_loop(model, "on", legacy=True)
    assert always == ref
    assert [s for s in split if s[0] and s[1]]
