"""The OpenAI fields beyond sampling, through the openai client against a live server that
speculates (tiny-code + its EAGLE-3 head, chain): logprobs (completions and chat, streamed
and not), n > 1, echo, penalties, min_tokens, logit_bias, system_fingerprint, /tokenize,
/detokenize, /version. References: a plain offline Engine on the same model."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import LiveServer, run_offline

from specserve import __version__, defaults
from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.sampling_params import SamplingParams
from specserve.spec_config import speculative_config

TARGET, HEAD = defaults.tiny_code_path(), defaults.tiny_code_draft_path()
PROMPT = "def add(a, b):\n    return"
MESSAGES = [{"role": "user", "content": "write a loop"}]


def _config(spec: bool) -> EngineConfig:
    config = EngineConfig(model=TARGET, device="cpu", dtype="float32", enforce_eager=True)
    if spec:
        config = config.replace(spec=speculative_config(
            dict(algorithm="eagle3", draft_model=HEAD, num_steps=3, topk=1)))
    return config.replace(cache={"page_size": 8, "num_pages": 256},
                          scheduler={"max_num_seqs": 8})


@pytest.fixture(scope="module")
def live() -> LiveServer:
    server = LiveServer(_config(spec=True))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline() -> Engine:
    return Engine(_config(spec=False))


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _offline_logprobs(engine: Engine, prompt, k: int, max_tokens: int) -> list[list]:
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True, logprobs=k))
    req, entries = engine.get_request(rid), None
    while engine.has_unfinished():
        engine.step()
        entries = req.output_logprobs
    return entries


def test_completion_logprobs_equal_plain(client, offline) -> None:
    """Under speculation, the server's log-probs are the plain engine's (fp32, 1e-4)."""
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=10, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ref = _offline_logprobs(offline, PROMPT, 2, 10)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.token_logprobs == pytest.approx([e[0] for e in ref], abs=1e-4)
    for top, (_, ids, vals) in zip(lp.top_logprobs, ref):
        assert sorted(top.values())[-2:] == pytest.approx(sorted(vals), abs=1e-4)
        assert {offline.tokenizer.decode([t], skip_special_tokens=False) for t in ids} <= set(top)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_specserve")

    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=10, temperature=0,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True})
    tokens, values, offsets = [], [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert values == pytest.approx(lp.token_logprobs, abs=1e-4)  # cycles start elsewhere


def test_chat_logprobs(client, offline) -> None:
    r = client.chat.completions.create(model=TARGET, messages=MESSAGES,
                                       max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    ids = offline.tokenizer.apply_chat_template(MESSAGES)
    ref = _offline_logprobs(offline, ids, 3, 8)
    assert [c.logprob for c in content] == pytest.approx([e[0] for e in ref], abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy: the top one
    assert "".join(c.token for c in content) == r.choices[0].message.content

    stream = client.chat.completions.create(model=TARGET, messages=MESSAGES, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = [c for ch in stream if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])


def test_n_choices_distinct_and_reproducible(client) -> None:
    def ask(n: int, seed: int) -> list[str]:
        r = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, n=n, seed=seed,
                                      temperature=1.0, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == list(range(n))
        assert r.usage.completion_tokens == 8 * n  # every choice counted, the prompt once
        assert r.usage.prompt_tokens == len(client_tokenize(client, PROMPT))
        return [c.text for c in r.choices]

    first = ask(4, seed=7)
    assert len(set(first)) >= 3  # choices differ even under one seed
    assert ask(4, seed=7) == first  # the whole set is reproducible
    assert ask(1, seed=7) == first[:1]  # choice 0 keeps the request's seed
    assert ask(4, seed=8) != first

    stream = client.chat.completions.create(model=TARGET, messages=MESSAGES, max_tokens=6, n=3,
                                            seed=5, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, usage = ["", "", ""], None
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
        usage = ch.usage or usage
    assert usage.completion_tokens == 3 * 6 and usage.total_tokens == usage.prompt_tokens + 18
    r = client.chat.completions.create(model=TARGET, messages=MESSAGES, max_tokens=6, n=3,
                                       seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    assert texts == [c.message.content for c in r.choices]


def client_tokenize(client, prompt: str) -> list[int]:
    url = str(client.base_url).removesuffix("/v1/")
    return httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]


def test_echo_with_logprobs(client, offline) -> None:
    """echo + logprobs: the prompt's tokens lead (the first without a log-prob), their
    log-probs == the offline engine's prompt_logprobs, then the completion's."""
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0,
                                  echo=True, logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = offline.tokenizer.encode(PROMPT)
    rid = offline.add_request(None, ids, SamplingParams(temperature=0, max_tokens=4,
                                                        ignore_eos=True, logprobs=1,
                                                        prompt_logprobs=1))
    req = offline.get_request(rid)
    while offline.has_unfinished():
        offline.step()
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[0] for e in req.prompt_logprobs[1:]] + [e[0] for e in req.output_logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert r.choices[0].text.startswith(PROMPT)
    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, logprobs=1, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == r.choices[0].text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_echo(client) -> None:
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=5, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=None, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=5, temperature=0,
                                       echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


@pytest.mark.parametrize("fields", [
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=1.5),
    dict(min_tokens=12, logit_bias={1: 40.0}),  # EOS (1) pushed up, held until 12 tokens
    dict(logit_bias={13: 5.0, 29: -100.0}),
])
def test_processing_fields_equal_offline(client, offline, fields: dict) -> None:
    """Each field reaches the engine: the server's greedy text (speculating) == the offline
    plain engine's with the same SamplingParams, and != the text without the field."""
    body = {**fields}
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    standard = {k: body.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias")
                if k in body}
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body=body, **standard)
    _, text, reason = run_offline(offline, PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                                  **fields))
    base = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    assert text != base.choices[0].text
    if "min_tokens" in fields:
        assert reason == "stop" and r.usage.completion_tokens == 13  # 12 tokens, then EOS


def test_tokenize_detokenize_version(live, offline) -> None:
    tok = offline.tokenizer
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == offline.max_model_len
    assert "".join(body["token_strs"]) == tok.decode(body["tokens"], skip_special_tokens=False)
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tok.apply_chat_template(MESSAGES)
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": tok.decode(body["tokens"])}
    assert httpx.get(f"{live.url}/version").json() == {"version": __version__}
    bad = httpx.post(f"{live.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{live.url}/health").status_code == 200  # still up


def test_leaving_an_n_stream_aborts_every_choice(live, client) -> None:
    """A client that leaves a streamed n=3 request: all three engine requests are aborted
    and the KV pool returns to its baseline; the server keeps serving."""
    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=1500, n=3,
                                       temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    stats = live.wait_idle(timeout_s=8.0)  # 3 x 1500 tokens would take far longer
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_free_pages"] == live.initial_free_pages
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=2, n=2)
    assert len(r.choices) == 2


def test_continuous_usage_stats_on_every_chunk(client) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far
    (completion tokens never decrease, the last equals the whole)."""
    stream = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=9, stream=True,
                                       stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    seen = [ch.usage.completion_tokens for ch in stream]
    assert len(seen) > 2 and seen == sorted(seen) and seen[-1] == 9
    plain = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=9, stream=True,
                                      extra_body={"ignore_eos": True})
    assert all(ch.usage is None for ch in plain)
