"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

The server runs the real Engine on a tiny random llama checkpoint (CPU, fp32); the reference for
every greedy answer is a second, offline Engine stepped by hand on the same checkpoint.
`LiveServer` is also used by the other server test files.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_checkpoint

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.sampling_params import SamplingParams
from specserve.server.api import build_app, build_server
from specserve.server.async_engine import AsyncEngine


def tiny_config(path: str | Path, **scheduler: int) -> EngineConfig:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", enforce_eager=True)
    return config.replace(cache={"page_size": 8, "num_pages": 256},
                          scheduler={"max_num_seqs": 8, **scheduler})


class LiveServer:
    """The server `specserve serve` runs (build_app + build_server: the guarded protocol and
    the drain-first shutdown) in a thread on a free loopback port. engine_kw go to
    AsyncEngine, server_kw to build_server, the rest to build_app."""

    def __init__(self, config: EngineConfig, api_key: str | None = None,
                 engine_kw: dict | None = None, server_kw: dict | None = None,
                 **app_kw: object) -> None:
        self.async_engine = AsyncEngine(Engine(config), **(engine_kw or {}))
        self.initial_free_pages = self.async_engine.stats()["kv_free_pages"]
        app = build_app(self.async_engine, api_key, **app_kw)
        self.server = build_server(self.async_engine, app, log_level="warning",
                                   **(server_kw or {}))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def engine_stats(self) -> dict:
        """Fresh stats, read on the engine thread between steps."""
        return self.async_engine.call_sync(lambda engine: engine.stats())

    def wait_idle(self, timeout_s: float = 20.0) -> dict:
        """Stats once nothing runs or waits and every KV page is free again (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine_stats()
            idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                    and stats["kv_free_pages"] == self.initial_free_pages)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=True)


@pytest.fixture(scope="module")
def live(checkpoint: str) -> LiveServer:
    server = LiveServer(tiny_config(checkpoint))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(checkpoint: str) -> Engine:
    return Engine(tiny_config(checkpoint))


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def run_offline(engine: Engine, prompt: str | list[int], params: SamplingParams,
                ) -> tuple[list[int], str, str]:
    """(output token ids, text, finish_reason) by stepping the engine by hand."""
    engine.add_request("ref", prompt, params)
    ids: list[int] = []
    text, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            reason = out.finish_reason
    return ids, text, reason


PROMPT = "def fibonacci(n: int) -> int:\n"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def test_models_and_health(live: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [live.async_engine.model_name]
    health = httpx.get(live.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_offline(live: LiveServer, client: openai.OpenAI,
                                          offline: Engine, stream: bool) -> None:
    ids, text, reason = run_offline(offline, PROMPT, SamplingParams(temperature=0, max_tokens=12))
    model = live.async_engine.model_name
    if stream:
        chunks = list(client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert not chunks[-1].choices  # the usage chunk comes last, with no choices
    else:
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        got, finish, usage = resp.choices[0].text, resp.choices[0].finish_reason, resp.usage
    assert got == text and finish == reason
    assert usage.completion_tokens == len(ids)
    assert usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_token_id_prompt_equals_text_prompt(live: LiveServer, client: openai.OpenAI,
                                            offline: Engine) -> None:
    prompt_ids = offline.tokenizer.encode(PROMPT)
    _, text, _ = run_offline(offline, PROMPT, SamplingParams(temperature=0, max_tokens=8))
    resp = client.completions.create(model=live.async_engine.model_name, prompt=prompt_ids,
                                     max_tokens=8, temperature=0)
    assert resp.choices[0].text == text
    assert resp.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_offline(live: LiveServer, client: openai.OpenAI, offline: Engine,
                                    stream: bool) -> None:
    prompt_ids = offline.tokenizer.apply_chat_template(MESSAGES)
    ids, text, reason = run_offline(offline, prompt_ids, SamplingParams(temperature=0,
                                                                        max_tokens=10))
    model = live.async_engine.model_name
    if stream:
        chunks = list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10,
                                              temperature=0)
        assert resp.choices[0].message.role == "assistant"
        got, finish, usage = resp.choices[0].message.content, resp.choices[0].finish_reason, \
            resp.usage
    assert got == text and finish == reason
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(live: LiveServer, client: openai.OpenAI, offline: Engine,
                     stream: bool) -> None:
    ids, text, _ = run_offline(offline, PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                                               ignore_eos=True))
    # a stop string from the middle of the unstopped greedy text
    full = offline.tokenizer.decode(ids)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].isascii() and full[i:i + 2].strip()
                and "\ufffd" not in full[:full.index(full[i:i + 2])])
    expected = full[:full.index(stop)]
    # tokens actually generated: up to the first one whose text completes the stop string
    num_tokens = next(k for k in range(1, len(ids) + 1)
                      if stop in offline.tokenizer.decode(ids[:k]))
    kw = dict(model=live.async_engine.model_name, prompt=PROMPT, max_tokens=24, temperature=0,
              stop=[stop], extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kw))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        resp = client.completions.create(**kw)
        got, finish, usage = resp.choices[0].text, resp.choices[0].finish_reason, resp.usage
    assert got == expected and finish == "stop"
    assert usage.completion_tokens == num_tokens


def test_seeded_sampling_reproducible(live: LiveServer, client: openai.OpenAI) -> None:
    kw = dict(model=live.async_engine.model_name, prompt=PROMPT, max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = [client.completions.create(seed=1234, **kw).choices[0].text for _ in range(2)]
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in range(4)}
    assert a[0] == a[1]
    assert len(others | {a[0]}) > 1  # the seed matters at temperature 1


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics(live: LiveServer, client: openai.OpenAI) -> None:
    before = _samples(httpx.get(live.url + "/metrics").text)
    resp = client.completions.create(model=live.async_engine.model_name, prompt=PROMPT,
                                     max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    live.wait_idle()
    reply = httpx.get(live.url + "/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    after = _samples(reply.text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("specserve:request_success_total", finished_reason="length") == 1
    assert delta("specserve:generation_tokens_total") == resp.usage.completion_tokens == 7
    assert delta("specserve:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("specserve:time_to_first_token_seconds_count") == 1
    assert delta("specserve:e2e_request_latency_seconds_count") == 1
    assert delta("specserve:time_per_output_token_seconds_count") == 1
    assert after[("specserve:num_requests_running", ())] == 0
    assert after[("specserve:kv_cache_usage_perc", ())] == 0.0


def test_async_engine_generate(live: LiveServer, offline: Engine) -> None:
    """generate() straight on the AsyncEngine, from another event loop than the server's:
    greedy ids equal the offline engine's, add_request errors raise before any output, and
    leaving the iteration early aborts the request and frees its KV."""
    prompt = offline.tokenizer.encode(PROMPT)
    ids, _, _ = run_offline(offline, prompt, SamplingParams(temperature=0, max_tokens=10))
    engine = live.async_engine

    async def main() -> list[int]:
        got = []
        async for out in engine.generate("direct-1", prompt, SamplingParams(temperature=0,
                                                                              max_tokens=10)):
            got += out.new_token_ids
        with pytest.raises(ValueError, match="context"):
            await anext(engine.generate("direct-2", [3] * 1000, SamplingParams()))
        outputs = engine.generate("direct-3", prompt, SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
        await anext(outputs)
        await outputs.aclose()
        return got

    assert asyncio.run(main()) == ids
    stats = live.wait_idle()
    assert stats["kv_free_pages"] == live.initial_free_pages and stats["num_running"] == 0


def test_spec_counter_deltas_reach_metrics(offline: Engine,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's speculation counters are cumulative; the Prometheus counters advance by
    their deltas (here fed by a scripted stats() sequence, read on the engine thread)."""
    base = offline.stats()
    script = [dict(base, num_drafts=d, num_draft_tokens=3 * d, num_accepted_tokens=a,
                   accepted_per_pos=pos, mode_steps={"off": off, "chain3": d})
              for d, a, pos, off in [(0, 0, [0, 0, 0], 0), (2, 4, [2, 1, 1], 3),
                                     (5, 7, [4, 2, 1], 3), (5, 7, [4, 2, 1], 6)]]
    monkeypatch.setattr(offline, "stats", lambda: script.pop(0) if len(script) > 1 else script[0])
    engine = AsyncEngine(offline)
    engine.start()
    try:
        for _ in range(3):
            engine.call_sync(lambda e: None)  # each command batch samples stats once
    finally:
        engine.shutdown()

    def value(name: str, **labels: str) -> float:
        return engine.registry.get_sample_value(name, labels) or 0.0

    method = offline.config.spec.algorithm  # the speculation counters' label
    assert value("specserve:spec_decode_num_drafts_total", method=method) == 5
    assert value("specserve:spec_decode_num_draft_tokens_total", method=method) == 15
    assert value("specserve:spec_decode_num_accepted_tokens_total", method=method) == 7
    per_pos = [value("specserve:spec_decode_num_accepted_tokens_per_pos_total", method=method,
                     position=str(i)) for i in range(3)]
    assert per_pos == [4, 2, 1]
    steps = {m: value("specserve:spec_decode_mode_steps_total", mode=m) for m in ("off", "chain3")}
    assert steps == {"off": 6, "chain3": 5}


def test_cached_prompt_tokens_in_usage_and_metrics(live: LiveServer,
                                                   client: openai.OpenAI) -> None:
    """A prompt sent again reuses its cached pages: usage.prompt_tokens_details.cached_tokens
    says how many prompt tokens (whole pages of 8, the last token always run), and the
    prefix-cache counters count queried and hit tokens."""
    before = _samples(httpx.get(live.url + "/metrics").text)
    prompt = "class PrefixCacheProbe:\n    def lookup(self, key: str) -> int:\n" * 3
    model = live.async_engine.model_name
    first = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 16 and first.usage.prompt_tokens_details.cached_tokens == 0
    live.wait_idle()
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=3,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    second = chunks[-1].usage
    assert second.prompt_tokens_details.cached_tokens == (n - 1) // 8 * 8
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    live.wait_idle()
    after = _samples(httpx.get(live.url + "/metrics").text)

    def delta(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert delta("specserve:prefix_cache_queries_total") == 2 * n
    assert delta("specserve:prefix_cache_hits_total") == (n - 1) // 8 * 8
