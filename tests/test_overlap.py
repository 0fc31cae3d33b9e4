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
    assert got == ref
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


def test_prompts_done_in_a_step_decode_next_from_its_launch(model: str) -> None:
    """A step whose chunks finish prompts launches their first decodes with the others: the
    next step takes every row from that launch (no second forward beside it), and the
    tokens equal the engine's without overlap."""
    from specserve.sampling_params import SamplingParams

    outs = {}
    for overlap in ("off", "on"):
        engine = Engine(EngineConfig(
            model=model, device="cpu", dtype="float32", decode_overlap=overlap,
            cache=CacheConfig(page_size=4, num_pages=48),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6)))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 9, 11, 13 + i, 2], params)
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
