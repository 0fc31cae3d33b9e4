"""Penalties, min_tokens, logit_bias and log-probs through the whole engine: EAGLE-3 (chain
and tree), n-gram and suffix greedy output == plain greedy output with the same feature, token for token, under
continuous batching with forced preemptions, with decode/speculative overlap on for some
engines, the feature on every other request of the batch (the rest must give their
unprocessed output); the bundled tiny-code pair in fp32 (CPU, and CUDA with graphs when
present: marked gpu). Log-probs under speculation == plain decoding's == a transformers
forward's log_softmax."""

from __future__ import annotations

import pytest
import torch
from engine_drivers import record_preemptions
from tiny_models import device_fixture

from specserve import defaults
from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

TARGET, HEAD = defaults.tiny_code_path(), defaults.tiny_code_draft_path()
EOS = 1
MAX_TOKENS = 20
PROMPTS = [
    "def add(a, b):\n    return",
    "for i in range(10):\n",
    "import os\nimport",
    "class Stack:\n    def __init__(self):\n",
    "x = [1, 2, 3]\nprint(",
    "if __name__ == '__main__':\n",
]
CHAIN = dict(algorithm="eagle3", draft_model=HEAD, num_steps=3, topk=1)
TREE = dict(algorithm="eagle3", draft_model=HEAD, num_steps=3, topk=2, num_draft_tokens=6)
# name: (speculative config, decode overlap); "plain" is the reference
SPEC = {"plain": (None, "off"), "plain+overlap": (None, "on"), "chain3+overlap": (CHAIN, "on"),
        "tree2x6": (TREE, "off"),
        # the model-free drafters through the same verify (prompt lookup, suffix tree)
        "ngram3": (dict(algorithm="ngram", num_steps=3), "on"),
        "suffix2x6": (dict(algorithm="suffix", num_steps=3, topk=2, num_draft_tokens=6), "off")}
DEVICE = "cpu"
device = device_fixture(globals())
FEATURES = {
    "repetition": dict(repetition_penalty=1.4),
    "frequency+presence": dict(frequency_penalty=0.9, presence_penalty=0.6),
    # EOS pushed up by a bias, then held back until min_tokens: it must land right there
    "min_tokens+bias": dict(min_tokens=12, logit_bias={EOS: 40.0}),
    "logit_bias": dict(logit_bias={13: 4.0, 28: -100.0, 29: 3.0}),
    "everything": dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                       logit_bias={13: 2.0}, min_tokens=3, logprobs=2),
}


@pytest.fixture(scope="module")
def llms():
    """Plain, chain and tree engines with a pool small enough to preempt a batch of 6."""
    out, preempted = {}, {}
    for name, (spec, overlap) in SPEC.items():
        llm = LLM(TARGET, device=DEVICE, dtype="float32", speculative_config=spec,
                  decode_overlap=overlap,
                  cache=CacheConfig(page_size=4, num_pages=30),
                  scheduler=SchedulerConfig(max_num_batched_tokens=32))
        out[name], preempted[name] = llm, record_preemptions(llm.engine.scheduler)
    yield out, preempted
    for llm in out.values():
        llm.close()


