"""The engine end to end on tiny random checkpoints, against transformers and bad input."""

from __future__ import annotations

import random

import pytest
import torch
from engine_drivers import record_preemptions
from tiny_models import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import Engine
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

NEW_TOKENS = 32


def _hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Independent reference: transformers' forward, argmax, one token at a time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            past = None
            new: list[int] = []
            for _ in range(n):
                res = model(ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                tok = int(res.logits[0, -1].argmax())
                new.append(tok)
                ids = torch.tensor([[tok]])
            outs.append(new)
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_transformers(tmp_path, family: str) -> None:
    path = make_tiny_checkpoint(tmp_path / family, family=family, tokenizer=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    ref = _hf_greedy(path, prompts, NEW_TOKENS)
    # a small token budget forces chunked prefill; a small pool forces preemptions
    llm = LLM(path, device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=60),
              scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    preempted = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert preempted, "the pool was sized to force at least one preemption"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("e") / "m", tokenizer=True,
                                max_position_embeddings=128)
    return Engine(EngineConfig(model=path, device="cpu", dtype="float32",
                               cache=CacheConfig(page_size=4, num_pages=64)))


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "non-empty"),
    ([-1], SamplingParams(), "token ids"),
    ([512], SamplingParams(), "token ids"),
    ([1] * 200, SamplingParams(), "context"),
])
def test_bad_requests_get_clear_errors(engine: Engine, prompt, params, match: str) -> None:
    free = engine.allocator.num_free
    with pytest.raises(ValueError, match=match):
        engine.add_request(None, prompt, params)
    assert engine.allocator.num_free == free
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_request_leaves_others_unaffected(engine: Engine) -> None:
    good = engine.add_request(None, [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError):
        engine.add_request(None, [1] * 500, SamplingParams())
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[good].finish_reason == "length" and done[good].num_output_tokens == 8
    assert engine.allocator.num_free == engine.allocator.num_total


def test_unknown_architecture_and_missing_weights(tmp_path) -> None:
    import json
    import os

    path = make_tiny_checkpoint(tmp_path / "m", tokenizer=True)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        Engine(EngineConfig(model=path, device="cpu"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="weight"):
        Engine(EngineConfig(model=path, device="cpu"))


def test_abort_and_stop_strings(engine: Engine) -> None:
    a = engine.add_request(None, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=20))
    b = engine.add_request(None, [9, 10], SamplingParams(temperature=0, max_tokens=20))
    texts = [o.new_text for o in engine.step() if o.request_id == b]
    engine.abort_request(a)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != a
            texts.append(out.new_text)
            if out.finished:
                finished[out.request_id] = out
    assert b in finished
    full = "".join(texts)
    assert engine.allocator.num_free == engine.allocator.num_total
    # now stop at a substring of that continuation: the output ends right before it
    if len(full) > 4:
        stop = full[2:4]
        c = engine.add_request(None, [9, 10], SamplingParams(temperature=0, max_tokens=20,
                                                              stop=[stop]))
        out_text = []
        while engine.has_unfinished():
            for out in engine.step():
                out_text.append(out.new_text)
                if out.finished:
                    assert out.finish_reason == "stop" and out.request_id == c
        got = "".join(out_text)
        assert stop not in got and full.startswith(got)
    assert engine.allocator.num_free == engine.allocator.num_total


def test_seeded_sampling_is_reproducible_and_batch_independent(engine: Engine) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12)

    def run(prompts):
        ids = [engine.add_request(None, p, sp) for p in prompts]
        toks = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                toks[out.request_id] += out.new_token_ids
        return [toks[i] for i in ids]

    alone = run([[3, 4, 5]])[0]
    together = run([[7, 7, 7, 7], [3, 4, 5], [9]])[1]
    assert alone == together


def test_offline_generate_feeds_more_prompts_than_the_queue_holds(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", tokenizer=True)
    llm = LLM(path, device="cpu", dtype="float32",
              scheduler=SchedulerConfig(max_waiting=3, max_num_seqs=2))
    prompts = [[5 + i, 6, 7] for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.token_ids) == 3 for o in outs)


def test_sliding_window_caps_the_context(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", family="mistral", tokenizer=True,
                                sliding_window=24)
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32"))
    assert engine.max_model_len == 24
    with pytest.raises(ValueError, match="context"):
        engine.add_request(None, [5] * 30, SamplingParams())
