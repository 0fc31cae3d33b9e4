"""Launch plans measured on a GPU model, used before gemm_split.launch_plan's rule of thumb.

`scripts/bench_quant_gemm.py --write-table` times each quantized GEMM shape over a grid of
plans and stores, per GPU name, format and [N, K] shape, the fastest plan at each row count
it measured (only where it beat the default plan by more than a noise margin):

    plan_tables/<GPU name>.json   {"fp8": {"6144x4096": {"1": {block_m, ...}, "16": ...}}}

A GEMM of m rows takes the plan measured at the smallest row count >= m; past the largest, or
for a shape, format or GPU with no entry, the rule of thumb. Formats: "fp8" (128x128 block
weights, activations quantized per 128 columns: DeepSeek-V3 / Kimi / GLM FP8), "int4-g<G>"
(W4A16, group G), "nvfp4". Exact mode never reads the tables (its plan must not depend on the
row count); SPECSERVE_PLAN_TABLES=0 turns them off (A/B runs). Dense weights have formats too:
"bf16" and "fp16" hold the plans of kernels/dense_gemm.py that beat cuBLAS (without an entry
the dense layers keep F.linear).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

from specserve.kernels.dispatch import EXACT
from specserve.kernels.gemm_split import GemmPlan

TABLE_DIR = Path(__file__).with_name("plan_tables")
ENV = "SPECSERVE_PLAN_TABLES"


def table_file(gpu_name: str, table_dir: Path | None = None) -> Path:
    """The table of one GPU model (its name as torch reports it, made a file name)."""
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", gpu_name).strip("_")
    return (table_dir or TABLE_DIR) / f"{slug}.json"


@functools.cache
def _load(path: Path) -> dict:
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    for fmt, shapes in table.items():  # a malformed entry fails here, naming the file
        for shape, by_m in shapes.items():
            for m, fields in by_m.items():
                try:
                    int(m), GemmPlan(**fields)
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{path}: bad plan {fmt}/{shape}/{m}: {err}") from err
    return table


def lookup(table: dict, fmt: str, m: int, n: int, k: int) -> GemmPlan | None:
    """The plan measured at the smallest row count >= m for this format and shape."""
    by_m = table.get(fmt, {}).get(f"{n}x{k}")
    if not by_m or m <= 0:
        return None
    measured = sorted(int(x) for x in by_m)
    pick = next((x for x in measured if x >= m), None)
    return None if pick is None else GemmPlan(**by_m[str(pick)])


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=4096)
def _cached_plan(index: int, fmt: str, m: int, n: int, k: int) -> GemmPlan | None:
    return lookup(_load(table_file(_gpu_name(index))), fmt, m, n, k)


def tuned_plan(fmt: str, m: int, n: int, k: int, device: torch.device) -> GemmPlan | None:
    """The measured plan for this GEMM on this GPU, or None (then the rule of thumb). Called
    per GEMM launch (eager prefill too): answers are cached per device and shape."""
    if device.type != "cuda" or EXACT.on or os.environ.get(ENV) == "0":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cached_plan(index, fmt, m, n, k)


def w4_format(group: int, fp4: bool) -> str:
    return "nvfp4" if fp4 else f"int4-g{group}"
