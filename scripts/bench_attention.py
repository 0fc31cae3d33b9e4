#!/usr/bin/env python3
"""Launch-parameter sweep of the paged-attention kernel (decode and tree-verify shapes).

For each case (decode; verify q_len 4 with a causal-like custom mask; verify q_len 16 with a
random tree mask; causal q_len 16 without a mask, to separate the mask's cost) and batch size,
times `paged_attention` (the whole call: attention launch plus the split-combine launch) over a
grid of (num_warps, num_stages, block_n, num_splits). On a GPU, N calls are captured in one CUDA
graph and replayed (CUDA events; us per call = median over the replays of replay time / N), so
launch overhead is excluded. By default the N captured calls read N different KV sets (own
shuffled pages each; --hot-l2 reuses one), so the KV mostly comes from HBM, as in a model
forward, rather than from a hot L2. Each config's output is checked once against
`paged_attention_ref` (max abs error); failures are flagged and never picked as best.

The KV length each query block attends over is context_len + q_len (the new tokens' K/V are in
the cache). num_splits=None is the kernel's default (capped at MAX_SPLITS=16); an explicit
value bypasses that cap, so 32 runs as given. Configs that resolve to the same launch (an
explicit value equal to the default one) are timed once. Compilation dominates a cold run
(about 1 s per kernel), so on a GPU worker processes compile the grid first into Triton's
disk cache (--compile-workers), then one process times everything. The full grid is 90
kernels per case (360 in all, 648 timed configs): on an H200 (16 CPUs, 12 workers) it took ~55 s
from a cold Triton cache (38 s of it compiling), 21 s warm; expect ~6 min with 0 workers.

    python scripts/bench_attention.py --json-out out/attn.json          # full grid, H200
    python scripts/bench_attention.py --quick --batch-sizes 1           # a first look
    python scripts/bench_attention.py --cases verify16_tree --num-warps 4,8 --block-n 32,64
    # CPU smoke test (Triton interpreter, timings meaningless; ~5 s):
    python scripts/bench_attention.py --quick --num-heads 4 --num-kv-heads 2 --head-dim 16 \
        --page-size 4 --context-len 8 --batch-sizes 1 --num-warps 4 --block-n 16 \
        --num-splits default,2 --replays 1 --json-out /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the kernels run under Triton's interpreter on the CPU;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # it must be set before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.attention_sweep import (  # noqa: E402
    ATOL,
    CASES,
    DEFAULT_CONFIG,
    RTOL,
    Batch,
    CaseSpec,
    Config,
    Shapes,
    active_splits,
    check,
    configs_for,
    fit_kv_sets,
    make_batch,
    resolved,
    time_us,
    triton_launch_defaults,
    warm_up,
)
from specserve.bench.floor import sync  # noqa: E402
from specserve.config import CacheConfig  # noqa: E402
from specserve.kernels.dispatch import triton  # noqa: E402

FULL_GRID: dict[str, list[int | None]] = {
    "num_warps": [4, 8], "num_stages": [None, 1, 2, 3], "block_n": [32, 64, 128],
    "num_splits": [None, 4, 8, 16, 32],
}  # fmt: skip
QUICK_GRID: dict[str, list[int | None]] = {
    "num_warps": [4, 8], "num_stages": [None], "block_n": [32, 64], "num_splits": [None, 8, 16],
}  # fmt: skip

def parse_grid_values(text: str, flag: str) -> list[int | None]:
    """'default,1,2' -> [None, 1, 2]."""
    try:
        values = [None if v.strip().lower() in ("default", "none") else int(v)
                  for v in text.split(",") if v.strip()]  # fmt: skip
    except ValueError:
        values = []
    if not values or any(v is not None and v <= 0 for v in values):
        raise SystemExit(f"{flag}: a comma-separated list of positive ints or 'default', got {text!r}")
    return values


def compile_shard(tasks: list[tuple[CaseSpec, int, Config]], s: Shapes) -> None:
    """Worker: launch each task once (compiling it into Triton's disk cache); errors ignored,
    the timing process reports them."""
    batches: dict[tuple[str, int], Batch] = {}
    for spec, bs, cfg in tasks:
        b = batches.setdefault((spec.name, bs), make_batch(spec, bs, s, sets=1))
        try:
            b.call(spec, cfg)
            sync(s.device)
        except Exception:  # noqa: BLE001
            pass


def precompile(argv: list[str], n_tasks: int, workers: int) -> float:
    """Run `workers` copies of this script, each compiling its share of the tasks."""
    t0 = time.perf_counter()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(workers):
            log = open(Path(tmp) / f"w{i}.log", "w+")  # noqa: SIM115 - closed below
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv,
                   "--compile-shard", f"{i}/{workers}"]  # fmt: skip
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        for proc, log in procs:
            rc = proc.wait()
            if rc != 0:
                log.seek(0)
                print(f"  compile worker exited {rc} (the timing run compiles instead):\n"
                      f"{log.read()[-1500:]}", file=sys.stderr)  # fmt: skip
            log.close()
    dt = time.perf_counter() - t0
    print(f"precompiled {n_tasks} launches with {workers} workers in {dt:.1f} s", flush=True)
    return dt


def time_group(spec: CaseSpec, bs: int, cfgs: list[Config], s: Shapes,
               launch_defaults: tuple[int | None, int | None], args: argparse.Namespace,
               sets: int, graphs: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Check and time every config of one (case, batch size); the default is first, and is
    timed again at the end (a clock-drift check)."""
    if s.device.type == "cuda":
        fit = fit_kv_sets(sets, spec, bs, s, torch.cuda.mem_get_info(s.device)[0])
        if fit < sets:
            print(f"  {spec.name} bs {bs}: {fit} KV sets (of {sets}) fit in half the free memory",
                  flush=True)
        sets = fit
    batch = make_batch(spec, bs, s, sets, args.seed)
    ref = batch.reference(spec)
    seq_len = s.context_len + spec.q_len
    atol, rtol = ATOL[s.dtype], RTOL[s.dtype]
    try:
        batch.call(spec, DEFAULT_CONFIG)  # compiles outside the capture
        warm_up(lambda i: batch.call(spec, DEFAULT_CONFIG, i), sets, s.device, args.calls)
    except Exception as exc:  # noqa: BLE001 - the default's row reports it
        print(f"  warm-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sync(s.device)
    group: list[dict[str, Any]] = []
    for cfg in cfgs:
        eff = resolved(cfg, spec, bs, s, launch_defaults)
        row: dict[str, Any] = {
            "case": spec.name, "batch_size": bs, "q_len": spec.q_len, "mask": spec.mask,
            "seq_len": seq_len, **asdict(cfg), "num_warps_eff": eff[0], "num_stages_eff": eff[1],
            "splits": eff[3], "active_splits": active_splits(seq_len, eff[3], eff[2]),
            "is_default": cfg == DEFAULT_CONFIG, "device": s.device.type, "us": None,
            "us_replays": None, "graphed": False, "max_abs_err": None, "max_rel_err": None,
            "ok": False, "error": None, "first_call_s": None,
        }  # fmt: skip
        try:
            batch.out.fill_(float("nan"))  # every row must be written
            t0 = time.perf_counter()
            batch.call(spec, cfg)
            sync(s.device)
            row["first_call_s"] = time.perf_counter() - t0
            row["max_abs_err"], row["max_rel_err"] = check(batch.out, ref)
            row["ok"] = row["max_abs_err"] <= atol and row["max_rel_err"] <= rtol
            times, row["graphed"] = time_us(
                lambda i, cfg=cfg: batch.call(spec, cfg, i), sets, s.device, args.calls,
                args.replays, graphs,
            )  # fmt: skip
            row["us_replays"] = times
            row["us"] = statistics.median(times)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run
            last = str(exc).strip().splitlines()
            row["error"] = f"{type(exc).__name__}: {last[-1] if last else ''}"[:300]
            sync(s.device)
        group.append(row)
    if group[0]["us"] is not None:
        times, _ = time_us(lambda i: batch.call(spec, DEFAULT_CONFIG, i), sets, s.device,
                           args.calls, args.replays, graphs)  # fmt: skip
        group[0]["us_recheck"] = statistics.median(times)
    return group


def fmt_opt(v: int | None, resolved_v: int | None) -> str:
    if v is None:
        return f"d({resolved_v})" if resolved_v is not None else "d"
    return str(v)


def print_table(rows: list[dict[str, Any]], top: int) -> None:
    first = rows[0]
    ok = sorted((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
    default = next(r for r in rows if r["is_default"])
    d_us = default["us"]
    print(f"\n== {first['case']}  bs={first['batch_size']}  q_len={first['q_len']}  "
          f"seq_len={first['seq_len']}  mask={first['mask']}  "
          f"(* default; d(x): default, resolving to x) ==")  # fmt: skip
    print(f"{'rank':>5} {'us':>8} {'speedup':>7} {'warps':>6} {'stages':>6} {'block_n':>7} "
          f"{'splits':>6} {'active':>6} {'max_err':>8}  note")  # fmt: skip
    shown = ok if top <= 0 else ok[:top]
    if top > 0 and default in ok and default not in shown:
        shown = [*shown, default]
    for r in shown:
        mark = "*" if r["is_default"] else " "
        speed = f"{d_us / r['us']:.2f}x" if d_us and r["us"] else "-"
        note = "" if r["ok"] else "FAIL: wrong result"
        if not r["graphed"] and r["device"] == "cuda":
            note += " (eager timing)"
        print(f"{mark}{ok.index(r) + 1:>4} {r['us']:>8.2f} {speed:>7} "
              f"{fmt_opt(r['num_warps'], r['num_warps_eff']):>6} "
              f"{fmt_opt(r['num_stages'], r['num_stages_eff']):>6} {str(r['block_n']):>7} "
              f"{fmt_opt(r['num_splits'], r['splits']):>6} {r['active_splits']:>6} "
              f"{r['max_abs_err']:>8.1e}  {note}")  # fmt: skip
    if len(shown) < len(ok):
        print(f"  ... {len(ok) - len(shown)} more (--top 0 prints all)")
    for r in rows:
        if r["us"] is None:
            print(f"  error: warps={r['num_warps']} stages={r['num_stages']} "
                  f"block_n={r['block_n']} splits={r['num_splits']}: {r['error']}")  # fmt: skip
    if default.get("us_recheck") is not None:
        print(f"  default re-timed after the group: {default['us_recheck']:.2f} us "
              f"(first: {d_us:.2f} us)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-len", type=int, default=1024, help="KV tokens before the queries")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=CacheConfig().page_size)
    ap.add_argument("--quick", action="store_true", help="a reduced grid")
    ap.add_argument("--num-warps", help="override the grid, e.g. 4,8")
    ap.add_argument("--num-stages", help="override the grid, e.g. default,1,2")
    ap.add_argument("--block-n", help="override the grid, e.g. 32,64")
    ap.add_argument("--num-splits", help="override the grid, e.g. default,8,16")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one CUDA graph")
    ap.add_argument("--replays", type=int, default=5, help="timed replays (median reported)")
    ap.add_argument("--no-graphs", action="store_true", help="time eager launches instead")
    ap.add_argument("--hot-l2", action="store_true", help="every call reads the same KV set")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="processes precompiling the grid (default: min(12, CPUs - 2) on a GPU)")
    ap.add_argument("--top", type=int, default=20, help="rows printed per table (0: all)")
    ap.add_argument("--json-out", help="write every row to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-shard", help=argparse.SUPPRESS)  # worker: "i/n"
    args = ap.parse_args(argv)

    if triton is None:
        print("needs triton (on the CPU it runs under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: set TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shapes = Shapes(args.num_heads, args.num_kv_heads, args.head_dim, args.page_size,
                    args.context_len, dtype, device)  # fmt: skip
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(by_name)}")
    cases = [by_name[n] for n in args.cases.split(",")]
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for key in grid:
        if getattr(args, key) is not None:
            grid[key] = parse_grid_values(getattr(args, key), "--" + key.replace("_", "-"))
    launch_defaults = triton_launch_defaults(device)

    plan = [(spec, bs, configs_for(spec, bs, shapes, grid, launch_defaults))
            for spec in cases for bs in batch_sizes]  # fmt: skip
    compile_tasks: dict[tuple, tuple[CaseSpec, int, Config]] = {}  # one per distinct kernel
    for spec, bs, cfgs in plan:
        for cfg in cfgs:
            key = (spec.name, *resolved(cfg, spec, bs, shapes, launch_defaults))
            compile_tasks.setdefault(key, (spec, bs, cfg))
    tasks = list(compile_tasks.values())
    if args.compile_shard:
        i, n = (int(x) for x in args.compile_shard.split("/"))
        compile_shard(tasks[i::n], shapes)
        return 0

    n_timed = sum(len(cfgs) for _, _, cfgs in plan)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"
          f", {dtype}, heads {shapes.num_heads}/{shapes.num_kv_heads}x{shapes.head_dim}, page "
          f"{shapes.page_size}, context {shapes.context_len}; Triton defaults (warps, stages) "
          f"= {launch_defaults}; grid {grid}")  # fmt: skip
    print(f"{n_timed} configs to time, {len(tasks)} distinct kernels to compile", flush=True)
    t_start = time.perf_counter()
    workers = args.compile_workers
    if workers is None:
        workers = min(12, max(0, (os.cpu_count() or 1) - 2)) if device.type == "cuda" else 0
    precompile_s = precompile(argv, len(tasks), min(workers, len(tasks))) if workers > 0 else 0.0

    graphs = device.type == "cuda" and not args.no_graphs
    sets = 1 if args.hot_l2 or device.type != "cuda" else args.calls
    atol, rtol = ATOL[dtype], RTOL[dtype]
    rows: list[dict[str, Any]] = []
    for spec, bs, cfgs in plan:
        group = time_group(spec, bs, cfgs, shapes, launch_defaults, args, sets, graphs)
        print_table(group, args.top)
        rows.extend(group)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    best: dict[str, dict[str, Any]] = {}
    print(f"\n== best per case ({'CUDA graph' if graphs else 'eager'}, us per call) ==")
    print(f"{'case':<15} {'bs':>3} {'default':>8} {'best':>8} {'speedup':>7}  config")
    for spec, bs, _ in plan:
        group = [r for r in rows if r["case"] == spec.name and r["batch_size"] == bs]
        default = next(r for r in group if r["is_default"])
        good = [r for r in group if r["ok"] and r["us"] is not None]
        if not good:
            print(f"{spec.name:<15} {bs:>3}  no config ran correctly")
            continue
        b = min(good, key=lambda r: r["us"])
        best[f"{spec.name}/bs{bs}"] = b
        d_us = default["us"]
        print(f"{spec.name:<15} {bs:>3} {d_us or float('nan'):>8.2f} {b['us']:>8.2f} "
              f"{(d_us / b['us']) if d_us else float('nan'):>6.2f}x  num_warps={b['num_warps']} "
              f"num_stages={b['num_stages']} block_n={b['block_n']} num_splits={b['num_splits']}"
              f" (splits {b['splits']}, active {b['active_splits']})")  # fmt: skip
    failures = [r for r in rows if r["us"] is not None and not r["ok"]]
    errors = [r for r in rows if r["us"] is None]
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(rows)} configs timed, {len(failures)} wrong results (tol abs {atol:g}, rel "
          f"{rtol:g}), {len(errors)} errors; {elapsed:.0f} s (precompile {precompile_s:.0f} s)")

    if args.json_out:
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
            "dtype": str(dtype).removeprefix("torch."), "num_heads": shapes.num_heads,
            "num_kv_heads": shapes.num_kv_heads, "head_dim": shapes.head_dim,
            "page_size": shapes.page_size, "context_len": shapes.context_len,
            "batch_sizes": batch_sizes, "grid": grid, "graphs": graphs, "calls": args.calls,
            "replays": args.replays, "kv_sets": sets, "triton_defaults": list(launch_defaults),
            "atol": atol, "rtol": rtol, "elapsed_s": elapsed, "precompile_s": precompile_s,
            "compile_workers": workers, "distinct_kernels": len(tasks),
        }  # fmt: skip
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "rows": rows, "best": best}, indent=1))
        print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
