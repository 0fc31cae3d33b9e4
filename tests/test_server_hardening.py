"""What a hostile or careless client found (issue 18), each case against a live server on
127.0.0.1: slow or stalled uploads, connection floods, huge inputs before tokenization, echoed
inputs, duplicate keys, Host-built redirects, a stuck engine, shutdown past the drain timeout,
the default max_tokens on a small pool, and metrics read right after a response."""

from __future__ import annotations

import asyncio
import json
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from test_server import LiveServer, tiny_config
from test_server_load import body, read_stream
from tiny_models import make_tiny_checkpoint

from specserve.cli import main as cli_main
from specserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from specserve.server.guard import resolve_api_key

KEY = "sk-hardening"
AUTH = {"authorization": f"Bearer {KEY}"}
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_BODY = 200 << 10
PENDING = 256 << 10
HEADER_S, BODY_S, MAX_CONN = 0.5, 0.8, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=True)


@pytest.fixture(scope="module")
def live(checkpoint: str) -> LiveServer:
    server = LiveServer(tiny_config(checkpoint), api_key=KEY, max_body_bytes=MAX_BODY,
                        body_timeout_s=BODY_S, max_pending_body_bytes=PENDING,
                        server_kw=dict(header_timeout_s=HEADER_S, max_connections=MAX_CONN))
    yield server
    server.stop()


def address(live: LiveServer) -> tuple[str, int]:
    host, port = live.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or limit_s passes (False)."""
    sock.settimeout(0.1)
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def envelope(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]


def post(live: LiveServer, path: str, payload: object, headers: dict | None = None,
         **kw: object) -> httpx.Response:
    sent = {**AUTH, "content-type": "application/json", **(headers or {})}
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(live.url + path, content=content, headers=sent, timeout=30, **kw)


@contextmanager
def server_log() -> Iterator[list[str]]:
    """Messages of the server's log ("uvicorn.error", which uvicorn keeps from the root)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def wait_connections_closed(live: LiveServer, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while live.server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.02)


# -- item 3: slow headers, stalled bodies, connection floods, buffered memory ---------------


def test_slowloris_headers_get_408_and_close(live: LiveServer) -> None:
    with socket.create_connection(address(live)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        for i in range(int(HEADER_S / 0.1) + 20):  # a header line every 0.1 s, never ending
            if select.select([sock], [], [], 0.1)[0]:
                break  # the server answered (writing on would reset the connection)
            sock.sendall(f"X-Slow-{i}: 1\r\n".encode())
        reply, closed = read_all(sock, 5)
    assert closed and reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert envelope(reply)["code"] == "request_timeout"
    assert time.monotonic() - t0 < HEADER_S + 3


def test_stalled_body_gets_408_and_close(live: LiveServer) -> None:
    payload = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection(address(live)) as sock:
        sock.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                     .encode() + payload[:-1])  # one byte short, forever
        t0 = time.monotonic()
        reply, closed = read_all(sock, BODY_S + 5)
    assert closed and reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert envelope(reply)["code"] == "request_timeout"
    assert BODY_S - 0.1 < time.monotonic() - t0 < BODY_S + 3


def test_idle_connection_is_closed(live: LiveServer) -> None:
    with socket.create_connection(address(live)) as sock:
        reply, closed = read_all(sock, HEADER_S + 3)
    assert closed and reply == b""


