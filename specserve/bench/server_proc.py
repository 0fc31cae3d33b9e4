"""Start a `specserve serve` process for a benchmark and stop it afterwards."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started_server(serve_args: str, timeout_s: float = 600.0) -> Iterator[str]:
    """Run `specserve serve SERVE_ARGS --port P` on loopback; yield its base URL once /health
    answers 200; SIGTERM it (graceful drain) on exit. The server's log goes to stderr."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", *shlex.split(serve_args),
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ValueError(f"the server exited with {proc.returncode} during start-up: "
                                 f"{' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ValueError(f"the server did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
