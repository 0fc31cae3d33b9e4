"""What the server checks before a request reaches a route: the API key, the body (size, time,
memory) and, at the HTTP protocol, the connection count and the time to send the headers.

    connection  -> GuardedH11Protocol: over the connection cap: 503; headers not complete
                   within header_timeout_s of the connection opening (or of the last response
                   on a kept-alive connection): 408 and close (slowloris)
    headers     -> GuardMiddleware: one `Authorization: Bearer KEY` (a duplicate header is
                   refused; constant-time compare), then the body: Content-Length over the
                   cap: 413 without keeping it (a body up to DRAIN_MAX_BYTES past the cap is
                   read and dropped first, so the client gets the answer rather than a
                   reset); streamed bytes over the cap: 413 likewise; the whole body
                   not in within body_timeout_s: 408 and close; bodies being received holding
                   more than max_pending_body_bytes together: 503
Every refusal is the OpenAI error envelope; those sent mid-request close the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os

import anyio
import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server import errors as E

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
CLOSE = {"Connection": "close"}
# a body over the cap is read and dropped (this much at most, for this long) before the 413,
# so that the client reads the answer: closing a socket with unread bytes resets it instead
DRAIN_MAX_BYTES = 8 << 20
DRAIN_TIMEOUT_S = 2.0
API_KEY_ENV = "SPECSERVE_API_KEY"


async def send_error(err: E.APIError, send: Send) -> None:
    """Answer an ASGI request with the error envelope (its headers included)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """API key, then the body read under its caps, before routing or JSON parsing.

    The body is read here (counting streamed bytes, not trusting Content-Length alone) and
    replayed to the app; later receive() calls go to the server, so disconnects still arrive.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float = 30.0,
        max_pending_body_bytes: int = 64 << 20,
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_pending_body_bytes = max_pending_body_bytes
        self.pending_body_bytes = 0  # bytes held by bodies still being received (one loop)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        err = self._check_key(scope["path"], auth)
        body = b""
        if err is None:
            try:
                body = await self._read_body(receive, length)
            except E.APIError as exc:
                err = exc
        if err is not None:
            return await send_error(err, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_key(self, path: str, auth: list[bytes]) -> E.APIError | None:
        if self.key is None or path == "/health":
            return None
        if len(auth) > 1:
            return _key_error(f"{len(auth)} Authorization headers; send exactly one")
        scheme, _, token = (auth[0] if auth else b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return _key_error(
            f"{'missing' if not auth else 'invalid'} API key: send the server's "
            "key as the header 'Authorization: Bearer <key>'"
        )

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes:
        too_large = E.APIError(
            413,
            f"request body over {self.max_body_bytes} bytes; send a smaller request",
            code="request_too_large",
            headers=CLOSE,
        )
        declared = int(content_length) if content_length and content_length.isdigit() else 0
        if declared > self.max_body_bytes:
            if declared <= self.max_body_bytes + DRAIN_MAX_BYTES:
                await _discard(receive, declared)
            raise too_large
        chunks: list[bytes] = []
        held = 0
        try:
            with anyio.fail_after(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                    chunk = message.get("body", b"")
                    if held + len(chunk) > self.max_body_bytes:
                        if message.get("more_body", False):
                            await _discard(receive, DRAIN_MAX_BYTES)
                        raise too_large
                    if self.pending_body_bytes + len(chunk) > self.max_pending_body_bytes:
                        raise E.APIError(
                            503,
                            "the server is receiving too many request bodies "
                            "at once; retry shortly",
                            type="service_unavailable",
                            code="server_busy",
                            headers={"Retry-After": RETRY_AFTER_S, **CLOSE},
                        )
                    held += len(chunk)
                    self.pending_body_bytes += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise E.APIError(
                408,
                f"the request body did not arrive within "
                f"{self.body_timeout_s:g} s; send it at once",
                code="request_timeout",
                headers=CLOSE,
            ) from None
        finally:
            self.pending_body_bytes -= held
        return b"".join(chunks)


async def _discard(receive: Receive, budget: int) -> None:
    """Read and drop up to `budget` bytes of the request body, for DRAIN_TIMEOUT_S at most."""
    with anyio.move_on_after(DRAIN_TIMEOUT_S):
        while budget > 0:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            budget -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _key_error(message: str) -> E.APIError:
    # OpenAI answers a bad key with type invalid_request_error, code invalid_api_key
    return E.APIError(401, message, code="invalid_api_key")


def resolve_api_key(
    key: str | None, key_file: str | None, environ: dict[str, str] | None = None
) -> str | None:
    """The server's key from exactly one of --api-key, --api-key-file, $SPECSERVE_API_KEY;
    None when none is given. ValueError for an empty key or more than one source."""
    env = os.environ if environ is None else environ
    sources = {
        "--api-key": key,
        "--api-key-file": key_file,
        f"${API_KEY_ENV}": env.get(API_KEY_ENV),
    }
    given = {name: value for name, value in sources.items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"the API key is given by {' and '.join(given)}; give exactly one")
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "--api-key-file":
        try:
            with open(value, encoding="utf-8") as fh:
                value = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {value}: cannot read it ({exc.strerror})") from None
    if not value.strip():
        raise ValueError(f"{name} is empty: give a non-empty key, or none to serve without one")
    if value != value.strip() or any(c.isspace() for c in value):
        raise ValueError(f"{name} holds whitespace; a key is one token")
    return value


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


# ---------------------------------------------------------------------------------------------
# The HTTP protocol: connection cap and header timeout (before any ASGI code runs)


def _raw_error(status: int, reason: str, err: E.APIError) -> bytes:
    body = json.dumps(err.body()).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    head += [f"{k}: {v}" for k, v in err.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _over_capacity_app(limit: int) -> ASGIApp:
    err = E.APIError(
        503,
        f"the server holds its maximum of {limit} connections; retry shortly",
        type="service_unavailable",
        code="too_many_connections",
        headers={"Retry-After": RETRY_AFTER_S, **CLOSE},
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(err, send)

    return app


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap (0 = no cap)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _bytes_since_armed = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections and len(self.connections) > max_connections:
                # answered once its headers are in (closing at once would reset the socket
                # under the client's write, hiding the answer)
                self.app = _over_capacity_app(max_connections)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            self._bytes_since_armed += len(data)
            super().data_received(data)
            if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()  # the request line and headers are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the next request on this connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._bytes_since_armed = 0
            if header_timeout_s > 0 and math.isfinite(header_timeout_s):
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if not self._bytes_since_armed:  # an idle connection: close it, as keep-alive does
                self.transport.close()
                return
            err = E.APIError(
                408,
                f"the request headers did not arrive within {header_timeout_s:g} s",
                code="request_timeout",
            )
            self.transport.write(_raw_error(408, "Request Timeout", err))
            self.transport.close()

    return GuardedH11Protocol


def check_serve_limits(host: str, api_key: str | None, timeouts: dict[str, float],
                       max_connections: int, max_body_bytes: int) -> None:
    """ValueError (one line, before the model loads) for a bad server limit."""
    for flag, value in timeouts.items():
        if not value >= 0:
            raise ValueError(f"--{flag} must be >= 0 seconds, got {value}")
    if max_connections < 0:
        raise ValueError(f"--max-connections must be >= 0 (0 = no cap), got {max_connections}")
    if max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
    if api_key is None and not is_loopback(host):
        logging.getLogger("uvicorn.error").warning(  # the server log, beside uvicorn's
            "serving on %s without an API key: anyone who reaches this address "
            "can use the server; set --api-key-file or $SPECSERVE_API_KEY",
            host,
        )
