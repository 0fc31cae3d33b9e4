"""MLA attention kernel timings on a GPU (kernels/mla_attention.py, absorbed form) and the
bandwidth each achieves: decode, chain verify (a causal custom mask of 4 rows) and tree verify
(16 nodes), at DeepSeek-V3 / Kimi K2 dims (L 512, R 64) for several head counts (TP shards),
batch sizes and context lengths, over a small grid of launch parameters.

    python scripts/bench_mla.py [--heads 128,16] [--batch-sizes 1,64]
                                [--contexts 4096,16384] [--json-out FILE]

Bytes counted per launch: every request's latent rows (context x 576 x 2 B), read once, plus
q and the output; GB/s = bytes / time (the kernel cannot beat the HBM bandwidth; at batch 1
the latent of a 4K context is 4.7 MB, ~1 us at 4.8 TB/s, so launch latency dominates there).
Every config's output is checked against the torch reference (relative L2 per row) first.
Timed in CUDA graphs of 20 launches (specserve/bench/attention_sweep.py), median of replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.attention_sweep import check, time_us, warm_up  # noqa: E402
from specserve.kernels import mla_attention as ma  # noqa: E402

RANK, ROPE, PAGE = 512, 64, 64
CASES = {"decode": (1, None), "chain4": (4, "causal"), "tree16": (16, "tree")}
GRID = {"max_rows": [16, 32], "block_n": [16, 32, 64], "num_warps": [4, 8],
        "num_stages": [1, 2]}  # fmt: skip


def make(
    bs: int, heads: int, ctx: int, q_len: int, mask: str | None, sets: int, gen: torch.Generator
) -> list[dict]:
    """`sets` independent batches (distinct caches: the timed loop is not served from L2)."""
    out = []
    for _ in range(sets):
        pages = math.ceil(ctx / PAGE)
        cache = torch.randn(bs * pages + 1, PAGE, RANK + ROPE, generator=gen).to(
            "cuda", torch.bfloat16
        )
        table = torch.randperm(bs * pages, generator=gen).int().view(bs, pages).cuda()
        t = bs * q_len
        q_lat = torch.randn(t, heads, RANK, generator=gen).to("cuda", torch.bfloat16)
        q_pe = torch.randn(t, heads, ROPE, generator=gen).to("cuda", torch.bfloat16)
        qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device="cuda")
        lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
        custom = None
        if mask is not None:
            m = torch.ones(q_len, q_len, dtype=torch.bool).tril()
            if mask == "tree":  # node i's parent: a random earlier node
                m = torch.eye(q_len, dtype=torch.bool)
                for i in range(1, q_len):
                    m[i] |= m[int(torch.randint(0, i, (1,), generator=gen))]
            custom = m.expand(bs, q_len, q_len).contiguous().cuda()
        out.append(
            {
                "q_lat": q_lat,
                "q_pe": q_pe,
                "cache": cache,
                "qsl": qsl,
                "lens": lens,
                "table": table,
                "mask": custom,
                "q_len": q_len,
            }
        )
    return out


def launch(b: dict, cfg: dict) -> torch.Tensor:
    decode = b["q_len"] == 1 and b["mask"] is None
    return ma.mla_attention(
        b["q_lat"],
        b["q_pe"],
        b["cache"],
        None if decode else b["qsl"],
        b["lens"],
        b["table"],
        b["q_len"],
        0.135,
        b["mask"],
        **cfg,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="128,16")  # DeepSeek-V3 TP1; TP8 (Kimi TP4)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json-out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    rows = []
    configs = [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())]
    print(
        f"{'case':8} {'heads':>5} {'bs':>3} {'ctx':>6} {'default us':>10} {'GB/s':>6} "
        f"{'best us':>8} {'GB/s':>6}  best config"
    )
    for case, heads, bs, ctx in itertools.product(
        args.cases.split(","),
        map(int, args.heads.split(",")),
        map(int, args.batch_sizes.split(",")),
        map(int, args.contexts.split(",")),
    ):
        q_len, mask = CASES[case]
        sets = 1 if bs * ctx >= 64 * 4096 else 4
        batches = make(bs, heads, ctx + q_len, q_len, mask, sets, gen)
        b0 = batches[0]
        ref = (
            ma.mla_attention_ref(
                b0["q_lat"],
                b0["q_pe"],
                b0["cache"],
                b0["qsl"],
                b0["lens"],
                b0["table"],
                0.135,
                b0["mask"],
            )
            if bs * ctx <= 16 * 4096
            else None
        )
        nbytes = bs * ((ctx + q_len) * (RANK + ROPE) + 2 * q_len * heads * (2 * RANK + ROPE)) * 2
        results = {}
        for cfg in [{}] + configs:
            key = json.dumps(cfg, sort_keys=True)
            try:
                out = launch(b0, cfg)
                if ref is not None:
                    _, rel = check(out, ref)
                    if rel > 2e-2:
                        print(
                            f"  {case} {heads} {bs} {ctx} {cfg}: rel error {rel:.3g}",
                            file=sys.stderr,
                        )
                        continue
                call = lambda i, c=cfg, bb=batches: launch(bb[i], c)  # noqa: E731
                warm_up(call, sets, torch.device("cuda"), 20, 0.1)
                times, _ = time_us(call, sets, torch.device("cuda"), 20, 15, graphs=True)
                results[key] = statistics.median(times)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        if "{}" not in results:
            continue
        best = min(results, key=results.get)
        row = {
            "case": case,
            "heads": heads,
            "bs": bs,
            "context": ctx,
            "bytes": nbytes,
            "default_us": results["{}"],
            "best_us": results[best],
            "best": json.loads(best),
        }
        rows.append(row)
        print(
            f"{case:8} {heads:5} {bs:3} {ctx:6} {row['default_us']:10.1f} "
            f"{nbytes / row['default_us'] / 1e3:6.0f} {row['best_us']:8.1f} "
            f"{nbytes / row['best_us'] / 1e3:6.0f}  {best}",
            flush=True,
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
