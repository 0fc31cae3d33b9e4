"""AsyncEngine: one background thread owns the (not thread-safe) Engine; asyncio code talks to it.

    event loop(s)                         engine thread
    add_request / abort / call  -- commands (SimpleQueue) -->  drained between steps
    RequestStream (asyncio.Queue) <-- loop.call_soon_threadsafe(push, output) --  step()

The engine thread loops `engine.step()` while work exists and sleeps on an event when idle. A
consumer that goes away (client disconnect) closes its stream, which sends an abort: the engine
frees the request's KV before its next step. Errors of `Engine.add_request` (ValueError,
QueueFullError) are raised to the awaiting caller, before any output exists.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from specserve.engine.engine import Engine, RequestOutput
from specserve.engine.scheduler import QueueFullError
from specserve.sampling_params import SamplingParams
from specserve.server.metrics import EngineMetrics

log = logging.getLogger(__name__)
_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


_CLOSED = RuntimeError("stream closed")  # queue sentinel: the consumer closed the stream


class EngineDeadError(RuntimeError):
    """The engine thread died: in-flight and new requests fail (the server answers 503)."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: it admits no new requests (the server answers 503)."""


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self._owner = owner
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
            self._owner.abort(self.request_id)
            self._queue.put_nowait(_CLOSED)


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int | None = None,
                 idle_wait_s: float = 1.0) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()  # one per server: /metrics renders it
        self.metrics = EngineMetrics(self.registry)
        self.max_waiting = max_waiting or engine.config.scheduler.max_waiting
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats: dict[str, Any] = engine.stats()  # snapshot, replaced after each step
        self._spec_seen: dict[str, Any] = {}
        self._draining = False
        self._stop = False
        self._dead: BaseException | None = None
        # called on the engine thread if it dies (the server uses it to exit non-zero)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    # -- read-only views of the engine --------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and not self._draining

    @property
    def failure(self) -> BaseException | None:
        """What killed the engine thread, if it died."""
        return self._dead

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step or command (safe from any thread)."""
        return dict(self._stats, num_in_flight=len(self._live))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight get EngineDrainingError."""
        self._draining = True
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def begin_drain(self) -> None:
        """Stop admitting new requests (they get EngineDrainingError); in-flight ones go on."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting, wait up to timeout_s for in-flight requests; True if all finished.
        Whatever is left is aborted (its consumers see EngineDrainingError)."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self._live and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        drained = not self._live
        if not drained and self._thread.is_alive():
            await asyncio.wrap_future(self._submit_call(self._abort_all))
        return drained

    # -- submission (any thread / event loop) --------------------------------------------------
    def check_admission(self) -> None:
        """Fast refusal before any tokenization: dead, draining, or the waiting queue full."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        if self._draining:
            raise EngineDrainingError("the server is shutting down; retry on another replica")
        if self._stats.get("num_waiting", 0) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); "
                                 "retry later")

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> RequestStream:
        """Admit a request; raises ValueError / QueueFullError / EngineDrainingError up front."""
        self.check_admission()
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        stream = RequestStream(self, request_id, num_prompt)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._put(("add", stream, prompt, params, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been admitted before the cancel landed
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its outputs; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV is freed before the engine's next step."""
        self._put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self._submit_call(fn))

    def call_sync(self, fn: Callable[[Engine], Any], timeout_s: float = 30.0) -> Any:
        """Blocking form of `call`, for threads that are not the engine's."""
        return self._submit_call(fn).result(timeout_s)

    def _submit_call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def _put(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        self._wake.set()
        if self._dead is not None:  # the engine died meanwhile: nobody will run the command
            self._fail_pending()

    def _fail_pending(self) -> None:
        """Fail the futures of commands the engine thread will never run (any thread)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            fut = cmd[-1] if cmd[0] != "abort" else None
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine stopped: {self._dead!r}"))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()  # before draining: a later submit re-sets it
                self._drain_commands()
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                    self._sample_stats()
                else:
                    self._wake.wait(self._idle_wait_s)
            self._drain_commands()
            self._abort_all(self.engine)
        except BaseException as exc:  # the engine is unusable: fail everything, /health -> 503
            log.exception("engine thread died")
            self._dead = exc
            for stream in list(self._live.values()):
                self._send(stream, EngineDeadError(f"the engine stopped: {exc!r}"))
            self._live.clear()
            self._fail_pending()
            if self.on_failure is not None:
                self.on_failure(exc)

    def _drain_commands(self) -> None:
        changed = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            changed = True
            if cmd[0] == "add":
                self._do_add(*cmd[1:])
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            else:
                _, fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except Exception as exc:
                        fut.set_exception(exc)
        if changed:
            self._sample_stats()

    def _do_add(self, stream: RequestStream, prompt: str | list[int], params: SamplingParams,
                fut: concurrent.futures.Future[None]) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the caller went away before admission
        try:
            self.engine.add_request(stream.request_id, prompt, params)
        except Exception as exc:  # ValueError, QueueFullError: the caller's problem
            fut.set_exception(exc)
            return
        self._live[stream.request_id] = stream
        fut.set_result(None)

    def _do_abort(self, request_id: str) -> None:
        stream = self._live.pop(request_id, None)
        if stream is None:
            return  # finished (or never admitted) already
        self.engine.abort_request(request_id)
        self.metrics.record_abort(stream.num_prompt_tokens, stream.num_output_tokens)

    def _abort_all(self, engine: Engine) -> None:
        for request_id, stream in list(self._live.items()):
            self._do_abort(request_id)
            self._send(stream, EngineDrainingError("the server shut down before the request "
                                                   "finished; retry it"))

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.push, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            stream.num_prompt_tokens = out.num_prompt_tokens
            stream.num_output_tokens = out.num_output_tokens
            if stream.t_first is None and out.new_token_ids:
                stream.t_first = now
            if not self._send(stream, out):
                self._do_abort(out.request_id)
                continue
            if out.finished:
                del self._live[out.request_id]
                self._record_finish(stream, out, now)

    def _record_finish(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        if out.finish_reason in ("stop", "length"):
            ttft = None if stream.t_first is None else stream.t_first - stream.t_arrival
            self.metrics.record_request(out.finish_reason, out.num_prompt_tokens,
                                        out.num_output_tokens, ttft, now - stream.t_arrival)
        else:
            self.metrics.record_abort(out.num_prompt_tokens, out.num_output_tokens)

    def _sample_stats(self) -> None:
        stats = self.engine.stats()
        self._stats = stats
        self.metrics.set_scheduler_state(stats.get("num_running", 0), stats.get("num_waiting", 0),
                                         float(stats.get("kv_usage", 0.0)))
        # speculation counters: the engine's are cumulative; the metrics take deltas
        m = self.metrics
        for key, counter in zip(_SPEC_COUNTERS, (m.spec_num_drafts, m.spec_num_draft_tokens,
                                                 m.spec_num_accepted)):
            if key in stats:
                delta = stats[key] - self._spec_seen.get(key, 0)
                if delta > 0:
                    counter.inc(delta)
                self._spec_seen[key] = stats[key]
        per_pos = list(stats.get("accepted_per_pos") or [])
        seen = self._spec_seen.get("accepted_per_pos", [])
        for pos, value in enumerate(per_pos):
            delta = value - (seen[pos] if pos < len(seen) else 0)
            if delta > 0:
                m.spec_accepted_per_pos.labels(position=str(pos)).inc(delta)
        self._spec_seen["accepted_per_pos"] = per_pos
