"""The step channel between the engine core (rank 0) and the other TP ranks: ZMQ over ipc.

Rank 0 owns one PUSH socket per worker (the same frames go to each: no slow-joiner loss, a
message waits until its worker reads it) and one PULL socket the workers report on. A message
is a two-frame multipart `[kind, payload]`: `kind` is a short ASCII tag, `payload` raw bytes
(a StepInput's msgpack encoding for "step", a msgpack map otherwise). Nothing is pickled.

    rank 0 -> worker   b"step"     StepInput.encode()
                       b"control"  {"op": ..., **args}     (same order on every rank)
                       b"close"    {}
    worker -> rank 0   b"ready"    {"rank", "stage": "started" | "loaded", "pid", ...}
                       b"error"    {"rank", "message"}      (the worker then exits non-zero)
                       b"bye"      {"rank", "digest", "steps"}
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import msgpack
import zmq

KINDS = (b"step", b"control", b"close", b"ready", b"error", b"bye")


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


class EngineChannel:
    """Rank 0's side: bind the sockets in a private temporary directory."""

    def __init__(self, num_workers: int) -> None:
        self.ctx = zmq.Context.instance()
        self.dir = tempfile.mkdtemp(prefix="specserve-tp-")
        self.worker_addrs = [f"ipc://{self.dir}/to-rank{r}" for r in range(1, num_workers + 1)]
        self.report_addr = f"ipc://{self.dir}/reports"
        self.out: list[zmq.Socket] = []
        for addr in self.worker_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self.out.append(sock)
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(self.report_addr)

    def send(self, kind: bytes, payload: bytes) -> None:
        """The same message to every worker, in order; never blocks on a slow reader (the
        high-water mark is far above the handful of messages a step has in flight)."""
        assert kind in KINDS
        for sock in self.out:
            sock.send_multipart((kind, payload), copy=False)

    def poll_report(self, timeout_ms: int) -> tuple[bytes, dict[str, Any]] | None:
        """One report from any worker, or None after `timeout_ms`."""
        if not self.reports.poll(timeout_ms):
            return None
        kind, payload = self.reports.recv_multipart()
        return kind, unpack(payload)

    def close(self) -> None:
        for sock in [*self.out, self.reports]:
            sock.close(linger=0)
        self.out = []
        shutil.rmtree(self.dir, ignore_errors=True)


class WorkerChannel:
    """A worker's side: read its own queue, report on the shared one."""

    def __init__(self, rank: int, inbox: str, reports: str) -> None:
        self.rank = rank
        self.ctx = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.connect(inbox)
        self.reports = self.ctx.socket(zmq.PUSH)
        self.reports.setsockopt(zmq.LINGER, 2000)  # let a final error/bye report get out
        self.reports.connect(reports)

    def recv(self) -> tuple[bytes, bytes]:
        kind, payload = self.inbox.recv_multipart(copy=True)
        return kind, payload

    def report(self, kind: bytes, **fields: Any) -> None:
        assert kind in KINDS
        self.reports.send_multipart((kind, pack({"rank": self.rank, **fields})))

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.reports.close()
