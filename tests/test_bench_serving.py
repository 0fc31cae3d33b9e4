"""`specserve bench serve` against a fake OpenAI-compatible server, and the server metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from cli_run import run_cli
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specserve.bench import serving
from specserve.bench.prompts import Prompt
from specserve.bench.stats import percentile
from specserve.server import metrics as m

KEY = "secret"
TOKENS_PER_CHUNK = 3  # every chunk is one draft-verify cycle: 2 drafts accepted + 1 bonus


def make_app() -> FastAPI:
    """Streams ceil(max_tokens / 3) chunks whose text ("ab") has nothing to do with the token
    count; the true count only arrives in the usage chunk. Each chunk records one speculation
    cycle (3 proposed, 2 accepted) on /metrics, after a history of 50 cycles accepting nothing."""
    app = FastAPI()
    registry = CollectorRegistry()
    engine_metrics = m.EngineMetrics(registry)
    engine_metrics.record_spec_step([0] * 50, 3)
    app.state.in_flight = app.state.max_in_flight = 0

    async def stream(body: dict, chat: bool, prompt: str):
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        try:
            left = body["max_tokens"]
            while left > 0:
                await asyncio.sleep(0.002)
                n = min(TOKENS_PER_CHUNK, left)
                left -= n
                engine_metrics.record_spec_step([n - 1], 3)
                choice = {"index": 0, "delta": {"content": "ab"}} if chat else {"text": "ab"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if prompt == "FAIL_MIDSTREAM":
                    yield 'data: {"error": {"message": "engine died", "code": 500}}\n\n'
                    return
            if prompt != "NO_USAGE":
                usage = {
                    "prompt_tokens": 5,
                    "completion_tokens": body["max_tokens"],
                    "prompt_tokens_details": {"cached_tokens": 4 if chat else 0},
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            app.state.in_flight -= 1

    async def handle(request: Request, chat: bool) -> Response:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": {"message": "bad key", "code": 401}}, status_code=401)
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        return StreamingResponse(stream(body, chat, prompt), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


@pytest.fixture(scope="module")
def fake() -> tuple[str, FastAPI]:
    app = make_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1000):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    server.should_exit = True
    thread.join(timeout=10)


def _target(url: str, **kw: object) -> serving.ServeTarget:
    return serving.ServeTarget(url, "fake-model", api_key=KEY, **kw)


async def _one(target: serving.ServeTarget, prompt: Prompt) -> serving.RequestResult:
    async with httpx.AsyncClient(timeout=30) as client:
        return await serving.send_request(client, target, prompt)


def test_tpot_comes_from_usage_not_chunks(fake) -> None:
    url, _ = fake
    for endpoint in ("completions", "chat"):
        r = asyncio.run(_one(_target(url, endpoint=endpoint, max_tokens=9), Prompt(text="hi")))
        assert r.ok and r.error is None
        assert (r.output_tokens, r.prompt_tokens, r.num_chunks, len(r.itl_s)) == (9, 5, 3, 2)
        assert r.cached_tokens == (4 if endpoint == "chat" else 0)
        assert 0 < r.ttft_s < r.e2e_s
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 8)  # 9 tokens, not 3 chunks


def test_failures_are_reported(fake) -> None:
    url, _ = fake
    target = _target(url, max_tokens=6)
    r = asyncio.run(_one(target, Prompt(text="NO_USAGE")))
    assert not r.ok and "include_usage" in r.error and r.tpot_s is None
    r = asyncio.run(_one(target, Prompt(text="FAIL_MIDSTREAM")))
    assert not r.ok and "engine died" in r.error
    r = asyncio.run(_one(serving.ServeTarget(url, "fake-model"), Prompt(text="hi")))
    assert not r.ok and r.error.startswith("HTTP 401")
    with pytest.raises(ValueError, match="--api-key"):
        asyncio.run(serving.run_sweep(serving.ServeTarget(url, "m"), [Prompt(text="x")], [1]))


def test_concurrency_sweep_numbers(fake) -> None:
    url, app = fake
    seen: list[int] = []

    def on_point(point: dict) -> None:
        seen.append(app.state.max_in_flight)
        app.state.max_in_flight = 0

    prompts = [Prompt(text="a"), Prompt(messages=({"role": "user", "content": "b"},))]
    sweep = serving.run_sweep(
        _target(url + "/v1/", max_tokens=9),
        prompts,
        [1, 2],
        num_requests=4,
        repeats=2,
        warmup_requests=1,
        on_point=on_point,
    )
    points = asyncio.run(sweep)
    assert [p["x"] for p in points] == [1, 2] and seen[0] == 1 and seen[1] <= 2
    for p in points:
        assert (p["mode"], p["completed"], p["failed"], p["repeats"]) == ("concurrency", 8, 0, 2)
        assert p["output_tokens"] == 8 * 9 and p["tokens_per_chunk"] == 3.0
        per_repeat = [36 / d for d in p["duration_s"]]
        assert p["output_tok_s"]["mean"] == pytest.approx(sum(per_repeat) / 2)
        assert p["output_tok_s"]["min"] == pytest.approx(min(per_repeat))
        tpots = [r["tpot_s"] for r in p["requests"]]
        for r in p["requests"]:
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 8)
        assert p["tpot_ms"]["p50"] == pytest.approx(1000 * percentile(tpots, 50))
        assert p["itl_ms"]["p99"] == pytest.approx(
            1000 * percentile([g for r in p["requests"] for g in r["itl_s"]], 99)
        )
        # isolated to this point: 8 requests x 3 cycles, each 2 of 3 drafts accepted; the
        # server's lifetime counters (50 earlier cycles accepting nothing) must not leak in
        acc = p["acceptance"]
        assert (acc["num_drafts"], acc["num_draft_tokens"], acc["num_accepted_tokens"]) == (
            24,
            72,
            48,
        )
        assert acc["mean_acceptance_length"] == 3.0
        assert acc["draft_acceptance_rate"] == pytest.approx(2 / 3)
        assert acc["per_position_acceptance"] == [1.0, 1.0]


def test_request_rate_mode(fake) -> None:
    url, _ = fake
    sweep = serving.run_sweep(
        _target(url, max_tokens=4),
        [Prompt(text="a")],
        None,
        [500.0, 50.0],
        num_requests=5,
        repeats=1,
        warmup_requests=0,
    )
    points = asyncio.run(sweep)
    assert [(p["mode"], p["x"], p["completed"]) for p in points] == [
        ("request_rate", 500.0, 5),
        ("request_rate", 50.0, 5),
    ]
    # 4 tokens = chunks of 3 + 1: cycles accepted 2 and 0 drafts
    acc = points[0]["acceptance"]
    assert acc["mean_acceptance_length"] == pytest.approx((5 * 2 + 10) / 10)
    assert acc["per_position_acceptance"] == [0.5, 0.5]


def _cli(argv: list[str]) -> argparse.Namespace:
    from specserve.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_cli_logs_rows_records_and_plot(fake, tmp_path, capsys) -> None:
    url, _ = fake
    exp = tmp_path / "experiments"
    common = [
        "serve",
        "--base-url",
        url,
        "--api-key",
        KEY,
        "--endpoint",
        "chat",
        "--prompts",
        "chat",
        "--max-tokens",
        "6",
        "--concurrency",
        "1,2",
        "--num-requests",
        "3",
        "--repeats",
        "2",
        "--warmup-requests",
        "1",
        "--log",
        "--exp-dir",
        str(exp),
    ]
    args = _cli([*common, "--label", "base"])
    assert args.func(args) == 0
    args = _cli([*common, "--label", "spec", "--baseline", "base"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("AL 3.00") == 4 and "plot" in out

    rows = [ln for ln in (exp / "LOG.md").read_text().splitlines() if "serve/chat" in ln]
    assert len(rows) == 4
    assert all("AL 3.00" in r and "failed 0/6" in r for r in rows)
    assert all("80% prompt tokens cached" in r for r in rows)  # 4 of 5 per chat request
    changes = [r.split("|")[7].strip() for r in rows]
    assert changes[:2] == ["-", "-"] and all(c.endswith("%") for c in changes[2:])
    recs = [json.loads(x) for x in (exp / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and [r["label"] for r in recs] == ["base", "base", "spec", "spec"]
    first = recs[0]
    assert first["config"]["model"] == "fake-model"  # resolved from /v1/models
    assert "api_key" not in first["config"] and KEY not in json.dumps(recs)
    assert "requests" not in first["point"] and first["point"]["output_tokens"] == 6 * 6
    assert first["point"]["acceptance"]["mean_acceptance_length"] == 3.0
    assert first["point"]["cached_prompt_tokens"] == 4 * 6
    assert first["versions"]["python"] and first["git_sha"]
    pngs = sorted(exp.glob("serve_*.png"))
    assert len(pngs) == 2 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--concurrency", "1,x"], "argument --concurrency: want comma-separated positive"),
        (["--concurrency", "0"], "argument --concurrency: want comma-separated positive"),
        (["--concurrency", "1", "--request-rate", "2"], "not both"),
        (["--max-tokens", "0"], "argument --max-tokens: must be >= 1"),
        (["--prompts", "nope"], "unknown prompt set"),
    ],
)
def test_cli_bad_input(extra: list[str], message: str, capsys) -> None:
    rc, err = run_cli(["bench", "serve", "--model", "m", *extra], capsys)
    assert rc == 2 and message in err, err


def test_metric_names_and_request_recording() -> None:
    registry = CollectorRegistry()
    em = m.EngineMetrics(registry)
    em.record_request("stop", prompt_tokens=7, generation_tokens=11, ttft_s=0.5, e2e_s=1.5)
    em.record_request("length", prompt_tokens=3, generation_tokens=1, ttft_s=0.2, e2e_s=0.2)
    em.record_abort(prompt_tokens=4, generation_tokens=2)
    em.set_scheduler_state(running=3, waiting=5, kv_cache_usage=0.25)
    get = registry.get_sample_value
    assert get(m.REQUEST_SUCCESS, {"finished_reason": "stop"}) == 1.0
    assert get(m.REQUEST_SUCCESS, {"finished_reason": "length"}) == 1.0
    assert (get(m.PROMPT_TOKENS), get(m.GENERATION_TOKENS), get(m.REQUEST_ABORTED)) == (14, 14, 1)
    assert get(m.TPOT + "_count") == 1.0 and get(m.TPOT + "_sum") == pytest.approx(0.1)
    assert get(m.TTFT + "_count") == 2.0 and get(m.E2E_LATENCY + "_sum") == pytest.approx(1.7)
    assert (get(m.NUM_RUNNING), get(m.NUM_WAITING), get(m.KV_CACHE_USAGE)) == (3, 5, 0.25)
    text = generate_latest(registry).decode()
    for name in (
        m.REQUEST_SUCCESS,
        m.SPEC_NUM_DRAFTS,
        m.SPEC_NUM_DRAFT_TOKENS,
        m.SPEC_NUM_ACCEPTED,
        m.SPEC_ACCEPTED_PER_POS,
        m.TTFT,
        m.KV_CACHE_USAGE,
    ):
        assert f"# TYPE {name} " in text


def test_spec_counters_against_naive_count() -> None:
    rng = random.Random(3)
    registry = CollectorRegistry()
    em = m.EngineMetrics(registry)
    steps = []
    for _ in range(20):
        drafted = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
        steps.append(([rng.randint(0, d) for d in drafted], drafted))
    before = m.parse_spec_counters(generate_latest(registry).decode())
    for accepted, drafted in steps:
        em.record_spec_step(accepted, drafted)
    after = m.parse_spec_counters(generate_latest(registry).decode())
    flat = [(a, d) for acc, dr in steps for a, d in zip(acc, dr)]
    drafts, proposed, accepted = len(flat), sum(d for _, d in flat), sum(a for a, _ in flat)
    depth = max(a for a, _ in flat)
    per_pos = [sum(1 for a, _ in flat if a > i) for i in range(depth)]
    delta = after - before
    assert (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted) == (
        drafts,
        proposed,
        accepted,
    )
    assert delta.accepted_per_pos == tuple(per_pos)
    acc = delta.acceptance()
    assert acc["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert acc["per_position_acceptance"] == pytest.approx([c / drafts for c in per_pos])
    # a chain accepts a prefix: position i+1 is never accepted more often than position i
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
    assert before.acceptance() is None  # no cycles yet
    assert (before - after).acceptance() is None  # counters went backwards (restart)
    assert m.parse_spec_counters("# nothing here\n") is None
    assert math.isclose(acc["draft_acceptance_rate"], accepted / proposed)
