"""The connection and fault cases scripts/red_team.py replays: slow or stalled uploads, floods,
a stuck engine, SIGTERM past the drain timeout. Each returns (ok, what was observed)."""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time

import httpx
from red_team_cases import COMP, Ctx, Result


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


def _trickle(ctx: Ctx, count: int, head: bytes, drip: bytes) -> tuple[list, float]:
    """count connections send `head`, then `drip` every 0.2 s until the server answers (6 s
    at most); (what each got until closed, seconds)."""
    socks = [socket.create_connection(ctx.addr()) for _ in range(count)]
    for s in socks:
        s.sendall(head)
    t0, done = time.monotonic(), set()
    while len(done) < len(socks) and time.monotonic() - t0 < 6:
        ready, _, _ = select.select([s for s in socks if s not in done], [], [], 0.2)
        done.update(ready)
        for s in socks:
            if s not in done:
                _send_or_done(s, drip, done)
    results = _read_until_closed(socks, 3)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    return results, elapsed


def _status(raw: bytes) -> str:
    return raw[9:12].decode() if raw.startswith(b"HTTP/1.1 ") else ("none" if not raw else "?")


def _tally(results: list[tuple[bytes, bool]]) -> str:
    counts: dict[str, int] = {}
    for raw, _ in results:
        counts[_status(raw)] = counts.get(_status(raw), 0) + 1
    return ", ".join(f"{n}x {s}" for s, n in sorted(counts.items()))


def stalled_uploads(ctx: Ctx) -> Result:
    size = 7_750_000
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ctx.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
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
    return ok, (
        f"100 uploads of 7.75 MB, one byte short: {_tally(results)}; all closed after "
        f"{elapsed:.1f} s ({open_left} open); server RSS peak +{peak - rss0:.0f} MB"
    )


def slowloris(ctx: Ctx) -> Result:
    # a header line every 0.2 s, never the blank line that ends them
    results, elapsed = _trickle(ctx, 20, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n")
    ok = all(closed and _status(raw) == "408" for raw, closed in results)
    return ok, f"20 slowloris connections: {_tally(results)}, closed after {elapsed:.1f} s"


def slow_body(ctx: Ctx) -> Result:
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ctx.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    results, elapsed = _trickle(ctx, 5, head, b" ")  # one body byte every 0.2 s
    ok = all(closed and _status(raw) == "408" for raw, closed in results)
    return ok, f"5 slow bodies (1 byte / 0.2 s): {_tally(results)}, closed after {elapsed:.1f} s"


def connection_flood(ctx: Ctx) -> Result:
    held = [socket.create_connection(ctx.addr()) for _ in range(60)]
    extra = socket.create_connection(ctx.addr())
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    ((raw, _),) = _read_until_closed([extra], 3)
    for s in [*held, extra]:
        s.close()
    time.sleep(0.5)
    after = httpx.get(ctx.a.url + "/health", timeout=10).status_code
    ok = _status(raw) == "503" and b"too_many_connections" in raw and after == 200
    return ok, (
        f"61st connection over a cap of 40: {_status(raw)} too_many_connections; "
        f"/health {after} once they closed"
    )


def stuck_engine(ctx: Ctx) -> Result:
    t0 = time.monotonic()
    events = []
    with httpx.stream(
        "POST",
        ctx.b.url + COMP,
        headers=ctx.headers(),
        timeout=30,
        json={"prompt": "RED-TEAM-STALL", "max_tokens": 50, "stream": True},
    ) as r:
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
    ok = (
        error.get("code") == "engine_dead"
        and waited < 4
        and health in ("503", "gone")
        and code == 1
        and "stalled" not in error.get("message", "")
    )
    return ok, (
        f"stream got error {error.get('code')} ({error.get('message')!r}) after "
        f"{waited:.1f} s; /health {health}; server exited {code}"
    )


def sigterm_past_drain(ctx: Ctx) -> Result:
    events: list[str] = []
    plain: list[httpx.Response] = []
    started = threading.Event()
    body = {"prompt": "RED-TEAM-SLOW def sort(xs):", "max_tokens": 150, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream(
            "POST",
            ctx.a.url + COMP,
            headers=ctx.headers(),
            timeout=30,
            json={**body, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    threads = [
        threading.Thread(target=stream),
        threading.Thread(target=lambda: plain.append(ctx.post(COMP, body))),
    ]
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
    ok = (
        last.get("error", {}).get("code") == "shutting_down"
        and reply is not None
        and reply.status_code == 503
        and reply.headers.get("retry-after") == "1"
        and logged
        and code == 0
    )
    status = reply.status_code if reply is not None else "none"
    return ok, (
        f"stream ended with SSE error {last.get('error', {}).get('code')}; non-stream "
        f"{status} JSON + Retry-After; log {'says' if logged else 'lacks'} 'aborted 2 "
        f"request(s)'; exit {code}"
    )
