"""`specserve bench serve`: an HTTP load generator for OpenAI-compatible servers.

Each sweep point is either a closed loop with C requests in flight (`--concurrency 1,2,4`) or
open-loop Poisson arrivals at R requests/s (`--request-rate`). Per request it measures TTFT,
ITL (gap between stream chunks), end-to-end latency and TPOT, where TPOT is per generated token
from the server's usage count, (e2e - ttft) / (completion_tokens - 1), never per chunk: with
speculation a chunk carries several tokens. Acceptance is isolated to each point by scraping the
server's /metrics speculation counters before and after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import accumulate
from typing import Any

import httpx

from specserve.bench.log import append_result, read_results
from specserve.bench.plots import plot_sweep
from specserve.bench.prompts import Prompt, load_prompts
from specserve.bench.stats import (
    format_range,
    percentiles,
    relative_change,
    summarize,
)
from specserve.server.metrics import SpecCounters, parse_spec_counters


@dataclass(frozen=True)
class ServeTarget:
    """Where and what to send."""

    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"  # or "chat"
    max_tokens: int = 128
    temperature: float = 0.0
    api_key: str | None = None
    ignore_eos: bool = False  # a common server extension: always generate max_tokens
    timeout_s: float = 600.0

    @property
    def root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        """(url, JSON body) of one streaming request asking for usage in the last chunk."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            return f"{self.root}/v1/chat/completions", {**body, "messages": prompt.as_messages()}
        assert self.endpoint == "completions", self.endpoint
        return f"{self.root}/v1/completions", {**body, "prompt": prompt.as_text()}


@dataclass
class RequestResult:
    """One request's measurements (seconds, relative to its send time)."""

    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0  # from usage.completion_tokens
    cached_tokens: int = 0  # from usage.prompt_tokens_details.cached_tokens (prefix cache)
    num_chunks: int = 0  # stream chunks carrying text
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (generated tokens - 1); None with fewer than two tokens."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completions (choice.text) or chat (choice.delta.content) chunk carries."""
    parts = [(c.get("delta") or {}).get("content") or c.get("text") for c in chunk["choices"]]
    return "".join(p for p in parts if isinstance(p, str))


async def send_request(
    client: httpx.AsyncClient, target: ServeTarget, prompt: Prompt
) -> RequestResult:
    """Stream one request and time it. Failures come back as ok=False with the reason."""
    url, body = target.request(prompt)
    res = RequestResult()
    start = time.perf_counter()
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body, headers=target.headers()) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                now = time.perf_counter()
                if _chunk_text({"choices": [], **chunk}):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.num_chunks += 1
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.e2e_s = time.perf_counter() - start
    if usage is None:
        res.error = "no usage in the stream: the server must honour stream_options.include_usage"
        return res
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.output_tokens = int(usage.get("completion_tokens") or 0)
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    res.ok = True
    return res


async def _scrape(client: httpx.AsyncClient, target: ServeTarget) -> SpecCounters | None:
    try:
        resp = await client.get(f"{target.root}/metrics", headers=target.headers())
        return parse_spec_counters(resp.text) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text
        return None


async def _send_all(
    client: httpx.AsyncClient,
    target: ServeTarget,
    prompts: list[Prompt],
    arrivals: list[float],
    limit: int,
) -> list[RequestResult]:
    """Request i is sent at time arrivals[i] (perf_counter clock) once fewer than `limit` are in
    flight. All arrivals now with limit C is a closed loop of C clients; Poisson arrival times
    with a large limit is an open loop."""
    gate = asyncio.Semaphore(limit)  # FIFO: waiting requests go out in index order

    async def one(i: int, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        async with gate:
            return await send_request(client, target, prompts[i % len(prompts)])

    return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals))))


def _ms(values: list[float]) -> dict[str, float]:
    return {k: v * 1000.0 for k, v in percentiles(values).items()}


