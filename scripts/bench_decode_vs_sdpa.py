#!/usr/bin/env python3
"""Decode attention at long context: our paged kernel against torch's fused attention kernels
(cuDNN, FlashAttention-2, memory-efficient) on the same queries, keys and values.

Ours reads the KV through a page table (shuffled pages, as in serving); SDPA gets the same K/V
gathered into contiguous [bs, kv_heads, L, head_dim] tensors (GQA through `enable_gqa`, so no
head is copied), which is the layout those kernels are fastest on. Each call is one decode
step's attention of one layer: bs queries of num_heads heads over L = context_len + 1 keys.
Calls are captured in a CUDA graph and replayed (launch overhead excluded); below ~256 MB of
KV the captured calls cycle over several disjoint KV sets so that the reads come from HBM, not
L2. Each kernel's output is checked once against the fp32 reference. Reported per row: us per
call, the KV bandwidth it reached (K + V bytes / time), and ours against the fastest SDPA
backend that ran. FlashAttention-3 itself is not part of torch; cuDNN's attention is the
Hopper-specific fused kernel torch ships.

    python scripts/bench_decode_vs_sdpa.py --json-out out/decode_vs_sdpa.json
    python scripts/bench_decode_vs_sdpa.py --context-lens 8192 --batch-sizes 16,32
    # CPU smoke test (interpreter and torch's math backend, fp32; timings meaningless):
    python scripts/bench_decode_vs_sdpa.py --context-lens 8 --batch-sizes 2 --num-heads 4 \
        --num-kv-heads 2 --head-dim 16 --page-size 4 --backends math --replays 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
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
    Shapes,
    check,
    make_batch,
    time_us,
    warm_up,
)
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.config import CacheConfig  # noqa: E402

DECODE = next(c for c in CASES if c.name == "decode")
BACKENDS = ("cudnn", "flash", "efficient", "math")
COLD_BYTES = 256 << 20  # below this much KV a call set, cycle over several (L2: 50-60 MB)


def sdpa_backend(name: str):  # noqa: ANN201
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]  # fmt: skip


def contiguous_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[pages, page_size, KVH, D] through table [bs, P] -> [bs, KVH, seq_len, D] contiguous."""
    bs, pages = table.shape
    rows = cache[table.long()].reshape(bs, pages * cache.shape[1], *cache.shape[2:])
    return rows[:, :seq_len].transpose(1, 2).contiguous()


def bench_point(ctx: int, bs: int, s: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    seq_len = ctx + 1
    elt = torch.finfo(s.dtype).bits // 8
    kv_bytes = 2 * bs * seq_len * s.num_kv_heads * s.head_dim * elt
    sets = max(1, min(8, math.ceil(COLD_BYTES / kv_bytes)))
    row: dict[str, Any] = {"context_len": ctx, "batch_size": bs, "kv_bytes": kv_bytes,
                           "kv_sets": sets}  # fmt: skip
    if 2 * sets * kv_bytes > args.max_kv_gb * 1e9:  # paged + contiguous copies
        row["skipped"] = f"needs {2 * sets * kv_bytes / 1e9:.1f} GB of KV (--max-kv-gb)"
        return row
    s.context_len = ctx
    batch = make_batch(DECODE, bs, s, sets, args.seed)
    ref = batch.reference(DECODE)
    atol, rtol = ATOL[s.dtype], RTOL[s.dtype]
    graphs = s.device.type == "cuda"

    def timed(name: str, call, out_of) -> None:  # noqa: ANN001
        try:
            abs_err, rel_err = check(out_of(call(0)), ref)
            warm_up(call, sets, s.device, args.calls)
            times, _ = time_us(call, sets, s.device, args.calls, args.replays, graphs)
            us = statistics.median(times)
            row[name] = {"us": us, "gb_s": kv_bytes / us / 1e3, "max_abs_err": abs_err,
                         "ok": abs_err <= atol and rel_err <= rtol}  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape or dtype
            last = str(exc).strip().splitlines()
            row[name] = {"error": f"{type(exc).__name__}: {last[0] if last else ''}"[:200]}
            if graphs:
                torch.cuda.synchronize()

    timed("ours", lambda i: batch.call(DECODE, DEFAULT_CONFIG, i), lambda o: o)
    q = batch.q.view(bs, s.num_heads, 1, s.head_dim)
    ks = [contiguous_kv(batch.k_cache, t, seq_len) for t in batch.page_tables]
    vs = [contiguous_kv(batch.v_cache, t, seq_len) for t in batch.page_tables]
    scale = s.head_dim**-0.5
    for name in args.backends:
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def call(i: int, name: str = name) -> torch.Tensor:
            with sdpa_kernel(sdpa_backend(name)):
                return sdpa(q, ks[i], vs[i], scale=scale, enable_gqa=True)

        timed(f"sdpa_{name}", call, lambda o: o.view(bs, s.num_heads, s.head_dim))
    best = min((row[f"sdpa_{n}"]["us"] for n in args.backends
                if row[f"sdpa_{n}"].get("ok")), default=None)  # fmt: skip
    ours = row["ours"].get("us") if row["ours"].get("ok") else None
    row["ours_vs_best_sdpa"] = best / ours if best and ours else None  # > 1: ours is faster
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-lens", default="1024,8192,32768",
                    type=lambda t: parse_positive_list(t, int, "--context-lens"))
    ap.add_argument("--batch-sizes", default="1,16,32,64",
                    type=lambda t: parse_positive_list(t, int, "--batch-sizes"))
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=CacheConfig().page_size)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backends", default="cudnn,flash,efficient",
                    type=lambda t: [b for b in t.split(",") if b])
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one CUDA graph")
    ap.add_argument("--replays", type=int, default=5, help="timed replays (median reported)")
    ap.add_argument("--max-kv-gb", type=float, default=40.0,
                    help="skip points whose KV copies need more device memory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        ap.error(f"--backends: unknown {bad}; choose from {','.join(BACKENDS)}")
    if args.num_heads % args.num_kv_heads:
        ap.error("--num-heads must be a multiple of --num-kv-heads")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = Shapes(args.num_heads, args.num_kv_heads, args.head_dim, args.page_size, 0,
               getattr(torch, args.dtype), device)  # fmt: skip
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"decode attention, {gpu}, {args.dtype}, {args.num_heads}/{args.num_kv_heads} heads "
          f"x {args.head_dim}, page {args.page_size}: us per call (KV GB/s)", flush=True)
    rows = []
    for ctx in args.context_lens:
        for bs in args.batch_sizes:
            row = bench_point(ctx, bs, s, args)
            rows.append(row)
            cells = []
            for name in ("ours", *(f"sdpa_{b}" for b in args.backends)):
                r = row.get(name, {})
                cells.append(f"{name} " + (f"{r['us']:.1f} ({r['gb_s']:.0f})" if "us" in r
                                           else ("refused" if "error" in r else "-")))
                if r.get("ok") is False:
                    cells[-1] += " WRONG"
            ratio = row.get("ours_vs_best_sdpa")
            print(f"ctx {ctx:6d} bs {bs:3d}  " + ("  ".join(cells) if "skipped" not in row
                                                  else row["skipped"])
                  + (f"  best SDPA / ours {ratio:.2f}x" if ratio else ""), flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"device": gpu, "dtype": args.dtype,
                                             "rows": rows}, indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
