"""The OpenAI-compatible HTTP server (`specserve serve`).

Every error leaves as the OpenAI envelope {"error": {message, type, param, code}}: 400 invalid
value (malformed JSON and a wrong Content-Type included), 401 bad or missing key (every route but
/health when --api-key is set; checked before routing), 404 unknown model or route, 413 body over
the cap, 429 waiting queue full, 503 shutting down or engine dead (429/503 carry Retry-After).
Lengths: the prompt must leave room for one token; an explicit max_tokens that does not fit beside
it is a 400; an omitted one is clamped to the room left (at most 16 for completions). Streams:
errors knowable up front come before any 200 byte; a mid-stream error is one `data: {"error"...}`
event with no [DONE] after it; a normal stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.config import EngineConfig
from specserve.engine.engine import RequestOutput
from specserve.engine.scheduler import QueueFullError
from specserve.sampling_params import SamplingParams
from specserve.server import protocol as P
from specserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    RequestStream,
)

log = logging.getLogger(__name__)
server_log = logging.getLogger("uvicorn.error")  # start-up / shutdown lines, beside uvicorn's
DEFAULT_MAX_BODY_BYTES = 8 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = "1"


def _error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _GuardMiddleware:
    """API key (constant-time compare) then body cap, before routing or JSON parsing.

    The body is read here (counting streamed bytes, not trusting Content-Length alone) and
    replayed to the app; later receive() calls go to the server, so disconnects still arrive.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        err = self._check_key(scope["path"], headers.get("authorization"))
        body = b""
        if err is None:
            try:
                body = await self._read_body(receive, headers.get("content-length"))
            except P.APIError as exc:
                err = exc
        if err is not None:
            return await _error_response(err)(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_key(self, path: str, auth: bytes | None) -> P.APIError | None:
        if self.key is None or path == "/health":
            return None
        scheme, _, token = (auth or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return P.APIError(401, f"{'missing' if auth is None else 'invalid'} API key: send the "
                          "server's key as the header 'Authorization: Bearer <key>'",
                          type="authentication_error", code="invalid_api_key")

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes:
        too_large = P.APIError(413, f"request body over {self.max_body_bytes} bytes; send a "
                               "smaller request", code="request_too_large")
        declared = int(content_length) if content_length and content_length.isdigit() else 0
        if declared > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


class _SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client leaving (whatever the ASGI spec
    version): a disconnect cancels the body iterator, whose `finally` aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close  # also covers a client gone before the body iterator started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()  # runs its `finally` now, not at garbage collection
        self.on_close()


def _sse(payload: P.ResponseBody | dict[str, Any] | str) -> str:
    if isinstance(payload, P.ResponseBody):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Handler:
    """The generation endpoints: validate, tokenize, admit, then stream or collect."""

    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names
        self.model_name = model_names[0]  # what responses report
        self.vocab_size = engine.engine.model_config.vocab_size
        self.defaults = engine.engine.generation_defaults.params

    def admit_fast(self, req: P.CommonRequest) -> None:
        if req.model is not None and req.model not in self.model_names:
            raise P.APIError(404, f"model {req.model[:100]!r} not found; this server serves "
                             f"{' | '.join(map(repr, self.model_names))} (GET /v1/models)",
                             param="model", code="model_not_found")
        try:
            self.engine.check_admission()
        except (QueueFullError, EngineDrainingError, EngineDeadError) as exc:
            raise _overload(exc) from None

    async def encode(self, fn: Callable[..., list[int]], arg: Any, param: str) -> list[int]:
        try:
            return list(await asyncio.to_thread(fn, arg))
        except Exception as exc:  # e.g. a chat template refusing the conversation
            raise P.bad_request(f"could not tokenize {param}: {exc}", param) from None

    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = P.parse_request(
            await request.body(), request.headers.get("content-type", ""), P.CompletionRequest)
        self.admit_fast(req)
        prompt = req.single_prompt(self.vocab_size)
        if isinstance(prompt, str):
            ids = await self.encode(self.engine.tokenizer.encode, prompt, "prompt")
        else:
            ids = prompt
        params = req.build_params(req.max_tokens, len(ids), self.engine.max_model_len,
                                  self.vocab_size, COMPLETION_DEFAULT_MAX_TOKENS, "prompt",
                                  self.defaults)
        return await self._run(request, req, P.new_id("cmpl"), ids, params, chat=False)

    async def chat(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = P.parse_request(
            await request.body(), request.headers.get("content-type", ""), P.ChatCompletionRequest)
        self.admit_fast(req)
        messages = req.chat_messages()
        ids = await self.encode(self.engine.tokenizer.apply_chat_template, messages, "messages")
        params = req.build_params(req.requested_max_tokens(), len(ids), self.engine.max_model_len,
                                  self.vocab_size, None, "messages", self.defaults)
        return await self._run(request, req, P.new_id("chatcmpl"), ids, params, chat=True)

    async def _run(self, request: Request, req: P.CommonRequest, rid: str, ids: list[int],
                   params: SamplingParams, chat: bool) -> Response:
        try:
            stream = await self.engine.add_request(rid, ids, params)
        except (QueueFullError, EngineDrainingError, EngineDeadError) as exc:
            raise _overload(exc) from None
        except ValueError as exc:
            raise P.bad_request(str(exc)) from None
        if req.stream:
            return _SSEResponse(self._events(stream, rid, chat, req.include_usage), stream.close)
        return await self._collect(request, stream, rid, chat)

    async def _collect(self, request: Request, stream: RequestStream, rid: str,
                       chat: bool) -> Response:
        async def close_on_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stream.close()  # aborts the request and ends the iteration below

        watcher = asyncio.create_task(close_on_disconnect())
        texts: list[str] = []
        last: RequestOutput | None = None
        try:
            async for out in stream:
                texts.append(out.new_text)
                last = out
        except (EngineDrainingError, EngineDeadError) as exc:
            raise _overload(exc) from None
        finally:
            watcher.cancel()
            stream.close()
        if last is None or not last.finished:
            return Response(status_code=499)  # the client left; nobody reads this
        if last.finish_reason not in ("stop", "length"):
            raise P.APIError(503, "the request was aborted; retry it", type="server_error",
                             code="aborted")
        body = P.full_response(chat, rid, self.model_name, "".join(texts), last.finish_reason,
                               P.Usage.of(last.num_prompt_tokens, last.num_output_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _events(self, stream: RequestStream, rid: str, chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(text: str | None, finish: str | None = None, usage: P.Usage | None = None,
                  role: bool = False) -> str:
            return _sse(P.stream_chunk(chat, rid, self.model_name, created, text, finish, usage,
                                       role))

        try:
            if chat:
                yield chunk("", role=True)
            last: RequestOutput | None = None
            async for out in stream:
                last = out
                if out.finished and out.finish_reason not in ("stop", "length"):
                    yield _sse(P.error_body("the request was aborted", "server_error", None,
                                            "aborted"))
                    return
                if out.new_text or out.finished:
                    yield chunk(out.new_text, out.finish_reason if out.finished else None)
            if last is None:
                return  # closed without output: the client left
            if include_usage:
                yield chunk(None, usage=P.Usage.of(last.num_prompt_tokens, last.num_output_tokens))
            yield _sse("[DONE]")
        except (EngineDrainingError, EngineDeadError) as exc:
            yield _sse(_overload(exc).body())
        except Exception as exc:  # a server bug: report it in-band, the status is already 200
            log.exception("stream %s failed", rid)
            yield _sse(P.error_body(f"internal error: {exc!r}", "server_error", None, 500))
        finally:
            stream.close()


def _overload(exc: Exception) -> P.APIError:
    retry = {"Retry-After": RETRY_AFTER_S}
    if isinstance(exc, QueueFullError):
        return P.APIError(429, str(exc) or "the waiting queue is full; retry later",
                          type="rate_limit_error", code="queue_full", headers=retry)
    code = "shutting_down" if isinstance(exc, EngineDrainingError) else "engine_dead"
    return P.APIError(503, str(exc), type="service_unavailable", code=code, headers=retry)


def build_app(async_engine: AsyncEngine, api_key: str | None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              model_name: str | list[str] | None = None,
              drain_timeout_s: float = 30.0) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and drains it on shutdown.
    `model_name`: the id(s) clients may send; the first is the one responses report."""
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    names = names or [async_engine.model_name]
    handler = _Handler(async_engine, names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        st = async_engine.stats()
        engine = async_engine.engine
        server_log.info("serving %s: %s KV pages = %s tokens of KV capacity, %s CUDA graphs "
                        "captured, max_model_len %d; %s; %s", " | ".join(names),
                        st.get("kv_total_pages"), st.get("kv_token_capacity"),
                        st.get("cuda_graphs", 0), async_engine.max_model_len,
                        engine.config.spec.describe(), engine.generation_defaults.describe())
        yield
        drained = await async_engine.drain(drain_timeout_s)
        server_log.info("shutdown: %s", "all requests finished" if drained else "aborted the rest")
        async_engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(P.APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(P.APIError(500, f"internal error: {exc!r}", type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if async_engine.healthy:
            return JSONResponse({"status": "ok"})
        state = "draining" if async_engine.draining else "engine stopped"
        return JSONResponse({"status": state}, status_code=503,
                            headers={"Retry-After": RETRY_AFTER_S})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": n, "object": "model", "created": int(time.time()), "owned_by": "specserve",
            "max_model_len": async_engine.max_model_len} for n in names]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(async_engine.registry), media_type=CONTENT_TYPE_LATEST)

    app.post("/v1/completions")(handler.completions)
    app.post("/v1/chat/completions")(handler.chat)
    return app


# ---------------------------------------------------------------------------------------------
# `specserve serve` (flags: specserve/cli/commands.py)


def serve(config: EngineConfig, names: list[str], host: str, port: int, api_key: str | None,
          max_body_bytes: int | None, drain_timeout: float) -> int:
    """Build the engine and serve it until SIGTERM / SIGINT; the exit status."""
    from specserve.engine.engine import Engine

    max_body_bytes = max_body_bytes or DEFAULT_MAX_BODY_BYTES
    async_engine = AsyncEngine(Engine(config))
    app = build_app(async_engine, api_key, max_body_bytes, names, drain_timeout)
    server = _DrainingServer(async_engine, uvicorn.Config(
        app, host=host, port=port, log_level="info",
        timeout_graceful_shutdown=int(math.ceil(drain_timeout)) + 1))
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown; a no-op handler in
    # place by then turns that into a normal return, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    async_engine.on_failure = lambda exc: setattr(server, "should_exit", True)  # fail fast
    server.run()
    return 0 if async_engine.failure is None else 1


class _DrainingServer(uvicorn.Server):
    """A uvicorn server that stops admitting (503) the moment a shutdown signal arrives."""

    def __init__(self, async_engine: AsyncEngine, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.async_engine.begin_drain()
        super().handle_exit(sig, frame)
