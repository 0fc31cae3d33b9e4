"""AsyncEngine: one background thread owns the (not thread-safe) Engine; asyncio code talks to it.

    event loop(s)                         engine thread
    add_request / abort / call  -- commands (SimpleQueue) -->  drained between steps
    RequestStream (asyncio.Queue) <-- loop.call_soon_threadsafe(push, output) --  step()

The engine thread loops `engine.step()` while work exists and sleeps on an event when idle. A
consumer that goes away (client disconnect) closes its stream, which sends an abort: the engine
frees the request's KV before its next step. Errors of `Engine.add_request` (ValueError,
QueueFullError) are raised to the awaiting caller, before any output exists.

Metrics of a step (gauges, finished-request counters) are updated before its outputs go out,
so a client that has its answer sees them. A watchdog thread marks the engine dead when one
step (or command) runs past `watchdog_timeout_s`: /health turns 503, every in-flight request
fails, and `on_failure` runs (the server exits non-zero). With `request_timeout_s`, a request
still unfinished that long after arrival is aborted with RequestTimeoutError.
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
from specserve.engine.plan import QueueFullError
from specserve.sampling_params import SamplingParams
from specserve.server.metrics import EngineMetrics
from specserve.server.streams import (
    EngineDeadError,
    EngineDrainingError,
    RequestStream,
    RequestTimeoutError,
)

log = logging.getLogger(__name__)
# what clients are told; the cause goes to the log only
_DEAD = "the engine stopped; retry on another replica"
_STALLED = "the engine stopped responding; retry on another replica"


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_waiting: int | None = None,
        idle_wait_s: float = 1.0,
        watchdog_timeout_s: float | None = None,
        request_timeout_s: float = 0.0,
    ) -> None:
        self.engine = engine
        if watchdog_timeout_s is None:  # the engine's step deadline (--step-timeout-s)
            watchdog_timeout_s = engine.config.parallel.step_timeout_s
        self.watchdog_timeout_s = watchdog_timeout_s  # 0 = no watchdog
        self.request_timeout_s = request_timeout_s  # 0 = no per-request deadline
        self._busy_since: float | None = None  # set while a step or command runs
        self.registry = CollectorRegistry()  # one per server: /metrics renders it
        self.metrics = EngineMetrics(self.registry, engine.config.spec.algorithm)
        self.max_waiting = max_waiting or engine.config.scheduler.max_waiting
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats: dict[str, Any] = engine.stats()  # snapshot, replaced after each step
        self._draining = False
        self._stop = False
        self._dead: BaseException | None = None
        # called on the engine thread if it dies (the server uses it to exit non-zero)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._watchdog = threading.Thread(
            target=self._watch, name="specserve-watchdog", daemon=True
        )
        self.drained: tuple[bool, int] | None = None  # drain()'s result once it ran

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

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate (context and KV pool)."""
        return self.engine.scheduler.max_new_tokens(num_prompt_tokens)

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
        if self.watchdog_timeout_s > 0 and not self._watchdog.is_alive():
            self._watchdog.start()

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

    async def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Stop admitting, wait up to timeout_s for in-flight requests, then abort the rest
        (their consumers see EngineDrainingError). Returns (all finished, number aborted)."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self._live and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        left = len(self._live)
        if left and self._dead is None and self._thread.is_alive():
            await asyncio.wrap_future(self._submit_call(self._abort_all))
        self.drained = (left == 0, left)
        return self.drained

    # -- submission (any thread / event loop) --------------------------------------------------
    def check_admission(self) -> None:
        """Fast refusal before any tokenization: dead, draining, or the waiting queue full."""
        if self._dead is not None:
            raise EngineDeadError(_DEAD)
        if self._draining:
            raise EngineDrainingError("the server is shutting down; retry on another replica")
        if self._stats.get("num_waiting", 0) >= self.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting} requests); retry later"
            )

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Admit a request; raises ValueError / QueueFullError / EngineDrainingError up front."""
        self.check_admission()
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        stream = RequestStream(self.abort, request_id, num_prompt)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._put(("add", stream, prompt, params, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been admitted before the cancel landed
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
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
                fut.set_exception(EngineDeadError(_DEAD))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop and self._dead is None:
                self._wake.clear()  # before draining: a later submit re-sets it
                self._busy_since = time.monotonic()
                self._drain_commands()
                if self.request_timeout_s > 0:
                    self._expire(time.perf_counter())
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if self._dead is not None:  # the watchdog gave up on this step
                        return
                    self._sample_stats()  # before the outputs leave: clients see fresh gauges
                    self._dispatch(outputs)
                    self._busy_since = None
                else:
                    self._busy_since = None
                    self._wake.wait(self._idle_wait_s)
            if self._dead is None:
                self._drain_commands()
                self._abort_all(self.engine)
        except BaseException as exc:  # the engine is unusable: fail everything, /health -> 503
            log.exception("engine thread died")
            self._fail_all(exc, _DEAD)
        finally:
            self._busy_since = None

    def _fail_all(self, exc: BaseException, message: str) -> None:
        """Mark the engine dead and fail every in-flight and pending request (any thread)."""
        if self._dead is not None:
            return
        self._dead = exc
        for stream in list(self._live.values()):
            self._send(stream, EngineDeadError(message))
        self._live.clear()
        self._fail_pending()
        if self.on_failure is not None:
            self.on_failure(exc)

    def _watch(self) -> None:
        """Watchdog thread: fail everything once a step or command overruns the deadline."""
        limit = self.watchdog_timeout_s
        while self._dead is None and not self._stop:
            busy = self._busy_since
            now = time.monotonic()
            if busy is not None and now - busy > limit:
                log.error(
                    "the engine has been inside one step for %.1f s (watchdog %g s): "
                    "failing every request; the server stops",
                    now - busy,
                    limit,
                )
                self._fail_all(
                    TimeoutError(f"engine step stalled for {now - busy:.1f} s"), _STALLED
                )
                return
            time.sleep(min(0.25, limit / 4))

    def _expire(self, now: float) -> None:
        """Abort requests past the per-request deadline (engine thread)."""
        for request_id, stream in list(self._live.items()):
            if now - stream.t_arrival > self.request_timeout_s:
                self._do_abort(request_id)
                self._send(
                    stream,
                    RequestTimeoutError(
                        f"the request ran past the server's {self.request_timeout_s:g} s deadline"
                    ),
                )

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

    def _do_add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams,
        fut: concurrent.futures.Future[None],
    ) -> None:
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
            self._send(
                stream,
                EngineDrainingError("the server shut down before the request finished; retry it"),
            )

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.push, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        aborted = False
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            stream.num_prompt_tokens = out.num_prompt_tokens
            stream.num_output_tokens = out.num_output_tokens
            if stream.t_first is None and out.new_token_ids:
                stream.t_first = now
            if out.finished:  # counted before the client can have its answer
                del self._live[out.request_id]
                self._record_finish(stream, out, now)
            if not self._send(stream, out) and not out.finished:
                self._do_abort(out.request_id)
                aborted = True
        if aborted:
            self._sample_stats()

    def _record_finish(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        if out.finish_reason in ("stop", "length"):
            ttft = None if stream.t_first is None else stream.t_first - stream.t_arrival
            self.metrics.record_request(
                out.finish_reason,
                out.num_prompt_tokens,
                out.num_output_tokens,
                ttft,
                now - stream.t_arrival,
            )
        else:
            self.metrics.record_abort(out.num_prompt_tokens, out.num_output_tokens)

    def _sample_stats(self) -> None:
        self._stats = self.engine.stats()
        self.metrics.observe_engine_stats(self._stats)
