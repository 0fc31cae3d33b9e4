"""Speculative overlap (the next cycle launched before the host reads this one, its inputs
left on the device) against the same engine without it: identical tokens under arrivals,
finishes, aborts, preemptions and sampled requests, launches actually taken, and every KV page
back in the pool. Runs on the CPU (eager launches ahead) and, marked gpu, on CUDA where the
cycles are graph replays."""

from __future__ import annotations

import pytest
import torch
from engine_drivers import random_workload, record_preemptions
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import Engine

NUM_PAGES = 64  # small enough to force preemptions
CONFIGS = {
    "chain3": dict(num_steps=3, topk=1),
    "tree4x8": dict(num_steps=3, topk=4, num_draft_tokens=8),
    "chain3-synthetic": dict(num_steps=3, topk=1, synthetic_accept_len=3),
    "tree2x6-synthetic": dict(num_steps=3, topk=2, num_draft_tokens=6, synthetic_accept_len=4),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("so")
    target = make_tiny_checkpoint(root / "target", family="llama", tokenizer=True,
                                  num_hidden_layers=4, max_position_embeddings=256)
    return target, make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


def drive(pair: tuple[str, str], spec: dict, overlap: str, seed: int, device: str
          ) -> tuple[dict, Engine, list]:
    """A scripted random workload: requests arrive over time, some are aborted. Both runs
    reserve the same slots ahead, so they schedule alike: a sampled request's tokens depend
    on where its cycles start, and overlap must change nothing else."""
    engine = Engine(EngineConfig(
        model=pair[0], device=device, dtype="float32", decode_overlap=overlap,
        spec=SpecConfig(algorithm="eagle3", draft_model=pair[1], **spec),
        cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6)))
    assert engine.scheduler.keep_ahead == (0 if overlap == "off" else keep_ahead(engine))
    engine.scheduler.keep_ahead = keep_ahead(engine)
    preempted = record_preemptions(engine.scheduler)
    return random_workload(engine, seed, max_tokens=48, arrival_p=0.2, arrivals_until=80), engine, preempted


def keep_ahead(engine: Engine) -> int:
    d = engine.drafter
    return d.num_steps + 1 + d.lookahead


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_spec_overlap_gives_the_same_tokens(pair, device: str, name: str, seed: int) -> None:
    ref, plain, _ = drive(pair, CONFIGS[name], "off", seed, device)
    got, eng, preempted = drive(pair, CONFIGS[name], "on", seed, device)
    assert got == ref
    d_off, d_on = plain.drafter, eng.drafter
    assert d_off.cycles_launched == 0
    # launches ahead were made and taken (the test would pass vacuously otherwise); only a
    # preemption or an abort makes the next step miss one
    assert d_on.cycles_launched > 30, d_on.cycles_launched
    assert d_on.cycles_launched_ahead >= 0.8 * d_on.cycles_launched, (
        d_on.cycles_launched_ahead, d_on.cycles_launched)
    assert d_on.counters.num_drafts == d_off.counters.num_drafts
    for e in (plain, eng):
        assert e.allocator.num_free == e.allocator.num_total
    if seed == 0 and name == "chain3":
        assert preempted, "the pool was sized to force preemptions"
