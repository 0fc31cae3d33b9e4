"""The all-reduce part of `specserve doctor`: which backends this machine can use (and why
not), the dispatch tables measured here (size -> backend, us), and `--comm-measure`, which
spawns one process per GPU (two gloo processes on a CPU-only machine) to measure one now
through the engine's own start-up path. torch is imported only inside the functions, as in
the rest of the doctor."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

DEFAULT_HIDDEN = 4096  # Llama-3.1-8B
DEFAULT_ROWS = "1,2,4,8,16,32,64,128,256,512,1024,2048"


def comm_facts(facts: dict[str, Any], world: int | None = None) -> dict[str, Any]:
    """`backends.availability`'s facts from the doctor's (a group of every visible GPU)."""
    gpus = facts["gpus"]
    n = len(gpus) if world is None else world
    cuda = bool(facts["cuda_available"] and gpus)
    peer = all(facts["peer_access"][i][j] for i in range(n) for j in range(n) if i != j)
    runtime = facts["cuda_runtime"]
    return {
        "device": "cuda" if cuda else "cpu",
        "world": n if cuda else 2,
        "dtype": ("bfloat16" if facts["bf16"] else "float16") if cuda else "float32",
        "peer_access": peer,
        "symm_mem": facts["symm_mem_importable"],
        "cuda_version": runtime if runtime[:1].isdigit() else None,
        "triton": cuda and facts["triton"] != "not installed",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }


def backend_rows(facts: dict[str, Any]) -> list[dict[str, Any]]:
    from specserve.distributed.backends import NAMES, availability

    reasons = availability(comm_facts(facts))
    return [{"name": n, "usable": not reasons[n], "reason": reasons[n]} for n in NAMES]


def table_summaries(cache_dir: str = "") -> list[dict[str, Any]]:
    from specserve.distributed.dispatch import cache_dir as default_dir
    from specserve.distributed.dispatch import load_all

    return load_all(default_dir(cache_dir))


def format_comm(facts: dict[str, Any]) -> list[str]:
    world = comm_facts(facts)["world"]
    out = [f"All-reduce backends (a group of {world})"]
    width = max(len(row["name"]) for row in facts["comm_backends"])
    for row in facts["comm_backends"]:
        verdict = "yes" if row["usable"] else "no "
        out.append(f"  {row['name']:<{width}}  {verdict}  {row['reason']}".rstrip())
    for record in facts["comm_tables"]:
        out.extend(format_table(record))
    if not facts["comm_tables"]:
        out.append(
            "All-reduce dispatch: none measured on this machine yet (it is measured at "
            "start-up under TP; `specserve doctor --comm-measure` measures one now)"
        )
    return out


def format_table(record: dict[str, Any]) -> list[str]:
    key = record["key"]
    where = (
        f"{len(key.get('gpus', []))} x {key['gpus'][0]}"
        if key.get("gpus")
        else f"CPU {key.get('cpu', '')}"
    )
    out = [
        f"All-reduce dispatch: world {key['world']}, {key['dtype']}, hidden {key['hidden']}, "
        f"{where}, measured {record.get('measured', '?')} ({record['path']})",
        f"  {'rows':>6} {'bytes':>9}  {'all-reduce':<28} all-reduce + add + RMSNorm",
    ]
    by_size: dict[int, dict[str, Any]] = {}
    for e in record["entries"]:
        by_size.setdefault(e["nbytes"], {"rows": e["rows"]})[e["op"]] = e
    for nbytes, ops in sorted(by_size.items()):
        cells = []
        for op in ("all_reduce", "add_rms_norm"):
            e = ops.get(op)
            us = e["us"].get(e["choice"]) if e else None
            cells.append(f"{e['choice']} {us if us is not None else '-'} us" if e else "-")
        out.append(f"  {ops['rows']:>6} {nbytes:>9}  {cells[0]:<28} {cells[1]}")
    for name, why in sorted(record.get("unavailable", {}).items()):
        out.append(f"  unavailable then: {name}: {why}")
    return out


# -- --comm-measure ----------------------------------------------------------------------------


def add_measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--comm-measure",
        action="store_true",
        help="measure the all-reduce dispatch table now (one process per GPU)",
    )
    p.add_argument(
        "--comm-world",
        type=int,
        default=0,
        help="processes for --comm-measure (default: every GPU; 2 on the CPU)",
    )
    p.add_argument(
        "--comm-hidden",
        type=int,
        default=DEFAULT_HIDDEN,
        help="hidden size of the measured messages [rows, hidden]",
    )
    p.add_argument("--comm-rows", default=DEFAULT_ROWS, help="comma-separated message rows")
    p.add_argument(
        "--comm-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="message dtype (auto: bfloat16 on GPUs, float32 on the CPU)",
    )
    p.add_argument("--comm-cache-dir", default="", help="where the table is stored")


def measure(args: argparse.Namespace, facts: dict[str, Any]) -> None:
    """Spawn the group; rank 0 stores the table in the cache the report then reads."""
    import torch.multiprocessing as mp

    cuda = bool(facts["gpus"])
    world = args.comm_world or (len(facts["gpus"]) if cuda else 2)
    if world < 2 or (cuda and world > len(facts["gpus"])):
        raise ValueError(
            f"--comm-measure needs 2 <= --comm-world <= the GPU count "
            f"({len(facts['gpus'])}), got {world}"
        )
    rows = [int(r) for r in args.comm_rows.split(",") if r.strip()]
    if not rows or min(rows) < 1:
        raise ValueError(f"--comm-rows must list positive row counts, got {args.comm_rows!r}")
    dtype = args.comm_dtype if args.comm_dtype != "auto" else ("bfloat16" if cuda else "float32")
    # never NVLink multicast (NVLS): not for NCCL, not for torch symmetric memory
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        _measure_rank,
        args=(world, port, cuda, args.comm_hidden, rows, dtype, args.comm_cache_dir),
        nprocs=world,
        join=True,
    )


def _measure_rank(
    rank: int,
    world: int,
    port: int,
    cuda: bool,
    hidden: int,
    rows: list[int],
    dtype: str,
    cache_dir: str,
) -> None:
    import torch

    from specserve.config import CommConfig
    from specserve.distributed import parallel_state
    from specserve.distributed.communicator import Communicator

    parallel_state.init_distributed(
        world, rank, "nccl" if cuda else "gloo", f"tcp://127.0.0.1:{port}"
    )
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        Communicator(
            parallel_state.get_tp_group(),
            device,
            getattr(torch, dtype),
            hidden,
            rows,
            CommConfig(comm_tune="refresh", comm_cache_dir=cache_dir),
        )
    finally:
        parallel_state.destroy()
