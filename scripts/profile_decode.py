#!/usr/bin/env python3
"""Where a decode step's time goes, on a CUDA machine.

For each batch size: the engine step (wall clock, what `bench latency` reports), the decode
graph replay alone (CUDA events, inputs already on the device), the host part of a step
(step minus the device work it waits for), and a per-kernel table of one eager forward
(torch.profiler, grouped by kernel name) with each kernel's time per step. Optionally writes
a Chrome trace of a few engine steps.

    python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1,128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.floor import time_ms  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402


def fill(engine, bs: int, ctx: int, steps: int) -> list[str]:
    """bs requests of ctx random tokens, stepped until each holds its first token."""
    gen = torch.Generator().manual_seed(bs)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps * 4 + 64, ignore_eos=True)
    ids = [engine.add_request(None, torch.randint(vocab, (ctx,), generator=gen).tolist(), params)
           for _ in range(bs)]
    while any(engine.get_request(i).num_output_tokens < 1 for i in ids):
        engine.step()
    return ids


def step_times(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def host_phases(engine, steps: int) -> dict[str, float]:
    """Mean ms of the step's host phases (each ended by a synchronize, so device work is
    charged to the phase that launched it; with decode overlap, `execute` also launches the
    next step, which the synchronize then waits for)."""
    acc: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        tokens = runner.execute(out.scheduled)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.scheduler.update(out, tokens, None)
        engine._postprocess(out)
        t3 = time.perf_counter()
        acc["schedule"].append((t1 - t0) * 1e3)
        acc["execute (device + host)"].append((t2 - t1) * 1e3)
        acc["update + postprocess"].append((t3 - t2) * 1e3)
    return {k: statistics.mean(v) for k, v in acc.items()}


def graph_replay_ms(engine, bs: int, repeats: int) -> float | None:
    graphs = (getattr(engine.runner, "decode_graphs", None) or {}).get("greedy")
    if graphs is None:
        return None
    b = graphs.bucket(bs)
    if b is None:
        return None
    graph = graphs.graphs[b]
    return statistics.median(time_ms(graph.replay, engine.runner.device, repeats))


def kernel_table(engine, ids: list[str], repeats: int) -> list[dict]:
    """Per-kernel device time of the eager step path (forward, logits, sampling)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    out = engine.scheduler.schedule()
    runner.discard_launched()
    # eager (kernels one by one) and without decode overlap (no step launched ahead)
    graphs, runner.decode_graphs = runner.decode_graphs, None
    overlap, runner.overlap = runner.overlap, False
    try:
        runner.execute(out.scheduled)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                runner.execute(out.scheduled)
            torch.cuda.synchronize()
    finally:
        runner.decode_graphs, runner.overlap = graphs, overlap
    engine.scheduler.update(out, [[0] for _ in out.scheduled], None)
    rows = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rows[ev.name][0] += 1
            rows[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") \
                else ev.cuda_time_total
    table = [{"kernel": name[:110], "calls_per_step": n / repeats, "us_per_step": t / repeats}
             for name, (n, t) in rows.items()]
    return sorted(table, key=lambda r: -r["us_per_step"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch-sizes", default="1,128")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trace", action="store_true", help="write a Chrome trace per batch size")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = parse_positive_list(args.batch_sizes, int, "--batch-sizes")
    llm = LLM(args.model, load_format="dummy",
              scheduler={"max_model_len": args.context_len + 512,
                         "max_num_seqs": max(batch_sizes)})
    engine = llm.engine
    report = {"model": args.model, "context_len": args.context_len,
              "gpu": torch.cuda.get_device_name(), "points": []}
    for bs in batch_sizes:
        ids = fill(engine, bs, args.context_len, args.steps)
        step_times(engine, 5)
        steps = step_times(engine, args.steps)
        phases = host_phases(engine, args.steps)
        replay = graph_replay_ms(engine, bs, args.steps)
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(out / f"trace-bs{bs}.json"))
        kernels = kernel_table(engine, ids, 5)
        for i in ids:
            engine.abort_request(i)
        point = {"batch_size": bs, "step_ms": statistics.median(steps),
                 "step_ms_min": min(steps), "graph_replay_ms": replay, "phases_ms": phases,
                 "eager_kernel_us_total": sum(k["us_per_step"] for k in kernels),
                 "kernels": kernels[:40]}
        report["points"].append(point)
        print(f"\nbs {bs}: step {point['step_ms']:.3f} ms (min {min(steps):.3f}); decode graph "
              f"replay {replay if replay is None else round(replay, 3)} ms; phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        print(f"eager kernels: {point['eager_kernel_us_total'] / 1e3:.3f} ms of device time/step")
        for k in kernels[:25]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['kernel']}")
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
