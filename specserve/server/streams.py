"""A request's output stream and the errors the engine thread hands its consumer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from specserve.engine.engine import RequestOutput

_CLOSED = RuntimeError("stream closed")  # queue sentinel: the consumer closed the stream


class EngineDeadError(RuntimeError):
    """The engine thread died: in-flight and new requests fail (the server answers 503)."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: it admits no new requests (the server answers 503)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's per-request deadline and was aborted."""


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request."""

    def __init__(
        self, abort: Callable[[str], None], request_id: str, num_prompt_tokens: int
    ) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self._abort = abort  # thread-safe: asks the engine thread to abort the request
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()  # or _CLOSED
        # engine-thread bookkeeping for metrics
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0

    def push(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's event loop (via call_soon_threadsafe)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent); a consumer waiting in
        `__anext__` (on this loop) stops iterating."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
            self._queue.put_nowait(_CLOSED)
