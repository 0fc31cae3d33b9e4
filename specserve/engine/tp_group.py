"""The TP worker processes of one engine: start, watch, stop.

Ranks 1 .. tp_size-1 run `python -m specserve.engine.tp_worker` (a fresh interpreter: nothing
is forked or pickled; the resolved EngineConfig travels as JSON on the command line). Each
worker dies with the engine process (PR_SET_PDEATHSIG) and ignores Ctrl-C (the engine stops
it). A monitor thread watches the group every `POLL_S`:
  - a worker process that exits, or reports an error, is a dead group (detected within
    POLL_S of the exit);
  - a step that runs longer than `step_timeout_s` is a hung group;
either way every worker is killed and reaped (no zombies), `failure` says why, and the
engine's next (or current) step raises EngineDeadError. A rank-0 thread blocked in a
collective with a dead peer gets an error from gloo; if it is still blocked `exit_grace_s`
later (NCCL can wait forever), the process exits with status 70 after logging the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from specserve.engine.channel import EngineChannel
from specserve.engine.errors import EngineDeadError

log = logging.getLogger(__name__)

POLL_S = 0.05
EXIT_STATUS_DEAD = 70


def _package_root() -> str:
    import specserve

    return os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__)))


def worker_env() -> dict[str, str]:
    """The workers' environment: ours, with the package importable and NVLink multicast off."""
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class WorkerGroup:
    def __init__(self, spec: dict[str, Any], tp_size: int, step_timeout_s: float,
                 startup_timeout_s: float = 600.0, exit_grace_s: float = 5.0) -> None:
        """spec: what every worker needs to build its rank (see tp_worker.main), JSON-able."""
        assert tp_size > 1
        self.tp_size = tp_size
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.exit_grace_s = exit_grace_s
        self.channel = EngineChannel(tp_size - 1)
        self.failure: str | None = None
        self.ready: dict[int, dict[str, Any]] = {}  # rank -> its last "ready" report
        self.byes: dict[int, dict[str, Any]] = {}
        self._step_started: float | None = None  # a step is running since (monotonic s)
        self._blocked = False  # rank 0 is inside a step or the group's start-up collectives
        self._stopping = False  # close() asked the workers to exit: exits are expected
        self._closing = False  # the monitor stops
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        env = worker_env()
        for rank in range(1, tp_size):
            args = {**spec, "rank": rank, "inbox": self.channel.worker_addrs[rank - 1],
                    "reports": self.channel.report_addr}
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "specserve.engine.tp_worker", json.dumps(args)],
                env=env, stdin=subprocess.DEVNULL))
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- start-up ----------------------------------------------------------------------------
    def wait_stage(self, stage: str) -> list[dict[str, Any]]:
        """Block until every worker reported `stage` ("started" or "loaded")."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            self.check()
            with self._lock:
                got = [r for r in self.ready.values() if r.get("stage") == stage]
            if len(got) == self.tp_size - 1:
                return sorted(got, key=lambda r: r["rank"])
            if time.monotonic() > deadline:
                self._fail(f"TP workers did not reach '{stage}' within "
                           f"{self.startup_timeout_s:.0f} s")
                self.check()
            time.sleep(POLL_S)

    # -- steps -------------------------------------------------------------------------------
    def send(self, kind: bytes, payload: bytes) -> None:
        self.check()
        self.channel.send(kind, payload)

    @contextlib.contextmanager
    def blocking(self, step: bool = False) -> Iterator[None]:
        """Rank 0 runs collectives with the workers inside: a step (timed against the step
        timeout) or start-up (not timed: loading may take minutes)."""
        self._blocked = True
        if step:
            self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None
            self._blocked = False

    def wait_failure(self, timeout_s: float) -> str | None:
        """The failure, waiting up to `timeout_s` for the monitor to notice one."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        return self.failure

    def check(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)

    # -- the monitor -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            report = self.channel.poll_report(int(POLL_S * 1000))
            if report is not None:
                self._on_report(*report)
            if self._closing or self.failure is not None:
                break
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                    self._fail(f"TP worker rank {rank} (pid {proc.pid}) died: {how}")
                    break
            started = self._step_started
            if (self.failure is None and started is not None and self.step_timeout_s > 0
                    and time.monotonic() - started > self.step_timeout_s):
                self._fail(f"a TP step ran past the step timeout ({self.step_timeout_s:g} s): "
                           "a worker is hung")
        if self.failure is not None and not self._closing:
            self._after_failure()

    def _on_report(self, kind: bytes, msg: dict[str, Any]) -> None:
        rank = msg.get("rank")
        if kind == b"ready":
            with self._lock:
                self.ready[rank] = msg
        elif kind == b"bye":
            with self._lock:
                self.byes[rank] = msg
        elif kind == b"error" and not self._stopping:
            self._fail(f"TP worker rank {rank} failed: {msg.get('message', '?')}")

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s; stopping the TP group", reason)

    def _after_failure(self) -> None:
        self.kill()
        # rank 0 may be blocked in a collective with a dead peer: gloo raises, NCCL may not
        deadline = time.monotonic() + self.exit_grace_s
        while time.monotonic() < deadline:
            if not self._blocked or self._closing:
                return
            time.sleep(POLL_S)
        log.critical("%s; rank 0 is still blocked in its step: exiting", self.failure)
        logging.shutdown()
        os._exit(EXIT_STATUS_DEAD)

    # -- shutdown ----------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL every worker still running and reap them all."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a kernel-stuck process
                log.error("TP worker pid %d did not exit after SIGKILL", proc.pid)

    def close(self, timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
        """Ask every worker to exit, wait (then kill), reap; returns their bye reports."""
        if self._closing:
            return self.byes
        self._stopping = True
        if self.failure is None:
            try:
                self.channel.send(b"close", b"")
            except Exception:  # noqa: BLE001 - the sockets may already be gone
                pass
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
                time.sleep(POLL_S)  # the monitor collects the bye reports meanwhile
        self._closing = True
        self._monitor.join(timeout=2)
        while True:  # reports still queued (a bye sent just before the exit)
            report = self.channel.poll_report(0)
            if report is None:
                break
            self._on_report(*report)
        self.kill()
        self.channel.close()
        return self.byes
