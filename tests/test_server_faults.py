"""Engine-side faults against a live server (issue 18): shutdown past the drain timeout, a stuck
engine (watchdog), a per-request deadline, the default max_tokens on a small KV pool, and
metrics that are current when a request's last output leaves."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from test_server import LiveServer, tiny_config
from test_server_hardening import CHAT, COMP, new_checkpoint, server_log
from test_server_load import body, read_stream


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return new_checkpoint(tmp_path_factory)


# -- item 8: the default max_tokens on a small pool -------------------------------------------


def test_default_max_tokens_is_clamped_to_the_pool(checkpoint: str) -> None:
    server = LiveServer(tiny_config(checkpoint).replace(cache={"num_pages": 8}))  # 64 slots
    try:
        messages = [{"role": "user", "content": "Once upon a time"}]
        reply = httpx.post(
            server.url + CHAT,
            json={"messages": messages, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        sched = server.async_engine.engine.scheduler
        ahead = max(sched.lookahead, sched.keep_ahead)
        assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] - ahead
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        too_many = httpx.post(
            server.url + CHAT, json={"messages": messages, "max_tokens": 100}, timeout=60
        )
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
        stream = asyncio.create_task(_first_event_then_rest(server.url + COMP, body(200), started))
        async with httpx.AsyncClient(timeout=30) as client:
            plain = asyncio.create_task(
                client.post(server.url + COMP, json=body(200, stream=False))
            )
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
        status, events = asyncio.run(asyncio.wait_for(_read(server.url + COMP, body(50)), 15))
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
            seen.append(
                (
                    reg.get_sample_value("specserve:num_requests_running"),
                    reg.get_sample_value("specserve:kv_cache_usage_perc"),
                    reg.get_sample_value(
                        "specserve:request_success_total", {"finished_reason": "length"}
                    ),
                )
            )
        return send(stream, item)

    engine._send = spy
    try:
        for _ in range(3):
            reply = httpx.post(server.url + COMP, json=body(5, stream=False), timeout=30)
            assert reply.status_code == 200
    finally:
        server.stop()
    assert [s[:2] for s in seen] == [(0.0, 0.0)] * 3 and [s[2] for s in seen] == [1, 2, 3]
