"""GPU engine checks: CUDA-graph replay equals the eager forward; speculation in bf16."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig
from specserve.engine.step_builder import build_step_input
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
# a fixed pool: several engines live in this process at once
CACHE = CacheConfig(page_size=16, num_pages=512)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return make_tiny_checkpoint(tmp_path_factory.mktemp("g") / "m", tokenizer=True,
                                num_hidden_layers=4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_graph_replay_equals_eager(target: str, temperature: float) -> None:
    llm = LLM(target, device="cuda", dtype="float32", cache=CACHE)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None, "graphs should be captured on CUDA"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 50))] for _ in range(5)]
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, max_tokens=4)
    ids = [llm.engine.add_request(None, p, params) for p in prompts]
    llm.engine.step()  # prefill all five
    step = build_step_input(llm.engine.scheduler.schedule())
    assert (step.num_new_tokens == 1).all() and step.bs == len(ids)
    # graph replay first (it writes the step's KV), then the eager forward over the same step
    tokens, logits = (t.clone() for t in runner._graph_decode(step))
    batch = runner.prepare(step)
    eager_logits = runner.compute_logits(
        runner.forward(batch.input_ids, batch.positions, batch.md))
    assert torch.allclose(logits, eager_logits, atol=1e-4, rtol=1e-4)
    st = runner.sampling_tensors(step)
    assert tokens.tolist() == runner.sampler.sample(eager_logits, st).tolist()


@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1),
                                  dict(num_steps=3, topk=4, num_draft_tokens=16)])
def test_graphs_and_eager_agree_on_outputs(target: str, tmp_path, spec: dict) -> None:
    from tiny_eagle import make_tiny_eagle3_head

    head = make_tiny_eagle3_head(str(tmp_path / "head"), target)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 50))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(target, device="cuda", dtype="float32", enforce_eager=eager, cache=CACHE,
                  speculative_config=dict(algorithm="eagle3", draft_model=head, **spec))
        assert (llm.engine.drafter.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, sp)]
    plain = LLM(target, device="cuda", dtype="float32", cache=CACHE)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    assert outs[True] == ref
    assert outs[False] == ref


def test_decode_overlap_matches_no_overlap(target: str) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 50))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i,
                             max_tokens=rng.randint(1, 40), ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for overlap in ("off", "on"):
        llm = LLM(target, device="cuda", dtype="float32", cache=CACHE, decode_overlap=overlap,
                  scheduler={"max_num_seqs": 5})
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, params)]
        launched = llm.engine.runner.rows_launched_ahead
        assert (launched > 0) == (overlap == "on"), launched
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_total
    assert outs["on"] == outs["off"]
