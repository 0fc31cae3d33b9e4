"""RemoteEngine: the Engine's interface over an engine-core process (engine/core_proc.py).

The API server runs this instead of an in-process Engine: the same calls (add_request,
abort_request, has_unfinished, step, stats, close) made by its engine thread become messages
to the core process, which runs the scheduler, the model (TP rank 0 and its workers) and
detokenization. The tokenizer is loaded here too, so prompts are tokenized in the API process.

`step()` returns the outputs the core produced since the last call (waiting up to POLL_S for
some), so the caller's loop keeps draining its own commands while the core runs. Faults:
  - the core process exits or reports its engine dead -> EngineDeadError (the server stops);
  - the core's heartbeat says one step has run longer than `stall_timeout_s`, or no message
    (heartbeats included) came for that long -> TimeoutError (a stalled engine).
Either way the core process is killed and reaped; it also dies with this process.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from specserve.config import EngineConfig, config_from_dict, config_to_dict
from specserve.engine.engine import RequestOutput
from specserve.engine.errors import EngineDeadError
from specserve.engine.local_worker import resolve_model
from specserve.engine.plan import QueueFullError
from specserve.engine.text import engine_tokenizer
from specserve.generation_config import load_generation_defaults
from specserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

POLL_S = 0.02
_ERRORS = {"ValueError": ValueError, "QueueFullError": QueueFullError}


class _Limits:
    """The part of the scheduler the server asks (Scheduler.max_new_tokens), from the core's
    last report."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        lim = self.limits
        pool = lim["num_total_pages"] * lim["page_size"] - num_prompt_tokens - lim["ahead"]
        return min(lim["max_model_len"] - num_prompt_tokens, pool)


class RemoteEngine:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 900.0,
                 stall_timeout_s: float = 30.0) -> None:
        import zmq

        from specserve.engine.tp_group import worker_env

        self._zmq = zmq
        self.stall_timeout_s = stall_timeout_s
        self.model_name = config.model
        self.model_path, self.model_config = resolve_model(config)
        self._dir = tempfile.mkdtemp(prefix="specserve-core-")
        ctx = zmq.Context.instance()
        self._commands = ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._events = ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(f"ipc://{self._dir}/events")
        spec = {"config": config_to_dict(config), "commands": f"ipc://{self._dir}/commands",
                "events": f"ipc://{self._dir}/events",
                "log_level": logging.getLevelName(logging.getLogger().level)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.engine.core_proc", json.dumps(spec)],
            env=worker_env(), stdin=subprocess.DEVNULL)
        self._live: set[str] = set()
        self._pending: list[RequestOutput] = []
        self._replies: dict[str, dict[str, Any]] = {}
        self._last_event = time.monotonic()
        self._busy_s = 0.0
        self._closed = False
        try:
            ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.config = config_from_dict(ready["config"])
        self.max_model_len = self.config.scheduler.max_model_len
        self.scheduler = _Limits(ready["limits"])
        self._stats: dict[str, Any] = ready["stats"]
        self.tokenizer = engine_tokenizer(self.config, self.model_path)
        self.generation_defaults = load_generation_defaults(self.config.generation_config,
                                                            self.model_path)
        self.startup_seconds = self._stats.get("startup_seconds", 0.0)
        # what the rest of the server reads off an Engine
        self.runner = SimpleNamespace(num_pages=ready["limits"]["num_total_pages"])

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- the Engine interface --------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> str:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            prompt = self.tokenizer.encode(prompt)
        self._send({"op": "add", "request_id": request_id, "prompt": list(prompt),
                    "params": _params_dict(params)})
        while request_id not in self._replies:
            self._receive(POLL_S)
        reply = self._replies.pop(request_id)
        if reply["ev"] == "rejected":
            raise _ERRORS.get(reply["error"], ValueError)(reply["message"])
        self._live.add(request_id)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._send({"op": "abort", "request_id": request_id})

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        if not self._pending:
            self._receive(POLL_S)
        out, self._pending = self._pending, []
        return out

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def close(self) -> None:
        """Stop the core (it stops its TP workers), reap it, remove the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._proc.poll() is None:
            try:
                self._commands.send(_pack({"op": "shutdown"}), self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reap()
        self._commands.close(linger=0)
        self._events.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- messages ----------------------------------------------------------------------------
    def _send(self, msg: dict[str, Any]) -> None:
        self._check_alive()
        self._commands.send(_pack(msg))

    def _receive(self, timeout_s: float) -> None:
        """Take every event that arrived (waiting up to timeout_s for the first)."""
        if self._events.poll(int(timeout_s * 1000)):
            while True:
                try:
                    data = self._events.recv(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                self._on_event(_unpack(data))
        self._check_alive()

    def _on_event(self, ev: dict[str, Any]) -> None:
        self._last_event = time.monotonic()
        kind = ev["ev"]
        if kind == "beat":
            self._busy_s = ev["busy_s"]
            return
        self._busy_s = 0.0
        if kind == "outputs":
            for d in ev["outputs"]:
                out = RequestOutput(**d)
                if out.finished:
                    self._live.discard(out.request_id)
                self._pending.append(out)
        elif kind in ("added", "rejected"):
            self._replies[ev["request_id"]] = ev
        elif kind == "dead":
            self._fail(EngineDeadError(f"the engine core stopped: {ev['message']}"))
        elif kind == "failed":
            self._fail(EngineDeadError(f"the engine failed to start: {ev['message']}"))
        if "stats" in ev:
            self._stats = ev["stats"]
        if "limits" in ev:
            self.scheduler.limits = ev["limits"]

    def _check_alive(self) -> None:
        code = self._proc.poll()
        if code is not None and not self._closed:
            self._fail(EngineDeadError(f"the engine core process exited (status {code})"))
        idle = time.monotonic() - self._last_event
        if self._busy_s > self.stall_timeout_s or idle > self.stall_timeout_s:
            how = (f"one step has run {self._busy_s:.1f} s" if self._busy_s > self.stall_timeout_s
                   else f"no word from it for {idle:.1f} s")
            self._fail(TimeoutError(f"the engine core stalled: {how}"))

    def _fail(self, exc: BaseException) -> None:
        log.error("%s", exc)
        self._live.clear()
        if self._proc.poll() is None:
            self._proc.kill()
        self._reap()
        raise exc

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            log.error("engine core pid %d did not exit", self._proc.pid)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._events.poll(200):
                ev = _unpack(self._events.recv())
                self._last_event = time.monotonic()
                if ev["ev"] == "ready":
                    return ev
                if ev["ev"] == "failed":
                    self._reap()
                    raise ValueError(ev["message"])
            code = self._proc.poll()
            if code is not None:
                raise EngineDeadError(f"the engine core exited during start-up (status {code})")
        raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(params)


def _pack(obj: dict[str, Any]) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> dict[str, Any]:
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False)

