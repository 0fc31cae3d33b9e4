"""The OpenAI-compatible HTTP server (`specserve serve`).

Every error leaves as the OpenAI envelope {"error": {message, type, param, code}}: 400 invalid
value (malformed JSON and a wrong Content-Type included), 401 bad, missing or duplicated key
(every route but /health when a key is set; checked before routing), 404 unknown model or route
(trailing-slash paths included: no redirects), 408 headers or body too slow, 413 body over the
cap, 429 waiting queue full, 503 shutting down, engine dead or stalled, or too many
connections, 504 past the per-request deadline (429/503 carry Retry-After). Messages quote a
client's values shortened (~100 characters); internal failures say only that (the log has the
details). Lengths: the prompt must leave room for one token; an explicit max_tokens that does
not fit beside it (in the context and in the KV pool) is a 400; an omitted one is clamped to
that room (at most 16 for completions). Temperatures below 1e-5 decode greedily. Streams: errors
knowable up front come before any 200 byte; a mid-stream error is one `data: {"error"...}` event
with no [DONE] after it; a normal stream ends with `data: [DONE]`. Shutdown (SIGTERM): admission
stops (503), in-flight requests get the drain timeout to finish, the rest are aborted with that
same error (an SSE error event, or a 503 with Retry-After), then the HTTP server closes.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.config import EngineConfig
from specserve.server import errors as E
from specserve.server import tokenize as T
from specserve.server.async_engine import AsyncEngine
from specserve.server.guard import (
    RETRY_AFTER_S,
    GuardMiddleware,
    guarded_protocol,
)
from specserve.server.handlers import INTERNAL_ERROR, Handler

log = logging.getLogger(__name__)
server_log = logging.getLogger("uvicorn.error")  # start-up / shutdown lines, beside uvicorn's
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_PENDING_BODY_BYTES = 64 << 20


def _error_response(err: E.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def drain_and_log(async_engine: AsyncEngine, timeout_s: float) -> None:
    """Stop admitting, let in-flight requests finish for timeout_s, abort the rest; log which."""
    finished, aborted = await async_engine.drain(timeout_s)
    if async_engine.failure is not None:
        server_log.error("shutdown: the engine failed; every request in flight was failed")
    elif finished:
        server_log.info("shutdown: all requests finished")
    else:
        server_log.warning(
            "shutdown: aborted %d request(s) still running after the %g s drain timeout",
            aborted,
            timeout_s,
        )


def build_app(
    async_engine: AsyncEngine,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | list[str] | None = None,
    drain_timeout_s: float = 30.0,
    body_timeout_s: float = 30.0,
    max_pending_body_bytes: int = DEFAULT_MAX_PENDING_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it on shutdown (after
    draining, unless the server drained it already: see DrainingServer). `model_name`: the
    id(s) clients may send; the first is the one responses report."""
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    names = names or [async_engine.model_name]
    handler = Handler(async_engine, names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        st = async_engine.stats()
        engine = async_engine.engine
        server_log.info(
            "serving %s: %s KV pages = %s tokens of KV capacity, %s CUDA graphs "
            "captured, max_model_len %d; %s; %s",
            " | ".join(names),
            st.get("kv_total_pages"),
            st.get("kv_token_capacity"),
            st.get("cuda_graphs", 0),
            async_engine.max_model_len,
            engine.config.spec.describe(),
            engine.generation_defaults.describe(),
        )
        yield
        if async_engine.drained is None:
            await drain_and_log(async_engine, drain_timeout_s)
        async_engine.shutdown()

    # no trailing-slash redirects: Starlette builds them from the client's Host header
    app = FastAPI(
        title="specserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        max_pending_body_bytes=max_pending_body_bytes,
    )

    @app.exception_handler(E.APIError)
    async def _api_error(request: Request, exc: E.APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = (
            f"no route {request.method} {E.echo(request.url.path)}"
            if exc.status_code in (404, 405)
            else "the request was refused"
        )
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(E.APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(E.APIError(500, INTERNAL_ERROR, type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if async_engine.healthy:
            return JSONResponse({"status": "ok"})
        state = "draining" if async_engine.failure is None else "engine stopped"
        return JSONResponse(
            {"status": state}, status_code=503, headers={"Retry-After": RETRY_AFTER_S}
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        created = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": served,
                        "object": "model",
                        "created": created,
                        "owned_by": "specserve",
                        "max_model_len": async_engine.max_model_len,
                    }
                    for served in names
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(async_engine.registry), media_type=CONTENT_TYPE_LATEST)

    app.post("/v1/completions")(handler.completions)
    app.post("/v1/chat/completions")(handler.chat)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await T.tokenize(handler, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await T.detokenize(handler, request)

    app.get("/version")(T.version)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn, with our shutdown order: a signal stops admission at once (503); shutdown then
    drains the engine (finishing or aborting every request, whose handlers answer with the
    documented errors) before uvicorn closes the connections."""

    def __init__(
        self, async_engine: AsyncEngine, config: uvicorn.Config, drain_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.async_engine.begin_drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:  # stop accepting; uvicorn's shutdown repeats this
            server.close()
        if self.async_engine.drained is None:
            await drain_and_log(self.async_engine, self.drain_timeout_s)
        await super().shutdown(sockets)


def build_server(
    async_engine: AsyncEngine,
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout_s: float = 30.0,
    header_timeout_s: float = 10.0,
    max_connections: int = 1024,
    log_level: str = "info",
) -> DrainingServer:
    """The HTTP server for `app`: the guarded h11 protocol (header deadline, connection cap),
    bounded header size, and our drain-first shutdown."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(header_timeout_s, max_connections),
        h11_max_incomplete_event_size=16 << 10,
        timeout_keep_alive=5,
        # by the time uvicorn waits for connections every request has ended (drained or
        # aborted): what is left is writing the last bytes
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(async_engine, config, drain_timeout_s)


# ---------------------------------------------------------------------------------------------
# `specserve serve` (flags: specserve/cli/commands.py)


def serve(
    config: EngineConfig,
    names: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    drain_timeout: float = 30.0,
    header_timeout: float = 10.0,
    body_timeout: float = 30.0,
    request_timeout: float = 0.0,
    max_connections: int = 1024,
    engine_process: bool = True,
) -> int:
    """Build the engine and serve it until SIGTERM / SIGINT; the exit status. engine_process:
    the engine core runs in its own process (engine/core_proc.py), else in a thread here."""
    from specserve.engine.engine import Engine

    max_body_bytes = max_body_bytes or DEFAULT_MAX_BODY_BYTES
    if engine_process:
        from specserve.engine.core_client import RemoteEngine

        engine: Any = RemoteEngine(config, stall_timeout_s=config.parallel.step_timeout_s or 1e9)
    else:
        engine = Engine(config)
    # the watchdog's deadline is the engine's --step-timeout-s: a step past it fails every
    # request, turns /health 503 and stops the server (exit 1)
    async_engine = AsyncEngine(engine, request_timeout_s=request_timeout)
    app = build_app(async_engine, api_key, max_body_bytes, names, drain_timeout, body_timeout)
    server = build_server(async_engine, app, host, port, drain_timeout, header_timeout,
                          max_connections)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown; a no-op handler in
    # place by then turns that into a normal return, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    async_engine.on_failure = lambda exc: setattr(server, "should_exit", True)  # fail fast
    try:
        server.run()
    finally:
        engine.close()
    return 0 if async_engine.failure is None else 1
