"""What a hostile or careless client found (issue 18), against a live server on 127.0.0.1:
slow or stalled uploads and connection floods (raw sockets), huge inputs refused before
tokenization, tokenization that leaves other threads running, capped lists, short echoes.
test_server_auth.py and test_server_faults.py hold the rest; they share the fixtures here."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from test_server import LiveServer, tiny_config
from tiny_models import make_tiny_checkpoint

from specserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

KEY = "sk-hardening"
AUTH = {"authorization": f"Bearer {KEY}"}
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_BODY = 200 << 10
PENDING = 256 << 10
HEADER_S, BODY_S, MAX_CONN = 0.5, 0.8, 6


def new_checkpoint(factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(factory.mktemp("tiny") / "llama", tokenizer=True)


def guarded_server(checkpoint: str) -> LiveServer:
    """A server with the key KEY and short header/body deadlines, small caps."""
    return LiveServer(
        tiny_config(checkpoint),
        api_key=KEY,
        max_body_bytes=MAX_BODY,
        body_timeout_s=BODY_S,
        max_pending_body_bytes=PENDING,
        server_kw=dict(header_timeout_s=HEADER_S, max_connections=MAX_CONN),
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    server = guarded_server(new_checkpoint(tmp_path_factory))
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


def post(
    live: LiveServer, path: str, payload: object, headers: dict | None = None, **kw: object
) -> httpx.Response:
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
        sock.sendall(
            f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload[:-1]
        )  # one byte short, forever
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
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MAX_BODY - 10}\r\n\r\n"
    ).encode()
    part = b'{"prompt": "' + b"x" * (PENDING // 2 + 20_000)
    with (
        socket.create_connection(address(live)) as first,
        socket.create_connection(address(live)) as second,
    ):
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


def test_long_prompt_refused_before_tokenizing(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = live.async_engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or [5])
    limit = live.async_engine.max_model_len * tok.max_chars_per_token
    reply = post(live, COMP, {"prompt": "a" * (limit + 1), "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "characters" in reply.json()["error"]["message"] and not calls


def test_many_chat_messages_refused_before_the_template(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = live.async_engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: calls.append(1) or [5])
    many = [{"role": "user", "content": "hi"}] * (live.async_engine.max_model_len + 1)
    reply = post(live, CHAT, {"messages": many, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}]
    reply = post(live, CHAT, {"messages": parts, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content"
    long = [
        {
            "role": "user",
            "content": "b" * (live.async_engine.max_model_len * tok.max_chars_per_token + 1),
        }
    ]
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
        reply = post(
            live, CHAT, {"messages": [{"role": "user", "content": [{"type": big, "text": "x"}]}]}
        )
    else:
        reply = httpx.get(live.url + "/" + "Q" * 8000, headers=AUTH, timeout=30)
    assert 400 <= reply.status_code < 500
    message = reply.json()["error"]["message"]
    assert len(message) <= 400 and "Q" * 101 not in message, (len(message), message[:120])


def test_internal_errors_say_nothing_of_the_cause(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("secret internal detail /home/op/keys.txt")

    monkeypatch.setattr(live.async_engine, "check_admission", broken)
    reply = post(live, COMP, {"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert "secret" not in reply.text and "keys.txt" not in reply.text


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


@pytest.mark.parametrize(
    "text",
    [
        "x" * 5000,
        " " * 5000,
        "ab" * 3000,
        "é" * 2000,
        "😀🚀 " * 1000,
        "<|eos|>" * 300,
        "e\u0301" * 2000,
    ],
)
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
    for parts in (
        dict(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
        dict(normalizer=normalizers.StripAccents()),
        dict(normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.Strip()])),
    ):
        assert _max_chars_per_token(spec(**parts), vocab) is None, parts


def test_sampling_params_cap_matches_the_server() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