def _run(llm: LLM, mixed: bool = False, **kw) -> list:
    """Greedy outputs of PROMPTS with the feature kw (mixed: on even prompts only)."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             **({} if mixed and i % 2 else kw)) for i in range(len(PROMPTS))]
    return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def unprocessed(llms) -> list[list[int]]:
    return [o.token_ids for o in _run(llms[0]["plain"])]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_greedy_speculation_equals_plain_with_feature(llms, unprocessed, feature: str) -> None:
    engines, preempted = llms
    kw = FEATURES[feature]
    plain = _run(engines["plain"], mixed=True, **kw)
    # the feature does something (some featured prompt's output changes) and only there
    assert any(o.token_ids != u for o, u in zip(plain[::2], unprocessed[::2])), feature
    assert [o.token_ids for o in plain[1::2]] == unprocessed[1::2]
    for name in ("plain+overlap", "chain3+overlap", "tree2x6", "ngram3", "suffix2x6"):
        if name == "plain+overlap" and feature != "everything":
            continue  # one feature is enough for the plain step's overlap
        before = len(preempted[name])
        outs = _run(engines[name], mixed=True, **kw)
        for p, o, ref in zip(PROMPTS, outs, plain):
            assert o.token_ids == ref.token_ids, f"{name} {feature} diverged on {p!r}"
        if SPEC[name][0] is not None:
            assert sum(o.spec_accepted_tokens for o in outs) > 0  # drafts were accepted
        assert len(preempted[name]) > before, "the small pool was meant to force preemption"
        if kw.get("logprobs") is not None:
            for o, ref in zip(outs[::2], plain[::2]):
                assert len(o.logprobs) == len(o.token_ids)
                for a, b in zip(o.logprobs, ref.logprobs):
                    assert a[0] == pytest.approx(b[0], abs=1e-4)
                    assert a[1] == b[1]
    if feature == "min_tokens+bias":
        for o in plain[::2]:
            assert EOS not in o.token_ids[: kw["min_tokens"]]
        assert any(o.token_ids[kw["min_tokens"]:][:1] == [EOS] for o in plain[::2])


def test_logprobs_match_transformers(llms) -> None:
    """Raw log-probs of the emitted tokens under speculation (chain and tree) == plain
    decoding's == log_softmax of a transformers forward over prompt + output; the prompt's
    (prompt_logprobs, chunked prefill) too, computed in full although the prompts sit in the
    prefix cache."""
    transformers = pytest.importorskip("transformers")
    engines, _ = llms
    hf = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    names = ("plain", "chain3+overlap", "tree2x6")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with_lps = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3,
                              prompt_logprobs=2)
    outs = {}
    for name in names:
        engines[name].generate(PROMPTS[:2], greedy)
        hits = engines[name].generate(PROMPTS[:2], greedy)
        assert all(o.num_cached_tokens for o in hits)  # hits the next run must skip
        outs[name] = engines[name].generate(PROMPTS[:2], with_lps)
    for i in range(2):
        o = outs["plain"][i]
        ids = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        start = len(o.prompt_token_ids) - 1
        for name in names:
            got = outs[name][i]
            assert got.logprobs is not None and got.token_ids == o.token_ids
            for j, (tok, (lp, top_ids, top_lps)) in enumerate(zip(got.token_ids, got.logprobs)):
                row = ref[start + j]
                assert lp == pytest.approx(row[tok].item(), abs=2e-4), (name, j)
                assert top_ids == row.topk(3).indices.tolist(), (name, j)
                assert top_lps == pytest.approx(row.topk(3).values.tolist(), abs=2e-4)
            assert got.num_cached_tokens == 0 and got.prompt_logprobs[0] is None
            assert len(got.prompt_logprobs) == len(o.prompt_token_ids)
            for p, (lp, top_ids, _) in enumerate(got.prompt_logprobs[1:], start=1):
                row = ref[p - 1]
                assert lp == pytest.approx(row[o.prompt_token_ids[p]].item(), abs=2e-4)
                assert top_ids == row.topk(2).indices.tolist()


def test_stop_strings_count_from_min_tokens(llms) -> None:
    """A stop string in the text of the first min_tokens tokens does not fire (as EOS and
    stop_token_ids do not); past them it does, whether tokens arrive one by one or several
    per speculative cycle."""
    engines, _ = llms
    prompt, n_min = PROMPTS[1], 6

    def text(llm: LLM, **kw):
        return llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, **kw))[0]

    head = text(engines["plain"], max_tokens=n_min).text
    full = text(engines["plain"], max_tokens=MAX_TOKENS).text
    assert full.startswith(head) and head.strip()
    rest = full[len(head):]
    # a one-character stop string in the first min_tokens tokens' text and after them
    stop = next(c for c in head if not c.isspace() and c in rest)
    want = head + rest[: rest.index(stop)]
    for name in ("plain", "chain3+overlap", "tree2x6"):
        assert text(engines[name], max_tokens=MAX_TOKENS, stop=[stop]).text == head[
            : head.index(stop)], name  # without min_tokens the stop fires in the head
        out = text(engines[name], max_tokens=MAX_TOKENS, stop=[stop], min_tokens=n_min)
        assert out.text == want, name
        assert out.finish_reason == "stop" and len(out.token_ids) > n_min, name
