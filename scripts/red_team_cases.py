"""The cases scripts/red_team.py replays: each returns (ok, what was observed)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
Result = tuple[bool, str]


@dataclass
class Ctx:
    a: Any  # the main server (red_team.Server); its SIGTERM case runs last
    b: Any  # the stall server; the stall case ends it
    key: str
    root: Path

    def headers(self, **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}", **extra}

    def post(self, path: str, payload: Any, server: Any = None, timeout: float = 60,
             **kw: Any) -> httpx.Response:
        server = server or self.a
        return httpx.post(server.url + path, json=payload, headers=self.headers(),
                          timeout=timeout, **kw)

    def addr(self, server: Any = None) -> tuple[str, int]:
        return "127.0.0.1", (server or self.a).port


@dataclass
class Case:
    item: int
    name: str
    before: str
    fn: Callable[[Ctx], Result]


def _text(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["text"]


def _error(reply: httpx.Response) -> dict:
    return reply.json().get("error", {})


def _health_stall_during(ctx: Ctx, send: Callable[[], httpx.Response]) -> tuple[Any, float, float]:
    """(reply, request seconds, worst /health latency while it ran)."""
    worst, done = [0.0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            httpx.get(ctx.a.url + "/health", timeout=60)
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.monotonic()
    reply = send()
    elapsed = time.monotonic() - t0
    done.set()
    poller.join()
    return reply, elapsed, worst[0]


def _read_until_closed(socks: list[socket.socket], limit_s: float) -> list[tuple[bytes, bool]]:
    """What each socket received until the server closed it (True) or limit_s passed."""
    data = {s: b"" for s in socks}
    closed: set[socket.socket] = set()
    deadline = time.monotonic() + limit_s
    while len(closed) < len(socks) and time.monotonic() < deadline:
        ready, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.1)
        for s in ready:
            try:
                chunk = s.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                data[s] += chunk
            else:
                closed.add(s)
    return [(data[s], s in closed) for s in socks]


def _send_or_done(sock: socket.socket, data: bytes, done: set) -> None:
    try:
        sock.sendall(data)
    except OSError:
        done.add(sock)


def _status(raw: bytes) -> str:
    return raw[9:12].decode() if raw.startswith(b"HTTP/1.1 ") else ("none" if not raw else "?")


def _tally(results: list[tuple[bytes, bool]]) -> str:
    counts: dict[str, int] = {}
    for raw, _ in results:
        counts[_status(raw)] = counts.get(_status(raw), 0) + 1
    return ", ".join(f"{n}x {s}" for s, n in sorted(counts.items()))


# -- the cases ------------------------------------------------------------------------------


def tiny_temperatures(ctx: Ctx) -> Result:
    base = {"prompt": "def fibonacci(n):\n", "max_tokens": 24, "ignore_eos": True}
    greedy = _text(ctx.post(COMP, {**base, "temperature": 0}))
    got = {t: _text(ctx.post(COMP, {**base, "temperature": t, "seed": 7}))
           for t in (1e-38, 1e-40, 1e-46)}
    same = [t for t, text in got.items() if text == greedy]
    return len(same) == 3, f"T=1e-38, 1e-40, 1e-46: {len(same)}/3 equal the greedy text"


def huge_prompt(ctx: Ctx) -> Result:
    reply, secs, worst = _health_stall_during(
        ctx, lambda: ctx.post(COMP, {"prompt": "a" * 7_900_000, "max_tokens": 4}))
    ok = reply.status_code == 400 and secs < 5 and worst < 1.0
    return ok, (f"{reply.status_code} in {secs:.2f} s ({_error(reply).get('message', '')[:60]}"
                f"...); /health worst {worst * 1000:.0f} ms meanwhile")


def many_messages(ctx: Ctx) -> Result:
    messages = [{"role": "user", "content": "hi"}] * 200_000
    reply, secs, worst = _health_stall_during(
        ctx, lambda: ctx.post(CHAT, {"messages": messages, "max_tokens": 4}))
    ok = reply.status_code == 400 and secs < 5 and worst < 1.0
    return ok, (f"{reply.status_code} (param {_error(reply).get('param')}) in {secs:.2f} s; "
                f"/health worst {worst * 1000:.0f} ms meanwhile")


def stalled_uploads(ctx: Ctx) -> Result:
    size = 7_750_000
    head = (f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ctx.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()
    payload = head + b'{"prompt": "' + b"x" * (size - 13)  # one byte short of the length
    rss0, peak, socks = ctx.a.rss_mb(), 0.0, []
    t0 = time.monotonic()
    for _ in range(100):
        s = socket.create_connection(ctx.addr())
        s.settimeout(5)
        try:
            s.sendall(payload)
        except OSError:
            pass  # refused mid-upload (503, connection closed)
        socks.append(s)
        peak = max(peak, ctx.a.rss_mb())
    results = _read_until_closed(socks, 10)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    open_left = sum(not closed for _, closed in results)
    ok = open_left == 0 and peak - rss0 < 250 and elapsed < 15
    return ok, (f"100 uploads of 7.75 MB, one byte short: {_tally(results)}; all closed after "
                f"{elapsed:.1f} s ({open_left} open); server RSS peak +{peak - rss0:.0f} MB")


def slowloris(ctx: Ctx) -> Result:
    socks = [socket.create_connection(ctx.addr()) for _ in range(20)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    t0, done = time.monotonic(), set()
    while len(done) < len(socks) and time.monotonic() - t0 < 6:
        ready, _, _ = select.select([s for s in socks if s not in done], [], [], 0.2)
        done.update(ready)
        for s in socks:
            if s not in done:
                _send_or_done(s, b"X-Slow: 1\r\n", done)  # a line every 0.2 s, never the end
    results = _read_until_closed(socks, 3)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    ok = all(closed and _status(raw) == "408" for raw, closed in results)
    return ok, f"20 slowloris connections: {_tally(results)}, closed after {elapsed:.1f} s"


def slow_body(ctx: Ctx) -> Result:
    head = (f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ctx.key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    socks = [socket.create_connection(ctx.addr()) for _ in range(5)]
    for s in socks:
        s.sendall(head)
    t0, done = time.monotonic(), set()
    while len(done) < len(socks) and time.monotonic() - t0 < 6:
        ready, _, _ = select.select([s for s in socks if s not in done], [], [], 0.2)
        done.update(ready)
        for s in socks:
            if s not in done:
                _send_or_done(s, b" ", done)  # one byte every 0.2 s
    results = _read_until_closed(socks, 3)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    ok = all(closed and _status(raw) == "408" for raw, closed in results)
    return ok, f"5 slow bodies (1 byte / 0.2 s): {_tally(results)}, closed after {elapsed:.1f} s"


def connection_flood(ctx: Ctx) -> Result:
    held = [socket.create_connection(ctx.addr()) for _ in range(60)]
    extra = socket.create_connection(ctx.addr())
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    (raw, _), = _read_until_closed([extra], 3)
    for s in [*held, extra]:
        s.close()
    time.sleep(0.5)
    after = httpx.get(ctx.a.url + "/health", timeout=10).status_code
    ok = _status(raw) == "503" and b"too_many_connections" in raw and after == 200
    return ok, (f"61st connection over a cap of 40: {_status(raw)} too_many_connections; "
                f"/health {after} once they closed")


def stop_token_flood(ctx: Ctx) -> Result:
    t0 = time.monotonic()
    reply = ctx.post(COMP, {"prompt": "x", "max_tokens": 4, "stop_token_ids": [5] * 1_300_000})
    secs = time.monotonic() - t0
    ok256 = ctx.post(COMP, {"prompt": "x", "max_tokens": 4, "stop_token_ids": [5] * 256})
    ok = (reply.status_code == 400 and _error(reply).get("param") == "stop_token_ids"
          and ok256.status_code == 200)
    return ok, (f"1.3M ids: {reply.status_code} in {secs:.2f} s ({_error(reply)['message'][:50]}"
                f"...); 256 ids: {ok256.status_code}")


def echoed_input(ctx: Ctx) -> Result:
    reply = ctx.post(COMP, {"prompt": "x", "model": "m" * 7_300_000})
    size = len(reply.content)
    return reply.status_code == 404 and size < 1024, (
        f"7.3 MB model name: {reply.status_code}, error body {size} bytes")


def chat_default_max_tokens(ctx: Ctx) -> Result:
    reply = ctx.post(CHAT, {"messages": [{"role": "user", "content": "Write a sort."}],
                            "temperature": 0, "ignore_eos": True})
    if reply.status_code != 200:
        return False, f"{reply.status_code}: {_error(reply).get('message', '')[:80]}"
    usage, finish = reply.json()["usage"], reply.json()["choices"][0]["finish_reason"]
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    return finish == "length" and total <= 256, (
        f"200, finish {finish}, {usage['completion_tokens']} tokens (prompt + output = {total} "
        f"of the pool's 256 slots)")


def _preemptions(ctx: Ctx) -> float:
    text = httpx.get(ctx.a.url + "/metrics", headers=ctx.headers(), timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("specserve:num_preemptions_total"))


def seeded_under_preemption(ctx: Ctx) -> Result:
    prompts = ["def add(a, b):\n", "class Stack:\n", "import os\n", "for i in range(10):\n"]
    bodies = [{"prompt": p, "max_tokens": 120, "temperature": 0.8, "seed": 100 + i,
               "ignore_eos": True} for i, p in enumerate(prompts)]
    p0 = _preemptions(ctx)
    alone = [_text(ctx.post(COMP, b)) for b in bodies]
    p1 = _preemptions(ctx)
    together: list[str] = [""] * 4

    def send(i: int) -> None:
        together[i] = _text(ctx.post(COMP, bodies[i]))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p2 = _preemptions(ctx)
    same = sum(a == b for a, b in zip(alone, together))
    return same == 4 and p1 == p0 and p2 > p1, (
        f"{same}/4 seeded outputs equal alone vs together ({int(p2 - p1)} preemptions together,"
        f" {int(p1 - p0)} alone)")


def duplicate_auth(ctx: Ctx) -> Result:
    headers = [("authorization", "Bearer sk-wrong"), ("authorization", f"Bearer {ctx.key}")]
    reply = httpx.post(ctx.a.url + COMP, json={"prompt": "x", "max_tokens": 1},
                       headers=headers, timeout=30)
    wrong = httpx.post(ctx.a.url + COMP, json={"prompt": "x"}, timeout=30,
                       headers={"authorization": "Bearer nope"})
    ok = reply.status_code == 401 and _error(wrong).get("type") == "invalid_request_error"
    return ok, (f"wrong-then-right: {reply.status_code}; a wrong key: {wrong.status_code} type "
                f"{_error(wrong).get('type')}")


def key_handling(ctx: Ctx) -> Result:
    cli = [sys.executable, "-m", "specserve.cli", "serve"]
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
    env["PYTHONPATH"] = str(ctx.root)
    # both exit before binding anything: the empty key at once, the public one at model load
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ctx.root, env=env)
             for argv in ([*cli, "--api-key", ""],
                          [*cli, "--host", "0.0.0.0", "--model", "/nonexistent"])]
    (_, empty_err), (_, public_err) = (p.communicate(timeout=60) for p in procs)
    empty_rc = procs[0].returncode
    warned = "without an API key" in public_err
    env_key = httpx.get(ctx.b.url + "/v1/models", headers=ctx.headers(), timeout=10).status_code
    ok = empty_rc == 2 and "empty" in empty_err and warned and env_key == 200
    return ok, (f"--api-key '': exit {empty_rc} ({empty_err.strip()[:50]}); "
                f"0.0.0.0 without a key: {'warned' if warned else 'silent'}; key from "
                f"$SPECSERVE_API_KEY and --api-key-file accepted")


def slash_redirect(ctx: Ctx) -> Result:
    reply = httpx.get(ctx.a.url + "/v1/models/", timeout=10, follow_redirects=False,
                      headers=ctx.headers(host="evil.example"))
    location = reply.headers.get("location")
    return reply.status_code == 404 and location is None, (
        f"{reply.status_code}, Location {location!r}")


def gauges_after_response(ctx: Ctx) -> Result:
    bad = 0
    for _ in range(20):
        ctx.post(COMP, {"prompt": "x", "max_tokens": 4})
        text = httpx.get(ctx.a.url + "/metrics", headers=ctx.headers(), timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("specserve:num_requests_running ",
                                      "specserve:kv_cache_usage_perc "))}
        bad += any(v != 0.0 for v in values.values())
    return bad == 0, f"20 scrapes right after a response: {bad} showed a request or pages in use"


def engines_in_a_row(ctx: Ctx) -> Result:
    code = (
        "import weakref\nfrom specserve.llm import LLM\nfrom specserve import defaults\n"
        "freed = []\nfor i in range(5):\n"
        "    with LLM(defaults.default_model_path(), device='cpu') as llm:\n"
        "        refs = [weakref.ref(llm.engine.runner.kv_pool.k),\n"
        "                weakref.ref(next(llm.engine.runner.model.parameters()))]\n"
        "        llm.generate(['def f(x):'])\n"
        "    freed.append(all(r() is None for r in refs))\nprint(sum(freed))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ctx.root, env={**os.environ, "PYTHONPATH": str(ctx.root)})
    freed = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"
    return out.returncode == 0 and freed == "5", (
        f"5 LLMs in one process: {freed}/5 released pool and weights at close")


def stuck_engine(ctx: Ctx) -> Result:
    t0 = time.monotonic()
    events = []
    with httpx.stream("POST", ctx.b.url + COMP, headers=ctx.headers(), timeout=30,
                      json={"prompt": "RED-TEAM-STALL", "max_tokens": 50, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    waited = time.monotonic() - t0
    try:
        health = str(httpx.get(ctx.b.url + "/health", timeout=5).status_code)
    except httpx.TransportError:
        health = "gone"
    code = ctx.b.proc.wait(30)
    last = json.loads(events[-1]) if events and events[-1] != "[DONE]" else {}
    error = last.get("error", {})
    ok = (error.get("code") == "engine_dead" and waited < 4 and health in ("503", "gone")
          and code == 1 and "stalled" not in error.get("message", ""))
    return ok, (f"stream got error {error.get('code')} ({error.get('message')!r}) after "
                f"{waited:.1f} s; /health {health}; server exited {code}")


def sigterm_past_drain(ctx: Ctx) -> Result:
    events: list[str] = []
    plain: list[httpx.Response] = []
    started = threading.Event()
    body = {"prompt": "RED-TEAM-SLOW def sort(xs):", "max_tokens": 150, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", ctx.a.url + COMP, headers=ctx.headers(), timeout=30,
                          json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    threads = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.append(ctx.post(COMP, body)))]
    for t in threads:
        t.start()
    started.wait(30)
    time.sleep(0.2)
    ctx.a.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    code = ctx.a.proc.wait(30)
    last = json.loads(events[-1]) if events and events[-1] != "[DONE]" else {}
    reply = plain[0] if plain else None
    logged = "aborted 2 request(s)" in ctx.a.text()
    ok = (last.get("error", {}).get("code") == "shutting_down" and reply is not None
          and reply.status_code == 503 and reply.headers.get("retry-after") == "1"
          and logged and code == 0)
    status = reply.status_code if reply is not None else "none"
    return ok, (f"stream ended with SSE error {last.get('error', {}).get('code')}; non-stream "
                f"{status} JSON + Retry-After; log {'says' if logged else 'lacks'} 'aborted 2 "
                f"request(s)'; exit {code}")


CASES = [
    Case(1, "tiny temperatures", "T=1e-38..1e-40: NaN logits, one token repeated; T=1e-46: "
         "sampled at T=1", tiny_temperatures),
    Case(2, "7.9 MB prompt", "froze /health and every request for 31 s", huge_prompt),
    Case(2, "200k chat messages", "froze the server for 4 s", many_messages),
    Case(3, "stalled uploads", "100 uploads one byte short held +775 MB forever",
         stalled_uploads),
    Case(3, "slowloris headers", "never closed", slowloris),
    Case(3, "slow body", "never closed", slow_body),
    Case(3, "connection flood", "no connection cap", connection_flood),
    Case(4, "1.3M stop_token_ids", "accepted, scanned every token (others 3x slower)",
         stop_token_flood),
    Case(5, "7.3 MB field echoed", "a 7.3 MB error body", echoed_input),
    Case(8, "chat, no max_tokens, small pool", "400 'lower max_tokens'",
         chat_default_max_tokens),
    Case(9, "seeded sampling under preemption", "3 of 4 seeded requests differed",
         seeded_under_preemption),
    Case(10, "duplicate Authorization", "wrong-then-right passed; 401 type "
         "authentication_error", duplicate_auth),
    Case(10, "API key sources", "empty --api-key accepted; key only on the command line; no "
         "warning on a public bind", key_handling),
    Case(11, "trailing slash + forged Host", "307 to the forged host", slash_redirect),
    Case(12, "gauges right after a response", "showed pages still in use",
         gauges_after_response),
    Case(13, "5 engines in one process", "the 4th: KV budget 'holds 0 pages' (GPU)",
         engines_in_a_row),
    Case(7, "stuck engine (watchdog 1 s)", "a 25 s stall kept /health 200; requests hung",
         stuck_engine),
    Case(6, "SIGTERM past the drain timeout", "streams cut without an error event, "
         "non-streams a plain-text 500; log said 'all requests finished'", sigterm_past_drain),
]
