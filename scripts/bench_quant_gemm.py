"""Time the quantized and dense GEMMs at Llama-3.1-8B shapes over launch plans (GPU only).

For each format (fp8 block W8A8, int4 g128 W4A16, nvfp4 W4A16, and bf16: the dense Triton
GEMM of kernels/dense_gemm.py against cuBLAS's F.linear as its default), each linear shape of the
model and each row count M, times the default plan (gemm_split.launch_plan) and a grid of
alternatives with triton.testing.do_bench_cudagraph (each call replayed from a CUDA graph, so
the host's launch cost is left out, as in the engine's decode graphs), next to the dense bf16
F.linear of the same shape. Prints one line per case and writes the full table as JSON:

    python scripts/bench_quant_gemm.py --out quant_gemm.json [--m 1,64] [--quick]
    python scripts/bench_quant_gemm.py --out quant_gemm.json --m 1,16,64 --write-table

GB/s counts the weight bytes the format streams (codes + scales), as the floor does. The
default is the plan without a measured one (each kernel's rule_plan). --write-table stores, for
this GPU, each case's fastest plan where it beat the default by more than --min-gain
(kernels/plan_tables/<GPU>.json, merged into what is there; a case where the default was as
good drops its entry), which fp8_linear and w4a16_mm then use (kernels/plan_table.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.kernels import dense_gemm, fp8_gemm, plan_table, w4a16_gemm  # noqa: E402
from specserve.kernels.gemm_split import GemmPlan  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}  # name -> (N, K)
DENSE_ONLY = {"lm_head": (128256, 4096)}  # stays bf16 in quantized checkpoints: swept as bf16
ROW_PARALLEL = ("o", "down")  # under tensor parallelism K is split; the others split N


def shapes_at(tp: int, fmt: str = "fp8") -> dict[str, tuple[int, int]]:
    """Each linear's [N, K] of this format on one rank of tensor parallelism tp."""
    shapes = {**SHAPES, **DENSE_ONLY} if fmt == "bf16" else SHAPES
    return {name: (n, k // tp) if name in ROW_PARALLEL else (n // tp, k)
            for name, (n, k) in shapes.items()}  # fmt: skip
FORMATS = ("fp8", "int4", "nvfp4", "bf16")
TABLE_FORMAT = {"fp8": "fp8", "int4": "int4-g128", "nvfp4": "nvfp4", "bf16": "bf16"}


def rule_plan(fmt: str, m: int, n: int, k: int) -> GemmPlan | None:
    """The plan the kernel takes without a measured one (None: bf16's is cuBLAS)."""
    dev = torch.device("cuda")
    if fmt == "bf16":
        return None
    if fmt == "fp8":  # bf16 rows quantized in a GEMV's loop, else FP8 rows
        gemv = 0 < m <= fp8_gemm.gemm_split.GEMV_MAX_ROWS
        return fp8_gemm.rule_plan(m, n, k, dev, 128, 2 if gemv else 1)
    return w4a16_gemm.rule_plan(m, n, k, dev)


def merge_table(table: dict, rows: list[dict], min_gain: float) -> dict:
    """table (plan_table's form) with each row's case set to its best plan where that beat
    the default by more than min_gain (a fraction of the default's time), else removed."""
    for r in rows:
        shapes = table.setdefault(TABLE_FORMAT[r["format"]], {})
        by_m = shapes.setdefault(f"{r['n']}x{r['k']}", {})
        if r["best_ms"] < r["default_ms"] * (1 - min_gain):
            by_m[str(r["m"])] = r["best_plan"]
        else:
            by_m.pop(str(r["m"]), None)
    out = {f: {s: dict(sorted(b.items(), key=lambda kv: int(kv[0]))) for s, b in sh.items() if b}
           for f, sh in table.items()}  # fmt: skip
    return {f: shapes for f, shapes in out.items() if shapes}


def make_case(fmt: str, m: int, n: int, k: int):
    """(fn(plan) running the GEMM, weight bytes streamed)."""
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if fmt == "bf16":
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)

        def fn(plan):  # no plan: what the dense layers run without a table entry
            if plan is None:
                return torch.nn.functional.linear(x, w)
            return dense_gemm.dense_gemm(x, w, None, plan)

        return fn, w.numel() * 2
    if fmt == "fp8":
        w = torch.randn(n, k, device=dev).to(fp8_gemm.FP8)
        ws = torch.rand(-(-n // 128), -(-k // 128), device=dev) + 0.5
        nbytes = w.numel() + ws.numel() * 4

        def fn(plan):  # activations quantized inside the GEMM's K loop
            return fp8_gemm.fp8_linear(x, w, ws, 128, 128, 128, None, plan)

        return fn, nbytes
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
    group = 128 if fmt == "int4" else 16
    scales = torch.rand(n, k // group, device=dev) * 0.01
    scales = scales.to(torch.bfloat16 if fmt == "int4" else torch.float8_e4m3fn)
    row = torch.rand(n, device=dev) if fmt == "nvfp4" else None
    nbytes = (
        packed.numel() * 4
        + scales.numel() * scales.element_size()
        + (row.numel() * 4 if row is not None else 0)
    )

    def fn(plan):
        return w4a16_gemm.w4a16_mm(x, packed, scales, group, fmt == "nvfp4", row, plan)

    return fn, nbytes


def dense_plans(m: int, quick: bool) -> list[GemmPlan]:
    """The bf16 grid: tensor-core tiles with split-K; GEMV plans at one row."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bns, bks = ((64, 128), (64, 128)) if quick else ((32, 64, 128), (64, 128, 256))
    stages = (4,) if quick else (3, 4, 5)
    grid = [GemmPlan(bm, bn, bk, s, 4, st)
            for bn, bk, s, st in itertools.product(bns, bks, (1, 2, 4, 8), stages)]  # fmt: skip
    if m == 1:  # the fp32 products [BK, BN] stay in registers: BK x BN / threads each
        gemv = (((32, 64), (64, 128), (1, 2, 4), (4,)) if quick
                else ((16, 32, 64), (64, 128), (1, 2, 4, 8), (2, 4, 8)))  # fmt: skip
        grid += [GemmPlan(1, bn, bk, s, w, 3) for bn, bk, s, w in itertools.product(*gemv)]
    return grid


def plans(fmt: str, m: int, quick: bool) -> list[GemmPlan]:
    if fmt == "bf16":
        return dense_plans(m, quick)
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    bns = (32, 64, 128) if not quick else (64,)
    # 4-bit tiles of 128 columns are 4 KB a step: at decode sizes the wider K step and the
    # deeper pipeline put more bytes in flight per SM (the quick grid keeps both for m <= 16)
    bks = (128,) if fmt == "fp8" else (64, 128, 256) if not quick else (128, 256)[: 2 if m <= 16 else 1]
    splits = (1, 2, 4, 8)
    stages = (3, 4) if not quick or (fmt != "fp8" and m <= 16) else (3,)
    grid = [
        GemmPlan(bm, bn, bk, s, 4, st)
        for bn, bk, s, st in itertools.product(bns, bks, splits, stages)
    ]
    if m == 1:  # GEMV plans (no tensor cores): narrower row tiles, more K splits, and 2 warps
        # (sm_90 code of the FP8 GEMV step, BN 64: 5.3 instructions an element with 2 warps,
        # 7.4 with 4: scripts/sass_loop.py)
        gemv_bks = (128,) if fmt == "fp8" else (128, 256)
        # the 4-bit GEMV holds 72 registers a thread (sm_90): wider row tiles fit too
        gemv_bns = ((32, 64) if quick else (16, 32, 64)) + (() if fmt == "fp8" else (128,))
        gemv_splits = (2, 4, 8) if quick else (1, 2, 4, 8, 16)
        # the 4-bit GEMV's weight tiles pipelined (3 stages: two steps' tiles in flight through
        # cp.async) or loaded and waited for at each step (1)
        gemv_stages = (3,) if fmt == "fp8" else (1, 3)
        grid += [GemmPlan(1, bn, bk, s, w, st) for bn, bk, s, w, st in
                 itertools.product(gemv_bns, gemv_bks, gemv_splits, (2, 4), gemv_stages)]  # fmt: skip
    elif m <= 8 and fmt != "fp8":  # the 4-bit GEMV over a few rows (a verify's, small batches):
        # each weight decoded once for all of them (sm_90, 4 rows: 667 instructions a 64x128
        # step against the tensor-core tile's 329, at 168 registers)
        bm = 1 << (m - 1).bit_length()
        grid += [GemmPlan(bm, bn, bk, s, 4, st) for bn, bk, s, st in
                 itertools.product((32, 64), (128,) if quick else (64, 128, 256),
                                   (2, 4, 8), (1, 3))]  # fmt: skip
    return grid


def main() -> int:
    from triton.testing import do_bench_cudagraph

    def do_bench(fn):  # ms per call from a CUDA graph's replays: no host launch cost
        return do_bench_cudagraph(fn, rep=50)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--m", default="1,64", help="row counts (decode batch sizes)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--tp", default="1", help="tensor-parallel sizes whose shard shapes to time")
    p.add_argument("--write-table", nargs="?", const="", default=None, metavar="PATH",
                   help="store the winning plans (default path: this GPU's plan table)")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="a plan replaces the default only if this much faster (fraction)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rows = []
    for fmt in args.formats.split(","):
        cases = [(f"{name}/tp{tp}" if tp > 1 else name, n, k)
                 for tp in map(int, args.tp.split(","))
                 for name, (n, k) in shapes_at(tp, fmt).items()]  # fmt: skip
        for name, n, k in cases:
            for m in map(int, args.m.split(",")):
                fn, nbytes = make_case(fmt, m, n, k)
                dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bf16_ms = do_bench(lambda x=x, w=dense: torch.nn.functional.linear(x, w))
                default = rule_plan(fmt, m, n, k)
                times = {}
                for plan in [default, *plans(fmt, m, args.quick)]:
                    try:
                        times[plan] = do_bench(lambda plan=plan, fn=fn: fn(plan))
                    except Exception as err:  # a plan the compiler rejects (resources)
                        print(f"  {plan}: {type(err).__name__}")
                best = min(times, key=times.get)
                row = {
                    "format": fmt,
                    "linear": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "weight_bytes": nbytes,
                    "default_plan": default.__dict__ if default else "cublas",
                    "default_ms": times[default],
                    "best_plan": best.__dict__ if best else "cublas",
                    "best_ms": times[best],
                    "bf16_ms": bf16_ms,
                    "default_gbs": nbytes / times[default] / 1e6,
                    "best_gbs": nbytes / times[best] / 1e6,
                    "bf16_gbs": dense.numel() * 2 / bf16_ms / 1e6,
                }
                rows.append(row)
                print(
                    f"{fmt:5} {name:11} M {m:3}: default {row['default_ms'] * 1e3:7.1f} us "
                    f"({row['default_gbs']:5.0f} GB/s), best {row['best_ms'] * 1e3:7.1f} us "
                    f"({row['best_gbs']:5.0f} GB/s) {best or 'cublas'}, bf16 {bf16_ms * 1e3:7.1f} us "
                    f"({row['bf16_gbs']:5.0f} GB/s)",
                    flush=True,
                )
                del dense
        # after each format: a sweep cut short keeps what it finished
        Path(args.out).write_text(json.dumps(rows, indent=1))
        if args.write_table is not None:
            path = Path(args.write_table or plan_table.table_file(torch.cuda.get_device_name()))
            old = json.loads(path.read_text()) if path.is_file() else {}
            path.parent.mkdir(parents=True, exist_ok=True)
            done = [r for r in rows if r["format"] == fmt]
            path.write_text(json.dumps(merge_table(old, done, args.min_gain), indent=1) + "\n")
            print(f"plan table: {path} ({fmt})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