def test_connection_cap_answers_503(live: LiveServer) -> None:
    wait_connections_closed(live)
    held = [socket.create_connection(address(live)) for _ in range(MAX_CONN)]
    try:
        with socket.create_connection(address(live)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply, closed = read_all(extra, 3)
        assert reply.startswith(b"HTTP/1.1 503") and closed, reply[:200]
        assert envelope(reply)["code"] == "too_many_connections"
        assert b"retry-after: 1" in reply.lower()
    finally:
        for sock in held:
            sock.close()
    wait_connections_closed(live)
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_bodies_in_flight_share_a_memory_budget(live: LiveServer) -> None:
    """Two uploads that together exceed the pending-body budget: the second gets 503 while
    the first stalls; the stalled one is then cut off (408) and the budget is free again."""
    head = (f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_BODY - 10}\r\n\r\n").encode()
    part = b'{"prompt": "' + b"x" * (PENDING // 2 + 20_000)
    with socket.create_connection(address(live)) as first, \
            socket.create_connection(address(live)) as second:
        first.sendall(head + part)
        time.sleep(0.2)
        second.sendall(head + part)
        reply2, _ = read_all(second, 3)
        reply1, closed1 = read_all(first, BODY_S + 3)
    assert reply2.startswith(b"HTTP/1.1 503") and envelope(reply2)["code"] == "server_busy"
    assert reply1.startswith(b"HTTP/1.1 408") and closed1
    ok = post(live, COMP, {"prompt": "x" * (PENDING // 2), "max_tokens": 1, "temperature": 0})
    assert ok.status_code in (200, 400), ok.text  # 400: the prompt is over the context
    assert ok.json().get("error", {}).get("code") != "server_busy"


# -- items 2, 4, 5: bounds before tokenizing, list caps, echoed values ----------------------


def test_long_prompt_refused_before_tokenizing(live: LiveServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tok = live.async_engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or [5])
    limit = live.async_engine.max_model_len * tok.max_chars_per_token
    reply = post(live, COMP, {"prompt": "a" * (limit + 1), "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "characters" in reply.json()["error"]["message"] and not calls


def test_many_chat_messages_refused_before_the_template(live: LiveServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tok = live.async_engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: calls.append(1) or [5])
    many = [{"role": "user", "content": "hi"}] * (live.async_engine.max_model_len + 1)
    reply = post(live, CHAT, {"messages": many, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}]
    reply = post(live, CHAT, {"messages": parts, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content"
    long = [{"role": "user", "content": "b" * (live.async_engine.max_model_len
                                               * tok.max_chars_per_token + 1)}]
    reply = post(live, CHAT, {"messages": long, "max_tokens": 1})
    assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"]
    assert not calls


def test_stop_token_ids_capped(live: LiveServer) -> None:
    many = list(range(MAX_STOP_TOKEN_IDS + 1))
    reply = post(live, COMP, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": many})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stop_token_ids"
    ok = post(live, COMP, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": many[:-1]})
    assert ok.status_code == 200


@pytest.mark.parametrize("case", ["model", "suffix", "content-type", "path", "role"])
def test_error_messages_echo_at_most_a_short_excerpt(live: LiveServer, case: str) -> None:
    big = "Q" * 200_000
    if case == "model":
        reply = post(live, COMP, {"prompt": "hi", "model": big})
    elif case == "suffix":
        reply = post(live, COMP, {"prompt": "hi", "suffix": big})
    elif case == "content-type":
        reply = post(live, COMP, {"prompt": "hi"}, {"content-type": "text/" + "Q" * 8000})
    elif case == "role":
        reply = post(live, CHAT, {"messages": [{"role": "user", "content": [
            {"type": big, "text": "x"}]}]})
    else:
        reply = httpx.get(live.url + "/" + "Q" * 8000, headers=AUTH, timeout=30)
    assert 400 <= reply.status_code < 500
    message = reply.json()["error"]["message"]
    assert len(message) <= 400 and "Q" * 101 not in message, (len(message), message[:120])


def test_internal_errors_say_nothing_of_the_cause(live: LiveServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("secret internal detail /home/op/keys.txt")

    monkeypatch.setattr(live.async_engine, "check_admission", broken)
    reply = post(live, COMP, {"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert "secret" not in reply.text and "keys.txt" not in reply.text


# -- items 10, 11: the key, redirects ---------------------------------------------------------


@pytest.mark.parametrize("order", [("sk-wrong", KEY), (KEY, "sk-wrong"), (KEY, KEY)])
def test_duplicate_authorization_headers_refused(live: LiveServer, order: tuple) -> None:
    headers = [("authorization", f"Bearer {k}") for k in order]
    headers.append(("content-type", "application/json"))
    reply = httpx.post(live.url + COMP, content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                       headers=headers, timeout=30)
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_wrong_key_error_is_openais(live: LiveServer) -> None:
    reply = post(live, COMP, {"prompt": "hi"}, {"authorization": "Bearer nope"})
    error = reply.json()["error"]
    assert reply.status_code == 401
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


def test_trailing_slash_is_no_redirect_to_the_host(live: LiveServer) -> None:
    reply = httpx.get(live.url + "/v1/models/", timeout=30, follow_redirects=False,
                      headers={**AUTH, "host": "evil.example"})
    assert reply.status_code == 404 and "location" not in reply.headers
    assert reply.json()["error"]["code"] == "not_found"


def test_api_key_sources(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert resolve_api_key(None, str(key_file), {}) == "sk-from-file"
    assert resolve_api_key(None, None, {"SPECSERVE_API_KEY": "sk-env"}) == "sk-env"
    assert resolve_api_key("sk-arg", None, {}) == "sk-arg"
    assert resolve_api_key(None, None, {}) is None
    for args, env, match in [(("", None), {}, "empty"), ((None, None),
                             {"SPECSERVE_API_KEY": " "}, "empty"),
                             (("a", str(key_file)), {}, "exactly one"),
                             ((None, str(tmp_path / "missing")), {}, "cannot read")]:
        with pytest.raises(ValueError, match=match):
            resolve_api_key(*args, env)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, str(empty), {})


def test_serve_refuses_an_empty_key_before_loading(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["serve", "--api-key", "", "--model", "/nonexistent/model"])
    err = capsys.readouterr().err
    assert code == 2 and "--api-key is empty" in err and "nonexistent" not in err


def test_serve_warns_on_a_public_address_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import specserve.server.api as api

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    api.register(parser.add_subparsers())
    with server_log() as lines:
        api._check_serve_args(parser.parse_args(["serve", "--host", "0.0.0.0"]))
        assert any("without an API key" in line for line in lines)
        lines.clear()
        api._check_serve_args(parser.parse_args(["serve", "--host", "0.0.0.0", "--api-key",
                                                 "k"]))
        api._check_serve_args(parser.parse_args(["serve"]))
        assert not lines
    with pytest.raises(ValueError, match="--timeout-body"):
        api._check_serve_args(parser.parse_args(["serve", "--timeout-body", "-1"]))


# -- item 8: the default max_tokens on a small pool -------------------------------------------


def test_default_max_tokens_is_clamped_to_the_pool(checkpoint: str) -> None:
    server = LiveServer(tiny_config(checkpoint).replace(cache={"num_pages": 8}))  # 64 slots
    try:
        messages = [{"role": "user", "content": "Once upon a time"}]
        reply = httpx.post(server.url + CHAT, json={"messages": messages, "temperature": 0,
                                                    "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        sched = server.async_engine.engine.scheduler
        ahead = max(sched.lookahead, sched.keep_ahead)
        assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] - ahead
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        too_many = httpx.post(server.url + CHAT, json={"messages": messages, "max_tokens": 100},
                              timeout=60)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    finally:
        server.stop()


# -- items 6, 7: shutdown past the drain timeout, a stuck engine, request deadlines ---------


def slow_steps(server: LiveServer, seconds: float) -> None:
    engine = server.async_engine.engine
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]


async def _first_event_then_rest(url: str, payload: dict, started: asyncio.Event) -> list:
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", url, json=payload) as reply:
            assert reply.status_code == 200
            events = []
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
            return events


def test_shutdown_past_the_drain_timeout_aborts_with_errors(checkpoint: str) -> None:
    """SIGTERM with a stream and a non-stream request that outlast the drain timeout: the
    stream ends with the SSE error event, the other gets 503 JSON with Retry-After, and the
    log says they were aborted."""
    server = LiveServer(tiny_config(checkpoint), server_kw=dict(drain_timeout_s=0.5))
    slow_steps(server, 0.03)

    async def scenario() -> tuple[list, httpx.Response]:
        started = asyncio.Event()
        stream = asyncio.create_task(_first_event_then_rest(server.url + COMP, body(200),
                                                            started))
        async with httpx.AsyncClient(timeout=30) as client:
            plain = asyncio.create_task(client.post(server.url + COMP,
                                                    json=body(200, stream=False)))
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.1)
            server.server.handle_exit(signal.SIGTERM, None)
            return await asyncio.wait_for(stream, 30), await asyncio.wait_for(plain, 30)

    try:
        with server_log() as lines:
            events, plain = asyncio.run(scenario())
            server.stop()
    finally:
        server.stop()
    assert events[-1]["error"]["code"] == "shutting_down" and "[DONE]" not in events
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1] if e["choices"])
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert plain.headers["retry-after"] == "1"
    assert any("aborted 2 request(s)" in line for line in lines), lines
    assert not any("all requests finished" in line for line in lines)


def test_stuck_engine_fails_requests_and_health(checkpoint: str) -> None:
    server = LiveServer(tiny_config(checkpoint), engine_kw=dict(watchdog_timeout_s=0.5))
    engine, release, calls = server.async_engine.engine, threading.Event(), []
    step = engine.step

    def stuck() -> list:
        calls.append(1)
        if len(calls) == 3:
            release.wait(30)  # a hung device step
        return step()

    engine.step = stuck
    try:
        t0 = time.monotonic()
        status, events = asyncio.run(asyncio.wait_for(
            _read(server.url + COMP, body(50)), 15))
        assert status == 200 and events[-1]["error"]["code"] == "engine_dead"
        assert "stopped responding" in events[-1]["error"]["message"]
        assert time.monotonic() - t0 < 5
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        late = httpx.post(server.url + COMP, json=body(2, stream=False), timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    finally:
        release.set()
        server.stop()


async def _read(url: str, payload: dict) -> tuple[int, list]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await read_stream(client, url, payload)


def test_request_deadline(checkpoint: str) -> None:
    server = LiveServer(tiny_config(checkpoint), engine_kw=dict(request_timeout_s=0.4))
    slow_steps(server, 0.02)
    try:
        reply = httpx.post(server.url + COMP, json=body(200, stream=False), timeout=30)
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "request_timeout"
        status, events = asyncio.run(_read(server.url + COMP, body(200)))
        assert status == 200 and events[-1]["error"]["code"] == "request_timeout"
        quick = httpx.post(server.url + COMP, json=body(2, stream=False), timeout=30)
        assert quick.status_code == 200
        assert server.wait_idle()["kv_free_pages"] == server.initial_free_pages
    finally:
        server.stop()


# -- item 12: metrics when the answer leaves ----------------------------------------------------


def test_metrics_are_current_when_the_last_output_leaves(checkpoint: str) -> None:
    """The engine thread hands a request's last output to its consumer only after the gauges
    and counters account for the request's end (a client reading /metrics right after its
    answer sees the pages free)."""
    server = LiveServer(tiny_config(checkpoint))
    engine = server.async_engine
    seen = []
    send = engine._send

    def spy(stream, item) -> bool:
        if getattr(item, "finished", False):
            reg = engine.registry
            seen.append((reg.get_sample_value("specserve:num_requests_running"),
                         reg.get_sample_value("specserve:kv_cache_usage_perc"),
                         reg.get_sample_value("specserve:request_success_total",
                                              {"finished_reason": "length"})))
        return send(stream, item)

    engine._send = spy
    try:
        for _ in range(3):
            reply = httpx.post(server.url + COMP, json=body(5, stream=False), timeout=30)
            assert reply.status_code == 200
    finally:
        server.stop()
    assert [s[:2] for s in seen] == [(0.0, 0.0)] * 3 and [s[2] for s in seen] == [1, 2, 3]


# -- item 2: tokenization lets other threads run ----------------------------------------------


def test_tokenizing_a_long_text_does_not_hold_the_interpreter(live: LiveServer) -> None:
    tok = live.async_engine.tokenizer
    text = "def foo(x):\n    return x * 2  # a comment, and more\n" * 10000
    t0 = time.perf_counter()
    expected = tok.encode(text)
    alone = time.perf_counter() - t0
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    ids = tok.encode(text)
    stop.set()
    ticker.join()
    gap = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert ids == expected
    assert gap < max(0.5 * alone, 0.05), (gap, alone)


@pytest.mark.parametrize("text", ["x" * 5000, " " * 5000, "ab" * 3000, "é" * 2000,
                                  "😀🚀 " * 1000, "<|eos|>" * 300, "e\u0301" * 2000])
def test_max_chars_per_token_bounds_the_characters(live: LiveServer, text: str) -> None:
    tok = live.async_engine.tokenizer
    assert len(text) <= len(tok.encode(text, add_special_tokens=False)) * tok.max_chars_per_token


def test_no_character_bound_for_tokenizers_that_drop_characters() -> None:
    import tokenizers
    from tokenizers import normalizers, pre_tokenizers

    from specserve.tokenizer import _max_chars_per_token

    def spec(**parts: object) -> dict:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        for name, part in parts.items():
            setattr(tok, name, part)
        return json.loads(tok.to_str())

    vocab = {"abc": 0, "d": 1}
    assert _max_chars_per_token(spec(pre_tokenizer=pre_tokenizers.ByteLevel()), vocab) == 3
    assert _max_chars_per_token(spec(normalizer=normalizers.NFC()), vocab) == 12
    for parts in (dict(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
                  dict(normalizer=normalizers.StripAccents()),
                  dict(normalizer=normalizers.Sequence([normalizers.NFD(),
                                                        normalizers.Strip()]))):
        assert _max_chars_per_token(spec(**parts), vocab) is None, parts


def test_sampling_params_cap_matches_the_server() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
