"""The request cases scripts/red_team.py replays, and what every case shares: each case
returns (ok, what was observed)."""

from __future__ import annotations

import os
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

    def post(
        self, path: str, payload: Any, server: Any = None, timeout: float = 60, **kw: Any
    ) -> httpx.Response:
        server = server or self.a
        return httpx.post(
            server.url + path, json=payload, headers=self.headers(), timeout=timeout, **kw
        )

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


# -- the cases ------------------------------------------------------------------------------


def tiny_temperatures(ctx: Ctx) -> Result:
    base = {"prompt": "def fibonacci(n):\n", "max_tokens": 24, "ignore_eos": True}
    greedy = _text(ctx.post(COMP, {**base, "temperature": 0}))
    got = {
        t: _text(ctx.post(COMP, {**base, "temperature": t, "seed": 7}))
        for t in (1e-38, 1e-40, 1e-46)
    }
    same = [t for t, text in got.items() if text == greedy]
    return len(same) == 3, f"T=1e-38, 1e-40, 1e-46: {len(same)}/3 equal the greedy text"


def huge_prompt(ctx: Ctx) -> Result:
    reply, secs, worst = _health_stall_during(
        ctx, lambda: ctx.post(COMP, {"prompt": "a" * 7_900_000, "max_tokens": 4})
    )
    ok = reply.status_code == 400 and secs < 5 and worst < 1.0
    return ok, (
        f"{reply.status_code} in {secs:.2f} s ({_error(reply).get('message', '')[:60]}"
        f"...); /health worst {worst * 1000:.0f} ms meanwhile"
    )


def many_messages(ctx: Ctx) -> Result:
    messages = [{"role": "user", "content": "hi"}] * 200_000
    reply, secs, worst = _health_stall_during(
        ctx, lambda: ctx.post(CHAT, {"messages": messages, "max_tokens": 4})
    )
    ok = reply.status_code == 400 and secs < 5 and worst < 1.0
    return ok, (
        f"{reply.status_code} (param {_error(reply).get('param')}) in {secs:.2f} s; "
        f"/health worst {worst * 1000:.0f} ms meanwhile"
    )


def stop_token_flood(ctx: Ctx) -> Result:
    t0 = time.monotonic()
    reply = ctx.post(COMP, {"prompt": "x", "max_tokens": 4, "stop_token_ids": [5] * 1_300_000})
    secs = time.monotonic() - t0
    ok256 = ctx.post(COMP, {"prompt": "x", "max_tokens": 4, "stop_token_ids": [5] * 256})
    ok = (
        reply.status_code == 400
        and _error(reply).get("param") == "stop_token_ids"
        and ok256.status_code == 200
    )
    return ok, (
        f"1.3M ids: {reply.status_code} in {secs:.2f} s ({_error(reply)['message'][:50]}"
        f"...); 256 ids: {ok256.status_code}"
    )


def echoed_input(ctx: Ctx) -> Result:
    reply = ctx.post(COMP, {"prompt": "x", "model": "m" * 7_300_000})
    size = len(reply.content)
    return reply.status_code == 404 and size < 1024, (
        f"7.3 MB model name: {reply.status_code}, error body {size} bytes"
    )


