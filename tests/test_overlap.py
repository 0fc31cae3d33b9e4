"""Decode overlap (the next decode step launched before the host reads this one) against
the same engine without it: identical tokens under arrivals, finishes, aborts, preemptions
and sampled requests, and every KV page back in the pool. Runs on the CPU (eager launches
ahead); the GPU form replays decode graphs through the same code."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_checkpoint, record_preemptions

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import Engine
from specserve.sampling_params import SamplingParams


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
    rng = random.Random(seed)
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for step in range(400):
        if step < 120 and rng.random() < 0.25:
            rid = f"r{step}"
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
            greedy = rng.random() < 0.5
            params = SamplingParams(
                temperature=0.0 if greedy else 0.9, top_k=0 if greedy else 40,
                seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, 40),
                stop_token_ids=[rng.randrange(3, 500) for _ in range(3)], ignore_eos=True)
            engine.add_request(rid, prompt, params)
            outputs[rid] = []
        if rng.random() < 0.03 and outputs:
            victim = rng.choice(sorted(outputs))
            if victim not in finished and engine.get_request(victim) is not None:
                engine.abort_request(victim)
                finished[victim] = "abort"
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if step >= 120 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return {k: (v, finished.get(k)) for k, v in outputs.items()}, engine, preempted


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
