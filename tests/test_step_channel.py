"""The TP step channel: messages arrive in order and intact at another process; the
benchmark script that measures it runs."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from specserve.worker.step_input import StepInput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module():
    path = os.path.join(ROOT, "scripts", "bench_step_channel.py")
    spec = importlib.util.spec_from_file_location("bench_step_channel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_step_channel_measures_both_sides() -> None:
    bench = _bench_module()
    row = bench.run(bs=4, steps=30)
    assert row["steps"] == 27 and row["bytes"] > 0
    for key in ("encode", "enqueue", "decode", "enqueue+dequeue"):
        assert row[f"{key}_p50_us"] > 0
    # transit is stamped on two processes: the reader may hold the message before the
    # sender's send() has returned (negative transit under load), never before it began
    assert row["received_before_sent"] == 0
    step = bench.decode_step(4)
    assert StepInput.decode(step.encode()).equals(step)
    assert np.all(step.num_new_tokens == 1)
