"""The TP step message: its size and its enqueue/dequeue time at batch 1 and 128.

    python scripts/bench_step_channel.py [--steps 2000] [--json-out FILE]

Rank 0's side encodes a decode StepInput (the shape the scheduler builds: one token per row,
a 1k-token context in 16-token pages) and sends it on the engine's step channel; a receiver
process (a real second interpreter, like a TP worker) takes it off its queue and decodes it.
Both sides stamp CLOCK_MONOTONIC (shared by the processes of one machine), so the one-way
times are measured, not halved round trips:
    encode   StepInput.encode() on rank 0
    enqueue  the send call on rank 0
    transit  send returned -> the receiver's recv returned (queueing + the ipc copy)
    decode   StepInput.decode() on the receiver
"enqueue+dequeue" is enqueue + transit + decode: from rank 0 handing over the encoded step to
the worker holding a StepInput. Messages are sent one at a time, each after the previous one
was read (a step's pace), so no queue builds up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from specserve.engine.channel import EngineChannel, WorkerChannel
from specserve.engine.tp_group import worker_env
from specserve.worker.step_input import StepInput


def decode_step(bs: int, context: int = 1024, page_size: int = 16) -> StepInput:
    pages = -(-(context + 16) // page_size)
    return StepInput(
        request_ids=[f"cmpl-{i:016x}" for i in range(bs)],
        starts=np.full(bs, context), num_new_tokens=np.ones(bs), next_token_ids=-np.ones(bs),
        samples=np.ones(bs, bool), is_decode=np.ones(bs, bool), speculate=np.ones(bs, bool),
        lookahead=np.full(bs, 15), from_cache=np.zeros(bs, bool),
        num_tokens=np.full(bs, context + 1), tokens_left=np.full(bs, 64),
        page_counts=np.full(bs, pages), temperature=np.zeros(bs), top_k=-np.ones(bs),
        top_p=np.ones(bs), min_p=np.zeros(bs), seed=np.arange(bs),
        token_ids=np.random.randint(0, 128000, bs),
        page_ids=np.random.randint(0, 50000, bs * pages))


def _receiver(inbox: str, reports: str) -> None:
    channel = WorkerChannel(1, inbox, reports)
    stamps: list[tuple[int, int]] = []
    while True:
        kind, payload = channel.recv()
        t_recv = time.monotonic_ns()
        if kind == b"close":
            break
        StepInput.decode(payload)
        stamps.append((t_recv, time.monotonic_ns()))
        channel.report(b"ready", stage="ack")
    channel.report(b"bye", stamps=stamps)
    channel.close()


def run(bs: int, steps: int) -> dict:
    step = decode_step(bs)
    channel = EngineChannel(1)
    code = ("import sys; from scripts.bench_step_channel import _receiver; "
            "_receiver(sys.argv[1], sys.argv[2])")
    env = worker_env()
    env["PYTHONPATH"] = "." + ":" + env["PYTHONPATH"]
    proc = subprocess.Popen([sys.executable, "-c", code, channel.worker_addrs[0],
                             channel.report_addr], env=env)
    sent: list[tuple[int, int, int]] = []  # (before encode, after encode, after send)
    size = 0
    try:
        for _ in range(steps):
            t0 = time.monotonic_ns()
            payload = step.encode()
            t1 = time.monotonic_ns()
            channel.send(b"step", payload)
            t2 = time.monotonic_ns()
            sent.append((t0, t1, t2))
            size = len(payload)
            assert channel.poll_report(10_000) is not None, "receiver did not answer"
        channel.send(b"close", b"")
        report = channel.poll_report(10_000)
        assert report is not None and report[0] == b"bye"
        stamps = report[1]["stamps"]
    finally:
        proc.wait(timeout=10)
        channel.close()
    warm = steps // 10  # the first messages pay connection set-up
    s = np.asarray(sent[warm:], dtype=np.int64)
    r = np.asarray(stamps[warm:], dtype=np.int64)
    us = {
        "encode": (s[:, 1] - s[:, 0]) / 1e3,
        "enqueue": (s[:, 2] - s[:, 1]) / 1e3,
        "transit": (r[:, 0] - s[:, 2]) / 1e3,
        "decode": (r[:, 1] - r[:, 0]) / 1e3,
        "enqueue+dequeue": (r[:, 1] - s[:, 1]) / 1e3,
    }
    # a receipt stamped before its send began would mean the two clocks disagree
    early = int(np.sum(r[:, 0] < s[:, 1]))
    return {"bs": bs, "bytes": size, "steps": len(s), "received_before_sent": early,
            **{f"{k}_p50_us": float(np.median(v)) for k, v in us.items()},
            **{f"{k}_p99_us": float(np.percentile(v, 99)) for k, v in us.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-sizes", default="1,128")
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()
    rows = [run(int(bs), args.steps) for bs in args.batch_sizes.split(",")]
    print(f"{'bs':>4} {'bytes':>7} {'encode':>7} {'enqueue':>8} {'transit':>8} {'decode':>7} "
          f"{'enq+deq p50':>11} {'p99':>7}  (us)")
    for row in rows:
        print(f"{row['bs']:>4} {row['bytes']:>7} {row['encode_p50_us']:>7.1f} "
              f"{row['enqueue_p50_us']:>8.1f} {row['transit_p50_us']:>8.1f} "
              f"{row['decode_p50_us']:>7.1f} {row['enqueue+dequeue_p50_us']:>11.1f} "
              f"{row['enqueue+dequeue_p99_us']:>7.1f}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
