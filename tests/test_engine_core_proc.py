"""The engine core in its own process (RemoteEngine <-> engine/core_proc.py): the same tokens
as an in-process Engine, errors come back as the same exceptions, and a core that dies or
stalls is detected, killed and reaped."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig, EngineConfig, ParallelConfig
from specserve.engine.core_client import RemoteEngine
from specserve.engine.engine import Engine
from specserve.engine.errors import EngineDeadError
from specserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("core") / "m", family="llama",
                                tokenizer=True, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, hidden_size=64, intermediate_size=128)


def _config(target: str, **kw) -> EngineConfig:
    kw.setdefault("cache", CacheConfig(page_size=4, num_pages=256))
    return EngineConfig(model=target, device="cpu", dtype="float32", **kw)


def _run(engine, prompts: list[list[int]], max_tokens: int = 12) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True))
        out[f"r{i}"] = []
    deadline = time.monotonic() + 120
    while engine.has_unfinished() and time.monotonic() < deadline:
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(6)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_remote_engine_equals_in_process(target: str) -> None:
    local = Engine(_config(target))
    expected = _run(local, _prompts())
    local.close()
    remote = RemoteEngine(_config(target))
    try:
        assert remote.tokenizer is not None and remote.max_model_len == local.max_model_len
        assert _run(remote, _prompts()) == expected
        assert remote.stats()["kv_free_pages"] == remote.stats()["kv_total_pages"]
        # a string prompt is tokenized here, in the API process
        assert _run(remote, ["hello world"], 3)["r0"]
    finally:
        remote.close()
    assert _gone(remote.pid)


def test_remote_engine_refusals_are_the_engines_errors(target: str) -> None:
    remote = RemoteEngine(_config(target))
    try:
        with pytest.raises(ValueError, match="context"):
            remote.add_request("big", [5] * (remote.max_model_len + 1), SamplingParams())
        with pytest.raises(ValueError, match="already in use"):
            remote.add_request("a", [5, 6], SamplingParams(max_tokens=50))
            remote.add_request("a", [5, 6], SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="token ids"):
            remote.add_request("c", [5, 10**9], SamplingParams(max_tokens=5))
    finally:
        remote.close()


@pytest.mark.parametrize("sig,error", [(signal.SIGKILL, EngineDeadError),
                                       (signal.SIGSTOP, TimeoutError)])
def test_dead_or_stalled_core_is_detected(target: str, sig: int, error: type) -> None:
    remote = RemoteEngine(_config(target), stall_timeout_s=2.0)
    for i, p in enumerate(_prompts()):
        remote.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=400,
                                                      ignore_eos=True))
    remote.step()
    t0 = time.monotonic()
    os.kill(remote.pid, sig)
    with pytest.raises(error):
        while time.monotonic() - t0 < 30:
            remote.step()
    assert time.monotonic() - t0 < (1.0 if sig == signal.SIGKILL else 5.0)
    remote.close()
    assert _gone(remote.pid)


@pytest.mark.slow
def test_remote_engine_with_tp2_workers(target: str) -> None:
    local = Engine(_config(target))
    expected = _run(local, _prompts())
    local.close()
    remote = RemoteEngine(_config(target, parallel=ParallelConfig(tp_size=2)))
    try:
        assert _run(remote, _prompts()) == expected
        # rank 1 dies while nothing runs: the core notices and reports it unasked
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(remote.pid)],
                             capture_output=True, text=True).stdout.split()
        assert len(out) == 1
        worker = int(out[0])
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            while time.monotonic() - t0 < 10:
                remote.step()
        assert time.monotonic() - t0 < 3.0
    finally:
        remote.close()
    assert _gone(remote.pid) and _gone(worker)
