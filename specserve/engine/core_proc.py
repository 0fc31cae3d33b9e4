"""The engine-core process: the Engine (scheduler + TP rank 0, its TP workers beside it) served
to the API server over ZMQ.

    python -m specserve.engine.core_proc '<json>'     (started by engine/core_client.py)

The API server process owns HTTP, tokenization and the request streams; this process owns the
model. Every message is a msgpack map (no pickle) on one of two ipc sockets:

    API -> core (PULL)   {"op": "add", "request_id", "prompt", "params"}
                         {"op": "abort", "request_id"}    {"op": "shutdown"}
    core -> API (PUSH)   {"ev": "ready", "config", "limits", "stats"}   once, after loading
                         {"ev": "failed", "message"}                     loading failed
                         {"ev": "added" | "rejected", "request_id", ...} one per "add"
                         {"ev": "outputs", "outputs": [...], "stats"}    after each step
                         {"ev": "stats", "stats"}                        after commands
                         {"ev": "beat", "busy_s"}                        every BEAT_S
                         {"ev": "dead", "message"}                       then exit 70

The loop drains commands between steps and steps while requests are unfinished. A heartbeat
thread reports how long the current step has run, so the API side can tell a stalled engine
from a busy one; it runs on its own socket (ZMQ sockets are single-threaded).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import msgpack
import zmq

log = logging.getLogger("specserve.engine_core")

BEAT_S = 0.5
IDLE_POLL_MS = 200
EXIT_DEAD = 70


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def limits_of(engine: Any) -> dict[str, int]:
    """What the API side needs to bound max_tokens without asking (Scheduler.max_new_tokens)."""
    s = engine.scheduler
    return {"max_model_len": engine.max_model_len, "num_total_pages": s.allocator.num_total,
            "page_size": s.page_size, "ahead": max(s.lookahead, s.keep_ahead)}


def output_dict(out: Any) -> dict[str, Any]:
    return dataclasses.asdict(out)


class _Beat(threading.Thread):
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        super().__init__(name="engine-core-beat", daemon=True)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.busy_since: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(BEAT_S):
            since = self.busy_since
            busy = 0.0 if since is None else time.monotonic() - since
            self.sock.send(pack({"ev": "beat", "busy_s": busy}))
        self.sock.close(linger=0)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def main(argv: list[str]) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API server, which stops us
    spec = json.loads(argv[0])
    logging.basicConfig(level=spec.get("log_level", "INFO"),
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context.instance()
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 2000)
    events.connect(spec["events"])
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.LINGER, 0)
    commands.connect(spec["commands"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally blocks stop the engine
    try:
        engine = _load(spec)
    except Exception as e:  # noqa: BLE001 - reported to the API server, which exits
        log.exception("the engine failed to start")
        events.send(pack({"ev": "failed", "message": f"{type(e).__name__}: {e}"[:2000]}))
        events.close()
        return 1
    from specserve.config import config_to_dict

    events.send(pack({"ev": "ready", "config": config_to_dict(engine.config),
                      "limits": limits_of(engine), "stats": engine.stats()}))
    beat = _Beat(ctx, spec["events"])
    beat.start()
    try:
        return _serve(engine, commands, events, beat)
    finally:
        beat.stop.set()
        engine.close()
        commands.close(linger=0)
        events.close()


def _load(spec: dict[str, Any]) -> Any:
    from specserve.config import config_from_dict
    from specserve.engine.engine import Engine

    return Engine(config_from_dict(spec["config"]))


def _serve(engine: Any, commands: zmq.Socket, events: zmq.Socket, beat: _Beat) -> int:
    from specserve.engine.plan import QueueFullError
    from specserve.sampling_params import SamplingParams

    while True:
        failure = engine.executor.failure  # a TP worker may die while nothing runs
        if failure is not None:
            events.send(pack({"ev": "dead", "message": failure[:2000]}))
            return EXIT_DEAD
        busy = engine.has_unfinished()
        changed = False
        if commands.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    msg = unpack(commands.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                op = msg["op"]
                if op == "shutdown":
                    return 0
                changed = True
                if op == "abort":
                    engine.abort_request(msg["request_id"])
                    continue
                rid = msg["request_id"]
                try:
                    params = SamplingParams(**msg["params"])
                    engine.add_request(rid, msg["prompt"], params)
                except (ValueError, TypeError, QueueFullError) as e:
                    kind = "QueueFullError" if isinstance(e, QueueFullError) else "ValueError"
                    events.send(pack({"ev": "rejected", "request_id": rid, "error": kind,
                                      "message": str(e)}))
                    continue
                events.send(pack({"ev": "added", "request_id": rid}))
        if engine.has_unfinished():
            beat.busy_since = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - the engine is unusable now
                log.exception("engine step failed")
                events.send(pack({"ev": "dead", "message": f"{type(e).__name__}: {e}"[:2000]}))
                return EXIT_DEAD
            finally:
                beat.busy_since = None
            events.send(pack({"ev": "outputs", "outputs": [output_dict(o) for o in outputs],
                              "stats": engine.stats(), "limits": limits_of(engine)}))
        elif changed:
            events.send(pack({"ev": "stats", "stats": engine.stats(),
                              "limits": limits_of(engine)}))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    sys.exit(main(sys.argv[1:]))
