#!/usr/bin/env python3
"""Where an eager step's time goes: a step that carries a prefill chunk (beside decodes).

Steps with prefill chunks run without CUDA graphs. On an H100 (Llama-3.1-8B shape) a
128-token prefill step took 18-20 ms where reading the weights takes 5.6 ms, and every step
that mixes a new prompt into running decodes paid ~13 ms over its GPU work; speculative
modes, whose prompts arrive one a step, paid it most (experiments/2026-12-06-h100-policy-
exact-drafters.md). For each (chunk tokens, decode rows) this reports the step's wall time,
the device time of its kernels (torch.profiler: their summed durations, so the part of the
step the GPU was busy), the rest (host time the GPU waited for: Python, kernel launches,
host syncs), and the host functions that took it (cProfile of one more such step, by own
time: e.g. Triton's launcher, the attention metadata, the sampler).

    python scripts/profile_prefill.py --model llama-3.1-8b --chunk-tokens 16,128,512,2048 \
        --decode-rows 0,32 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.floor import sync  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402


def prompt(engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(engine.model_config.vocab_size, (n,), generator=gen).tolist()


def start_decodes(engine, rows: int, ctx: int) -> list[str]:
    """`rows` requests of ctx tokens, stepped until every one decodes (long outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    ids = [engine.add_request(None, prompt(engine, ctx, 1000 + i), params) for i in range(rows)]
    while any(engine.get_request(i).num_output_tokens < 1 for i in ids):
        engine.step()
    return ids


def mixed_step(engine, chunk: int, seed: int) -> float:
    """Wall ms of one step that prefills a new `chunk`-token prompt beside the decodes (the
    request ends with that step's first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rid = engine.add_request(None, prompt(engine, chunk, seed), params)
    sync(engine.runner.device)
    t0 = time.perf_counter()
    engine.step()
    sync(engine.runner.device)
    wall = (time.perf_counter() - t0) * 1e3
    while engine.get_request(rid) is not None and not engine.get_request(rid).is_finished:
        engine.step()  # a chunk larger than the step's budget: the rest is not timed
    return wall


def device_ms(engine, chunk: int, seed: int) -> float:
    """Summed kernel time of one such step (0 on the CPU)."""
    if engine.runner.device.type != "cuda":
        mixed_step(engine, chunk, seed)
        return 0.0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mixed_step(engine, chunk, seed)
    total = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total += getattr(ev, "device_time_total", 0.0) or ev.cuda_time_total
    return total / 1e3


def host_hotspots(engine, chunk: int, seed: int, top: int) -> list[dict]:
    """Functions of one such step by their own host time (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    mixed_step(engine, chunk, seed)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls,
                     "own_ms": own * 1e3, "cumulative_ms": cum * 1e3})
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--chunk-tokens", default="16,128,512,2048")
    ap.add_argument("--decode-rows", default="0,32",
                    help="requests decoding beside the chunk (0: a prefill alone)")
    ap.add_argument("--context-len", type=int, default=512, help="the decoding requests' prompt")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--top", type=int, default=25, help="host functions listed")
    ap.add_argument("--device", default=None)
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=8192,
                    help="the engine option (the same default): steps of up to this many "
                    "tokens through token CUDA graphs (0: eager)")
    ap.add_argument("--exact-attention", action="store_true",
                    help="the engine option: batch-invariant attention (its prefill cost)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        chunks = parse_positive_list(args.chunk_tokens, int, "--chunk-tokens")
        rows_list = [int(x) for x in args.decode_rows.split(",")]
        if any(r < 0 for r in rows_list) or args.repeats < 1:
            raise ValueError("--decode-rows must be >= 0 and --repeats >= 1")
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = max(chunks) + max(rows_list) + 64
    kwargs = {} if args.device is None else {"device": args.device}
    llm = LLM(args.model, load_format=args.load_format,
              cuda_graph_max_bs=max(max(rows_list), 1),
              cuda_graph_max_tokens=args.cuda_graph_max_tokens,
              exact_attention=args.exact_attention,
              scheduler={"max_model_len": max(args.context_len, max(chunks)) + 256,
                         "max_num_seqs": max(rows_list) + 2,
                         "max_num_batched_tokens": budget},
              **kwargs)
    engine = llm.engine
    report = {"model": args.model, "cuda_graph_max_tokens": args.cuda_graph_max_tokens,
              "exact_attention": args.exact_attention,
              "gpu": torch.cuda.get_device_name() if engine.runner.device.type == "cuda"
              else "none (CPU)", "points": []}
    seed = 0
    for rows in rows_list:
        ids = start_decodes(engine, rows, args.context_len)
        for chunk in chunks:
            seed += 1
            mixed_step(engine, chunk, seed)  # warm: this shape's kernels compile here
            walls = []
            for _ in range(args.repeats):
                seed += 1
                walls.append(mixed_step(engine, chunk, seed))
            seed += 1
            dev = device_ms(engine, chunk, seed)
            seed += 1
            hot = host_hotspots(engine, chunk, seed, args.top)
            wall = statistics.median(walls)
            point = {"chunk_tokens": chunk, "decode_rows": rows, "wall_ms": wall,
                     "wall_ms_min": min(walls), "device_ms": dev,
                     "host_gap_ms": max(0.0, wall - dev), "host_hotspots": hot}
            report["points"].append(point)
            print(f"\nchunk {chunk} + {rows} decode rows: step {wall:.2f} ms (min "
                  f"{min(walls):.2f}), kernels {dev:.2f} ms, the rest {point['host_gap_ms']:.2f} ms")
            for h in hot[:12]:
                print(f"  {h['own_ms']:8.2f} ms own  {h['cumulative_ms']:8.2f} cum  "
                      f"x{h['calls']:<5} {h['function']}")
        for i in ids:
            engine.abort_request(i)
        while engine.has_unfinished():
            engine.step()
    (out / "profile_prefill.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