def chat_default_max_tokens(ctx: Ctx) -> Result:
    reply = ctx.post(
        CHAT,
        {
            "messages": [{"role": "user", "content": "Write a sort."}],
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    if reply.status_code != 200:
        return False, f"{reply.status_code}: {_error(reply).get('message', '')[:80]}"
    usage, finish = reply.json()["usage"], reply.json()["choices"][0]["finish_reason"]
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    return finish == "length" and total <= 256, (
        f"200, finish {finish}, {usage['completion_tokens']} tokens (prompt + output = {total} "
        f"of the pool's 256 slots)"
    )


def _preemptions(ctx: Ctx) -> float:
    text = httpx.get(ctx.a.url + "/metrics", headers=ctx.headers(), timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("specserve:num_preemptions_total")
    )


def seeded_under_preemption(ctx: Ctx) -> Result:
    prompts = ["def add(a, b):\n", "class Stack:\n", "import os\n", "for i in range(10):\n"]
    bodies = [
        {"prompt": p, "max_tokens": 120, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]
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
        f" {int(p1 - p0)} alone)"
    )


def duplicate_auth(ctx: Ctx) -> Result:
    headers = [("authorization", "Bearer sk-wrong"), ("authorization", f"Bearer {ctx.key}")]
    reply = httpx.post(
        ctx.a.url + COMP, json={"prompt": "x", "max_tokens": 1}, headers=headers, timeout=30
    )
    wrong = httpx.post(
        ctx.a.url + COMP, json={"prompt": "x"}, timeout=30, headers={"authorization": "Bearer nope"}
    )
    ok = reply.status_code == 401 and _error(wrong).get("type") == "invalid_request_error"
    return ok, (
        f"wrong-then-right: {reply.status_code}; a wrong key: {wrong.status_code} type "
        f"{_error(wrong).get('type')}"
    )


def key_handling(ctx: Ctx) -> Result:
    cli = [sys.executable, "-m", "specserve.cli", "serve"]
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
    env["PYTHONPATH"] = str(ctx.root)
    # both exit before binding anything: the empty key at once, the public one at model load
    procs = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ctx.root, env=env
        )
        for argv in (
            [*cli, "--api-key", ""],
            [*cli, "--host", "0.0.0.0", "--model", "/nonexistent"],
        )
    ]
    (_, empty_err), (_, public_err) = (p.communicate(timeout=60) for p in procs)
    empty_rc = procs[0].returncode
    warned = "without an API key" in public_err
    env_key = httpx.get(ctx.b.url + "/v1/models", headers=ctx.headers(), timeout=10).status_code
    ok = empty_rc == 2 and "empty" in empty_err and warned and env_key == 200
    return ok, (
        f"--api-key '': exit {empty_rc} ({empty_err.strip()[:50]}); "
        f"0.0.0.0 without a key: {'warned' if warned else 'silent'}; key from "
        f"$SPECSERVE_API_KEY and --api-key-file accepted"
    )


def slash_redirect(ctx: Ctx) -> Result:
    reply = httpx.get(
        ctx.a.url + "/v1/models/",
        timeout=10,
        follow_redirects=False,
        headers=ctx.headers(host="evil.example"),
    )
    location = reply.headers.get("location")
    return reply.status_code == 404 and location is None, (
        f"{reply.status_code}, Location {location!r}"
    )


def gauges_after_response(ctx: Ctx) -> Result:
    bad = 0
    for _ in range(20):
        ctx.post(COMP, {"prompt": "x", "max_tokens": 4})
        text = httpx.get(ctx.a.url + "/metrics", headers=ctx.headers(), timeout=10).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(
                ("specserve:num_requests_running ", "specserve:kv_cache_usage_perc ")
            )
        }
        bad += any(v != 0.0 for v in values.values())
    return bad == 0, f"20 scrapes right after a response: {bad} showed a request or pages in use"


def engines_in_a_row(ctx: Ctx) -> Result:
    code = (
        "import weakref\nfrom specserve.llm import LLM\nfrom specserve import defaults\n"
        "freed = []\nfor i in range(5):\n"
        "    with LLM(defaults.tiny_code_path(), device='cpu') as llm:\n"
        "        runner = llm.engine.runner\n"
        "        refs = [weakref.ref(t) for g in runner.kv_pool.groups for t in g.tensors.values()]\n"
        "        refs.append(weakref.ref(next(runner.model.parameters())))\n"
        "        del runner\n"
        "        llm.generate(['def f(x):'])\n"
        "    freed.append(all(r() is None for r in refs))\nprint(sum(freed))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ctx.root,
        env={**os.environ, "PYTHONPATH": str(ctx.root)},
    )
    freed = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"
    return out.returncode == 0 and freed == "5", (
        f"5 LLMs in one process: {freed}/5 released pool and weights at close"
    )
