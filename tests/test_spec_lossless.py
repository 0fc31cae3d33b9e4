"""Speculative decoding is lossless: greedy output == plain greedy output, token for token.

Also checks the accounting with an oracle drafter (proposes the target's own greedy tokens) and
exercises tree KV compaction with an oracle that hides the true token among decoy siblings.
"""

from __future__ import annotations

import random

import pytest
from engine_drivers import record_preemptions
from tiny_eagle import make_tiny_eagle3_head, oracle_propose
from tiny_models import device_fixture, make_tiny_checkpoint

from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

MAX_TOKENS = 24
CONFIGS = {
    "chain1": dict(num_steps=1, topk=1),
    "chain3": dict(num_steps=3, topk=1),
    "chain5": dict(num_steps=5, topk=1),
    "tree2x4": dict(num_steps=3, topk=2, num_draft_tokens=4),
    "tree2x8": dict(num_steps=3, topk=2, num_draft_tokens=8),
    "tree4x8": dict(num_steps=3, topk=4, num_draft_tokens=8),
    "tree4x16": dict(num_steps=3, topk=4, num_draft_tokens=16),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_checkpoint(root / "target", family="llama", tokenizer=True,
                                  num_hidden_layers=4)
    head = make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)
    return target, head


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(n)]


DEVICE = "cpu"


# every test on the CPU and (marked gpu) on CUDA, in fp32 on both
device = device_fixture(globals())


def _llm(target: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("cache", CacheConfig(page_size=4, kv_cache_bytes=16 << 20, num_pages=1024))
    return LLM(target, device=DEVICE, dtype="float32", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def reference(pair: tuple[str, str], device: str) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy outputs for every prompt the tests use."""
    llm = _llm(pair[0])
    prompts = _prompts(16, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_greedy_speculation_equals_plain(pair, reference, name: str, bs: int) -> None:
    if bs == 16 and name not in ("chain3", "tree4x16"):
        pytest.skip("batch 16 runs for one chain and one tree config to keep the suite fast")
    prompts = [list(p) for p in reference][:bs]
    kw = {}
    if name == "tree2x8" and bs == 4:  # force preemptions: a pool far smaller than the batch
        kw["cache"] = CacheConfig(page_size=4, num_pages=40)
        kw["scheduler"] = SchedulerConfig(max_num_batched_tokens=32)
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], **CONFIGS[name]), **kw)
    preemptions = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)], f"{name} bs={bs} diverged on prompt {p}"
        assert o.spec_cycles > 0
    if kw:
        assert preemptions, "the small pool was meant to force a preemption"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_oracle_chain_accept_length_is_exact(pair, reference, steps: int) -> None:
    # eager: the oracle replaces a Python method, which a captured graph would not call
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], num_steps=steps, topk=1),
               enforce_eager=True)
    llm.engine.drafter.proposer.propose = oracle_propose(llm, reference, decoys=False)
    prompts = [list(p) for p in reference][:4]
    cycles = 3
    # one token from the prefill, then `cycles` full cycles of steps + 1 tokens
    max_tokens = 1 + cycles * (steps + 1)
    assert max_tokens <= MAX_TOKENS
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)][:max_tokens]
        assert o.spec_cycles == cycles
        assert o.accept_length == steps + 1
        assert o.spec_accepted_per_pos[:steps] == [cycles] * steps
    c = llm.engine.drafter.counters
    assert c.num_drafts == cycles * len(prompts)
    assert c.num_accepted_tokens == cycles * steps * len(prompts)


@pytest.mark.parametrize("topk,n", [(2, 6), (4, 10)])
def test_oracle_tree_with_decoys_compacts_kv(pair, reference, topk: int, n: int) -> None:
    """The true path is never the first child: output stays exact only if the accepted
    nodes' KV is moved into place."""
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=topk,
                             num_draft_tokens=n), enforce_eager=True)
    llm.engine.drafter.proposer.propose = oracle_propose(llm, reference, decoys=True)
    prompts = [list(p) for p in reference][:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)]
        assert o.accept_length > 2.0  # the oracle path is (mostly) accepted
