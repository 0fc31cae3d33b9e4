"""Time GLM-5's DSA top-k selection (GPU only): the one-program-a-token kernel and the split
form (kernels/dsa_select.py) against the torch.topk form (kernels/dsa_index.py: select_slots
over the whole row), per layer call, in CUDA graphs, over context lengths and token counts.

    python scripts/bench_dsa_select.py --out OUT.json
    python scripts/bench_dsa_select.py --lengths 1024,8192,32768,131072 --tokens 1,16,64
    python scripts/bench_dsa_select.py --width 202752   # GLM-5's context limit for every row

Each row: tokens (decode rows, one per request), the row width (the graph's page-table width:
by default the length rounded up to a page, as a --max-model-len of that size gives), the
scores' visible length, k = 2048, and ms per call of each form. The kernels' work follows the
length; torch.topk's the width. TritonDSA.select takes the split form past
dsa_select.ONE_PROGRAM_MAX_WIDTH: this is the measurement that threshold should come from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.kernels import dsa_index as di  # noqa: E402
from specserve.kernels import dsa_select as ds  # noqa: E402

K, PAGE = 2048, 64


def case(tokens: int, length: int, width: int | None = None) -> dict:
    from triton.testing import do_bench_cudagraph

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(length + tokens)
    pages = -(-max(length, width or 0) // PAGE)
    width = pages * PAGE
    scores = torch.randn(tokens, width, device=dev, generator=gen)
    scores[:, length:] = float("-inf")
    seq = torch.full((tokens,), length, dtype=torch.int32, device=dev)
    table = torch.arange(tokens * pages, dtype=torch.int32, device=dev).view(tokens, pages)
    qsl = torch.arange(tokens + 1, dtype=torch.int32, device=dev)
    token_req = di.token_requests(qsl, tokens)
    k = min(K, width)
    fast = ds.select_slots_fast(scores, k, token_req, seq, table, PAGE)
    ref = di.select_slots(scores, k, qsl, table, PAGE)
    assert torch.equal(fast, ref), "the kernel and select_slots disagree"
    split = ds.select_slots_split(scores, k, token_req, seq, table, PAGE)
    assert torch.equal(split, ref), "the split form and select_slots disagree"
    return {
        "tokens": tokens, "length": length, "width": width, "k": k,
        "kernel_ms": do_bench_cudagraph(
            lambda: ds.select_slots_fast(scores, k, token_req, seq, table, PAGE), rep=50),
        "split_ms": do_bench_cudagraph(
            lambda: ds.select_slots_split(scores, k, token_req, seq, table, PAGE), rep=50),
        "topk_ms": do_bench_cudagraph(
            lambda: di.select_slots(scores, k, qsl, table, PAGE), rep=50),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192,32768,131072",
                   type=lambda t: parse_positive_list(t, int, "--lengths"))
    p.add_argument("--tokens", default="1,16,64",
                   type=lambda t: parse_positive_list(t, int, "--tokens"))
    p.add_argument("--width", type=int, default=None,
                   help="every row's width (a context limit); default: its length")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = []
    for tokens in args.tokens:
        for length in args.lengths:
            row = case(tokens, length, args.width)
            rows.append(row)
            print(f"tokens {tokens:3d}  length {length:6d}  kernel {row['kernel_ms']:.4f} ms  "
                  f"split {row['split_ms']:.4f} ms  torch.topk {row['topk_ms']:.4f} ms  "
                  f"({row['topk_ms'] / row['kernel_ms']:.2f}x)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                       indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
