#!/usr/bin/env python3
"""Where a decode step's time goes, on a CUDA machine.

For each batch size: the engine step (wall clock, what `bench latency` reports), the graph
replay alone (CUDA events, inputs already on the device), the host part of a step (step minus
the device work it waits for), and a per-kernel table of the eager step (torch.profiler,
grouped by kernel name) with each kernel's time per step. Optionally writes a Chrome trace of
a few engine steps. With --spec-topk the step is one speculative cycle of a random EAGLE-3
head under synthetic acceptance (cost only).

    python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1,128 --out DIR
    python scripts/profile_decode.py --batch-sizes 1,16 --spec-topk 4 --spec-num-draft-tokens 16 \
        --out DIR
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

from specserve.bench.floor import sync, time_ms  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.engine.step_builder import build_step_input  # noqa: E402
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
        sync(engine.runner.device)
        t0 = time.perf_counter()
        engine.step()
        sync(engine.runner.device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def host_phases(engine, steps: int) -> dict[str, float]:
    """Mean ms of the step's host phases (each ended by a synchronize, so device work is
    charged to the phase that launched it; with decode overlap, `execute` also launches the
    next step, which the synchronize then waits for)."""
    acc: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    for _ in range(steps):
        sync(engine.runner.device)
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        step = build_step_input(out)
        t1 = time.perf_counter()
        result = runner.execute(step)
        sync(engine.runner.device)
        t2 = time.perf_counter()
        engine.scheduler.update(out, result.token_ids, result.num_computed)
        engine._postprocess(out)
        t3 = time.perf_counter()
        acc["schedule + step input"].append((t1 - t0) * 1e3)
        acc["execute (device + host)"].append((t2 - t1) * 1e3)
        acc["update + postprocess"].append((t3 - t2) * 1e3)
    return {k: statistics.mean(v) for k, v in acc.items()}


def graph_replay_ms(engine, bs: int, repeats: int) -> float | None:
    """Median replay time of the graph a step of this batch runs (decode or speculative)."""
    drafter = engine.drafter
    if drafter is not None:
        graphs = (drafter.graphs or {}).get("synthetic")
    else:
        graphs = (getattr(engine.runner, "decode_graphs", None) or {}).get("greedy")
    if graphs is None or graphs.bucket(bs) is None:
        return None
    return statistics.median(time_ms(graphs.graphs[graphs.bucket(bs)].replay,
                                     engine.runner.device, repeats))


def kernel_table(engine, repeats: int) -> list[dict]:
    """Per-kernel device time of the eager step path (no graphs, no step launched ahead)."""
    from torch.profiler import ProfilerActivity, profile

    runner, drafter = engine.runner, engine.drafter
    runner.discard_launched()
    saved = runner.decode_graphs, runner.overlap, drafter.cycles.graphs if drafter else None
    runner.decode_graphs, runner.overlap = None, False
    if drafter is not None:
        drafter.cycles.graphs = None
    try:
        engine.step()  # warm
        sync(engine.runner.device)
        on_gpu = runner.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) \
                as prof:
            for _ in range(repeats):
                engine.step()
            sync(engine.runner.device)
    finally:
        runner.decode_graphs, runner.overlap = saved[0], saved[1]
        if drafter is not None:
            drafter.cycles.graphs = saved[2]
    rows = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():  # device kernels on a GPU; on the CPU, ops' own time (smoke test)
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rows[ev.name][0] += 1
            rows[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") \
                else ev.cuda_time_total
        elif not on_gpu and ev.name.startswith("aten::"):
            rows[ev.name][0] += 1
            rows[ev.name][1] += ev.self_cpu_time_total
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
    ap.add_argument("--spec-topk", type=int, default=0, help="profile speculation (0: plain)")
    ap.add_argument("--spec-method", default="eagle3", choices=("eagle3", "ngram", "suffix"),
                    help="the drafter of the speculative cycle (ngram/suffix: chain of "
                    "--spec-num-steps tokens, synthetic acceptance at --spec-accept-rate)")
    ap.add_argument("--spec-accept-rate", type=float, default=0.6,
                    help="synthetic acceptance rate of the ngram/suffix cycle")
    ap.add_argument("--spec-num-steps", type=int, default=3)
    ap.add_argument("--spec-num-draft-tokens", type=int, default=0)
    ap.add_argument("--spec-accept-len", type=int, default=4, help="synthetic accept length")
    ap.add_argument("--quantization", default=None,
                    help="quantize the random weights (fp8, w4a16, nvfp4: as bench latency)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = parse_positive_list(args.batch_sizes, int, "--batch-sizes")
    spec = None
    if args.spec_topk and args.spec_method != "eagle3":
        spec = {"method": args.spec_method, "num_speculative_tokens": args.spec_num_steps,
                "synthetic_accept_rate": args.spec_accept_rate}
    elif args.spec_topk:
        spec = dict(algorithm="eagle3", draft_model="dummy", topk=args.spec_topk,
                    num_steps=args.spec_num_steps, num_draft_tokens=args.spec_num_draft_tokens,
                    synthetic_accept_len=args.spec_accept_len)
    llm = LLM(args.model, speculative_config=spec, load_format="dummy",
              quantization=args.quantization or "auto",
              cuda_graph_max_bs=max(batch_sizes),
              scheduler={"max_model_len": args.context_len + 512,
                         "max_num_seqs": max(batch_sizes)})
    engine = llm.engine
    report = {"model": args.model, "quantization": args.quantization,
              "context_len": args.context_len, "speculative": spec,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
              "points": []}
    for bs in batch_sizes:
        ids = fill(engine, bs, args.context_len, args.steps)
        step_times(engine, 5)
        steps = step_times(engine, args.steps)
        phases = host_phases(engine, args.steps) if spec is None else {}
        replay = graph_replay_ms(engine, bs, args.steps)
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.step()
                sync(engine.runner.device)
            prof.export_chrome_trace(str(out / f"trace-bs{bs}.json"))
        kernels = kernel_table(engine, 5)
        for i in ids:
            engine.abort_request(i)
        point = {"batch_size": bs, "step_ms": statistics.median(steps),
                 "step_ms_min": min(steps), "graph_replay_ms": replay, "phases_ms": phases,
                 "eager_kernel_us_total": sum(k["us_per_step"] for k in kernels),
                 "kernels": kernels[:40]}
        report["points"].append(point)
        print(f"\nbs {bs}: step {point['step_ms']:.3f} ms (min {min(steps):.3f}); graph "
              f"replay {replay if replay is None else round(replay, 3)} ms; phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        print(f"eager kernels: {point['eager_kernel_us_total'] / 1e3:.3f} ms of device time/step")
        for k in kernels[:25]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['kernel']}")
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
