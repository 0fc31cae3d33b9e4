"""`specserve serve -tp 2` on the CPU, as users run it: API server, engine-core process and a TP
worker are three processes; 8 greedy completions equal the in-process TP 1 engine's (EAGLE-3
chain on); killing the TP worker fails the request in flight with the engine error and every process of
the group exits (the server non-zero)."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("serve_tp")
    target = make_tiny_checkpoint(root / "target", family="llama", tokenizer=True,
                                  num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, hidden_size=64, intermediate_size=128)
    return target, make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 24))] for _ in range(8)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start(pair: tuple[str, str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve", "serve", pair[0], "-tp", "2", "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--page-size", "4", "--spec-draft-model",
           pair[1], "--spec-num-steps", "3", "--step-timeout-s", "20"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not come up")


def _complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_serve_tp2_tokens_and_worker_death(pair: tuple[str, str]) -> None:
    with LLM(pair[0], device="cpu", dtype="float32", page_size=4,
             speculative_config={"method": "eagle3", "model": pair[1],
                                 "num_speculative_tokens": 3}) as llm:
        expected = [o.text for o in llm.generate(
            _prompts(), SamplingParams(temperature=0, max_tokens=16))]
    proc, url = _start(pair)
    try:
        core = _children(proc.pid)
        assert len(core) == 1, core  # the engine-core process
        workers = _children(core[0])
        assert len(workers) == 1, workers  # TP rank 1
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # batched together
            got = list(pool.map(lambda p: _complete(url, p, 16), _prompts()))
        assert [r.status_code for r in got] == [200] * 8
        assert [r.json()["choices"][0]["text"] for r in got] == expected
        # a long request in flight, then rank 1 dies
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_complete, url, _prompts()[0], 200)
            time.sleep(1.0)
            t0 = time.monotonic()
            os.kill(workers[0], signal.SIGKILL)
            answer = pending.result(timeout=60)
        assert answer.status_code >= 500 or "error" in answer.text
        code = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        assert code != 0
        assert not any(_alive(p) for p in core + workers)
        # and a group that dies while idle is noticed too (no request needed): see below
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