def summarize_point(
    mode: str, x: float, runs: list[tuple[list[RequestResult], float]], acceptance: dict | None
) -> dict[str, Any]:
    """One sweep point: throughput per repeat (mean, range, 95% CI over repeats) and latency
    percentiles pooled over every successful request of every repeat."""
    every = [r for results, _ in runs for r in results]
    ok = [r for r in every if r.ok]
    failed = [r for r in every if not r.ok]
    tok_s = [sum(r.output_tokens for r in res if r.ok) / dur for res, dur in runs]
    req_s = [sum(1 for r in res if r.ok) / dur for res, dur in runs]
    chunks = sum(r.num_chunks for r in ok)
    return {
        "mode": mode,
        "x": x,
        "repeats": len(runs),
        "num_requests": len(every),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error or "" for r in failed})[:5],
        "duration_s": [dur for _, dur in runs],
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tok_s": summarize(tok_s).to_dict(),
        "request_throughput": summarize(req_s).to_dict(),
        "ttft_ms": _ms([r.ttft_s for r in ok if r.num_chunks > 0]),
        "tpot_ms": _ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _ms([r.e2e_s for r in ok]),
        "tokens_per_chunk": sum(r.output_tokens for r in ok) / chunks if chunks else float("nan"),
        "acceptance": acceptance,
        "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in every],
    }


