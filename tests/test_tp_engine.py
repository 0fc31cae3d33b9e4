"""The multi-process TP runtime on the CPU (gloo): the whole engine at TP 2 and 4 gives the
tokens of TP 1, and a worker that dies or hangs stops the engine cleanly.

Through `LLM.generate`: 8 prompts under continuous batching with chunked prefill (a small token
budget) and a forced preemption (a small KV pool), plain decoding, EAGLE-3 chain and tree, fp32.
Every rank's running digest of the tokens it produced equals rank 0's (sampling is
counter-based: no token is broadcast).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from engine_drivers import record_preemptions
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig, ParallelConfig, SchedulerConfig
from specserve.engine.errors import EngineDeadError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

MAX_TOKENS = 16
SPECS = {
    "plain": None,
    "chain3": dict(algorithm="eagle3", num_steps=3, topk=1),
    "tree2x6": dict(algorithm="eagle3", num_steps=3, topk=2, num_draft_tokens=6),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tp")
    # 8 heads / 4 kv heads / intermediate 128: every size divides by 4
    target = make_tiny_checkpoint(root / "target", family="llama", tokenizer=True, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  intermediate_size=128, hidden_size=64)
    head = make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)
    return target, head


def _prompts() -> list[list[int]]:
    """Random prompts, most sharing a prefix (cut at and between page boundaries): the prefix
    cache on rank 0's side shares pages the workers only know by id."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(16)]
    cuts = (0, 16, 8, 12, 5, 16, 0, 14)
    return [shared[:c] + [rng.randrange(3, 500) for _ in range(rng.randint(3, 14))]
            for c in cuts]


def _llm(pair: tuple[str, str], tp: int, spec: dict | None, **kw) -> LLM:
    if spec is not None:
        spec = {**spec, "draft_model": pair[1]}
    kw.setdefault("cache", CacheConfig(page_size=4, num_pages=24))
    kw.setdefault("scheduler", SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    kw.setdefault("parallel", ParallelConfig(tp_size=tp))
    return LLM(pair[0], device="cpu", dtype="float32", speculative_config=spec, **kw)


def _generate(llm: LLM) -> tuple[list[list[int]], list]:
    preempted = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [o.token_ids for o in outs], preempted


@pytest.fixture(scope="module")
def reference(pair) -> dict[str, list[list[int]]]:
    """TP 1 outputs per speculation config (in this process)."""
    out = {}
    for name, spec in SPECS.items():
        llm = _llm(pair, 1, spec)
        out[name], preempted = _generate(llm)
        assert preempted, "the small pool was meant to force a preemption"
        assert llm.engine.stats()["prefix_cache_hits"] > 0
        llm.close()
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("tp,name", [(2, "plain"), (2, "chain3"), (2, "tree2x6"),
                                     pytest.param(4, "chain3", marks=pytest.mark.slow)])
def test_tp_equals_tp1(pair, reference, tp: int, name: str) -> None:
    llm = _llm(pair, tp, SPECS[name])
    pids = llm.engine.executor.worker_pids
    assert len(pids) == tp - 1
    tokens, preempted = _generate(llm)
    assert preempted
    assert tokens == reference[name], f"TP={tp} {name} differs from TP=1"
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    digests = llm.engine.executor.close()
    assert set(digests) == set(range(1, tp))
    for rank, digest in digests.items():
        assert digest == llm.engine.executor.digest, f"rank {rank} produced other tokens"
    llm.close()
    assert not any(_alive(p) for p in pids)


def _dead_engine(pair, sig: int, **kw) -> tuple[float, list[int]]:
    """Start generating, send `sig` to rank 1 mid-run; seconds from the signal to the error."""
    llm = _llm(pair, 2, SPECS["chain3"], cache=CacheConfig(page_size=4, num_pages=1024), **kw)
    engine = llm.engine
    pids = engine.executor.worker_pids
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=200,
                                                      ignore_eos=True))
    for _ in range(3):
        engine.step()
    t0 = time.monotonic()
    os.kill(pids[0], sig)
    with pytest.raises(EngineDeadError) as err:
        for _ in range(10_000):
            engine.step()
    elapsed = time.monotonic() - t0
    assert "rank 1" in str(err.value) or "hung" in str(err.value)
    llm.close()
    return elapsed, pids


def test_killed_worker_stops_the_engine(pair) -> None:
    elapsed, pids = _dead_engine(pair, signal.SIGKILL)
    assert elapsed < 5.0
    assert not any(_alive(p) for p in pids)


def test_hung_worker_is_declared_hung(pair) -> None:
    elapsed, pids = _dead_engine(pair, signal.SIGSTOP,
                                 parallel=ParallelConfig(tp_size=2, step_timeout_s=2.0))
    assert 2.0 <= elapsed < 8.0
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_tp_adaptive_policy_and_mode_switches_equal_tp1(pair, reference) -> None:
    """The start-up cost table is measured on every rank (their collectives meet), and steps
    switching chain <-> tree <-> off (decided on rank 0, carried by the StepInput) give the
    plain tokens on every rank."""
    from specserve.engine.spec_policy import ScriptedPolicy

    spec = {**SPECS["chain3"], "modes": "chain1,tree2x3x6", "policy": "adaptive"}
    llm = _llm(pair, 2, spec)
    assert set(llm.engine.spec_cost_table) == {"off", "chain3", "chain1", "tree2x3x6"}
    llm.engine.spec_policy = ScriptedPolicy(["chain3", None, "tree2x3x6", "chain1", None, None])
    tokens, _ = _generate(llm)
    assert tokens == reference["plain"]
    steps = llm.engine.drafter.counters.mode_steps
    assert all(steps[m] > 0 for m in ("off", "chain3", "chain1", "tree2x3x6")), steps
    digests = llm.engine.executor.close()
    assert all(d == llm.engine.executor.digest for d in digests.values())
    llm.close()


def test_tp_logits_processing_equals_tp1(pair) -> None:
    """Penalties, min_tokens, logit_bias and log-probs at TP 2 (chain, preemption): every rank
    builds the same processing state from the StepInput, so the tokens (and every rank's
    digest) are TP 1's, and rank 0's log-probs match."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4,
                            logit_bias={7: 3.0}, logprobs=2)
    outs = {}
    for tp in (1, 2):
        llm = _llm(pair, tp, SPECS["chain3"])
        preempted = record_preemptions(llm.engine.scheduler)
        outs[tp] = llm.generate(_prompts(), params)
        assert preempted
        if tp == 2:
            digests = llm.engine.executor.close()
            assert all(d == llm.engine.executor.digest for d in digests.values())
        llm.close()
    for a, b in zip(outs[1], outs[2]):
        assert a.token_ids == b.token_ids
        assert [e[0] for e in a.logprobs] == pytest.approx([e[0] for e in b.logprobs], abs=1e-4)