async def run_sweep(
    target: ServeTarget,
    prompts: list[Prompt],
    concurrencies: list[int] | None = None,
    request_rates: list[float] | None = None,
    num_requests: int = 64,
    repeats: int = 3,
    warmup_requests: int = 2,
    max_concurrency: int | None = None,
    seed: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every sweep point (`repeats` times each) and return one summary dict per point."""
    if (concurrencies is None) == (request_rates is None):
        raise ValueError("give exactly one of --concurrency or --request-rate")
    if not prompts:
        raise ValueError("the prompt set is empty; pass --prompts with at least one prompt")
    if num_requests < 1 or repeats < 1:
        raise ValueError(f"--num-requests/--repeats must be >= 1: {num_requests}, {repeats}")
    if concurrencies is not None:
        points = [("concurrency", float(c)) for c in concurrencies]
    else:
        points = [("request_rate", float(r)) for r in request_rates or []]
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), limits=limits) as client:
        # untimed warm-up (server-side compilation, connections); fail fast if nothing works
        warm_at = [time.perf_counter()] * warmup_requests
        warm = await _send_all(client, target, prompts, warm_at, max(1, warmup_requests))
        if warm and not any(r.ok for r in warm):
            raise ValueError(
                f"warm-up requests to {target.root} failed ({warm[0].error}); check --base-url, "
                "--model, --endpoint and --api-key"
            )
        for mode, x in points:
            before = await _scrape(client, target)
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if mode == "concurrency":
                    arrivals, limit = [t0] * num_requests, int(x)
                else:  # Poisson process: exponential gaps of mean 1 / rate
                    gaps = [rng.expovariate(x) for _ in range(num_requests - 1)]
                    arrivals = list(accumulate(gaps, initial=t0))
                    limit = max_concurrency or num_requests
                res = await _send_all(client, target, prompts, arrivals, limit)
                runs.append((res, time.perf_counter() - t0))
            after = await _scrape(client, target)
            acceptance = (after - before).acceptance() if before and after else None
            point = summarize_point(mode, x, runs, acceptance)
            if on_point is not None:
                on_point(point)
            out.append(point)
    return out


def log_points(
    exp_dir: str, label: str, config: dict[str, Any], points: list[dict], baseline: str | None
) -> str:
    """One LOG.md row + JSON record per point, then a throughput-vs-x plot; returns its path."""
    # (label, mode, x) -> mean tok/s of the latest logged serve point (later lines win)
    history = {
        (r.get("label"), r["point"]["mode"], r["point"]["x"]): r["point"]["output_tok_s"]["mean"]
        for r in read_results(exp_dir)
        if r.get("benchmark") == "serve"
    }
    for p in points:
        tok = p["output_tok_s"]
        base = history.get((baseline, p["mode"], p["x"]))
        change = "-" if not baseline else "no baseline" if base is None else ""
        row = {
            "benchmark": f"serve/{config['endpoint']}",
            "config": f"{label} {p['mode']}={p['x']:g} max_tokens={config['max_tokens']} "
            f"n={config['num_requests']}x{p['repeats']} prompts={config['prompts']}",
            "tok_s": format_range(tok["mean"], tok["min"], tok["max"]),
            "change": change or relative_change(tok["mean"], base or 0.0),
            "notes": _describe(p),
        }
        point = {k: v for k, v in p.items() if k != "requests"}
        record = {"benchmark": "serve", "label": label, "config": config, "point": point}
        append_result(exp_dir, record, row)
    mode = points[0]["mode"]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return plot_sweep(
        os.path.join(exp_dir, f"serve_{label}_{stamp}.png"),
        [p["x"] for p in points],
        {label: [p["output_tok_s"]["mean"] for p in points]},
        xlabel="concurrency" if mode == "concurrency" else "request rate (req/s)",
        ylabel="output tok/s",
        title=f"{config['model']} ({config['endpoint']}, max_tokens={config['max_tokens']})",
    )


def _describe(p: dict[str, Any]) -> str:
    """Latency and acceptance of one point in a line (stdout and the LOG.md notes)."""
    al = f"AL {p['acceptance']['mean_acceptance_length']:.2f}; " if p["acceptance"] else ""
    if p.get("cached_prompt_tokens"):
        al += f"{100 * p['cached_prompt_tokens'] / p['prompt_tokens']:.0f}% prompt tokens cached; "
    ttft, tpot, itl = p["ttft_ms"], p["tpot_ms"], p["itl_ms"]
    return (
        f"{al}TTFT p50/p99 {ttft['p50']:.1f}/{ttft['p99']:.1f} ms; TPOT p50/p99 "
        f"{tpot['p50']:.2f}/{tpot['p99']:.2f} ms; ITL p50 {itl['p50']:.2f} ms; "
        f"{p['request_throughput']['mean']:.2f} req/s; failed {p['failed']}/{p['num_requests']}"
    )


def _print_point(p: dict[str, Any]) -> None:
    tok = p["output_tok_s"]
    rng = format_range(tok["mean"], tok["min"], tok["max"])
    print(f"{p['mode']}={p['x']:g}: out tok/s {rng}; {_describe(p)}", flush=True)
    if p["errors"]:
        print(f"  first error: {p['errors'][0]}", flush=True)


def _resolve_model(target: ServeTarget) -> str:
    try:
        resp = httpx.get(f"{target.root}/v1/models", headers=target.headers(), timeout=30)
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        msg = f"could not list models at {target.root}/v1/models ({err}); pass --model"
        raise ValueError(msg) from None


def run(args: argparse.Namespace) -> int:
    if args.start_server is not None:
        from specserve.bench.server_proc import started_server

        with started_server(args.start_server) as url:
            args.base_url, args.start_server = url, None
            return run(args)
    rates, concs = args.request_rate, args.concurrency  # lists, checked by the parser
    if rates and concs:
        raise ValueError("pass either --concurrency or --request-rate, not both")
    if not rates and not concs:
        concs = [1, 2, 4, 8]
    prompts = load_prompts(args.prompts)
    target = ServeTarget(
        args.base_url, args.model or "", args.endpoint, args.max_tokens, args.temperature,
        args.api_key, args.ignore_eos, args.timeout,
    )  # fmt: skip
    if not args.model:
        target = replace(target, model=_resolve_model(target))
    sweep = run_sweep(
        target, prompts, concs, rates, args.num_requests, args.repeats, args.warmup_requests,
        args.max_concurrency, args.seed, _print_point,
    )  # fmt: skip
    points = asyncio.run(sweep)
    if args.log:
        skip = ("func", "api_key", "log")
        config = {k: v for k, v in vars(args).items() if k not in skip} | {"model": target.model}
        png = log_points(args.exp_dir, args.label, config, points, args.baseline)
        print(f"logged {len(points)} point(s) to {args.exp_dir}; plot {png}")
    return 0 if all(p["completed"] for p in points) else 1
