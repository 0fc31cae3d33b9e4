"""`specserve doctor`: what this machine has, and which fast paths specserve can use on it.

`collect()` gathers facts (versions, GPUs, links between them); `evaluate_fast_paths(facts)` is
a pure function of those facts, so each rule is testable without the hardware. Works on a
CPU-only machine (every GPU path reported unusable, with the reason); only a torch that cannot
be imported makes the command fail.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from specserve.comm_report import (
    backend_rows,
    comm_facts,
    format_comm,
    measure,
    table_summaries,
)

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
FAST_PATHS = (
    "GPU attention kernels (Triton)",
    "CUDA graphs",
    "bf16",
    "NCCL tensor parallelism",
    "symmetric-memory all-reduce",
    "FP8",
    "W4A16 (INT4, weight-only)",
    "NVFP4",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# nvidia-smi topo -m connection codes other than NV<n> (all travel over PCIe)
_PCIE_CODES = {
    "PIX": "PCIe, one switch",
    "PXB": "PCIe, several switches",
    "PHB": "PCIe, through the host bridge",
    "NODE": "PCIe, host bridges within a NUMA node",
    "SYS": "PCIe, across NUMA nodes",
}


@dataclass(frozen=True)
class FastPath:
    name: str
    usable: bool
    reason: str  # why not, or a note when usable


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def parse_topology(text: str) -> list[dict[str, Any]]:
    """GPU pairs from `nvidia-smi topo -m`: [{"a": 0, "b": 1, "link": "NV18", "kind": ...}]
    for a < b. The matrix header names GPU columns first (GPU0 GPU1 ... then NICs / affinity)."""
    lines = [_ANSI.sub("", line).split() for line in text.splitlines() if line.strip()]
    # the header starts "GPU0 GPU1 ..."; GPU0's own row starts "GPU0 X ..." (X = self)
    start = next((i for i, c in enumerate(lines) if c[0] == "GPU0" and c[1:2] != ["X"]), None)
    if start is None:
        return []
    cols = [c for c in lines[start] if re.fullmatch(r"(GPU|NIC)\d+", c)]
    links = []
    for cells in lines[start + 1 :]:
        m = re.fullmatch(r"GPU(\d+)", cells[0])
        if m is None or len(cells) < len(cols) + 1:
            continue
        a = int(m.group(1))
        for col, code in zip(cols, cells[1:]):
            b = int(col[3:])
            if not col.startswith("GPU") or b <= a:
                continue
            kind = "NVLink" if code.startswith("NV") else _PCIE_CODES.get(code, "unknown")
            links.append({"a": a, "b": b, "link": code, "kind": kind})
    return links


def _triton_backend() -> dict[str, Any] | None:
    """specserve's own verdict on its Triton attention backend; None if the module is absent."""
    name = "specserve.layers.backends.triton_backend"
    try:
        mod = importlib.import_module(name)
        ok, reason = mod.available()
    except ModuleNotFoundError as err:
        if err.name == name:
            return None
        return {"available": False, "reason": f"backend import failed: {err}"}
    except Exception as err:  # a half-written or broken backend must not break the doctor
        return {"available": False, "reason": f"backend check failed: {err}"}
    return {"available": bool(ok), "reason": str(reason)}


def _cuda_facts(torch: Any) -> dict[str, Any]:
    n = torch.cuda.device_count()
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        gib = round(p.total_memory / 2**30, 1)
        cc = [p.major, p.minor]
        gpus.append({"index": i, "name": p.name, "memory_gib": gib, "compute_capability": cc})
    # peer[i][j]: GPU i can read/write GPU j's memory directly (NVLink or PCIe P2P)
    peer = [
        [i != j and torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)
    ]
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # CPU builds and some wheels lack the binding
        nccl = "n/a"
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "gpus": gpus,
        "peer_access": peer,
        "nccl": nccl,
        "driver": driver.splitlines()[0].strip() if driver else "n/a",
        "bf16": bool(torch.cuda.is_bf16_supported()),
        "links": parse_topology(_run(["nvidia-smi", "topo", "-m"]) or ""),
    }


def collect(cache_dir: str = "") -> dict[str, Any]:
    """Every fact the report and the fast-path rules need. Raises ImportError without torch.
    cache_dir: where measured all-reduce tables are (default: the user cache dir)."""
    import torch

    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        symm_mem = True
    except Exception:
        symm_mem = False
    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda or "n/a (CPU-only torch build)",
        "triton": _version("triton"),
        "cuda_available": cuda,
        "nccl_available": torch.distributed.is_available()
        and torch.distributed.is_nccl_available(),
        "symm_mem_importable": symm_mem,
        "multicast_disabled": os.environ.get(MULTICAST_ENV) == "1",
        "triton_backend": _triton_backend(),
    }
    no_gpu = {"gpus": [], "peer_access": [], "nccl": "n/a", "driver": "n/a", "bf16": False}
    facts.update(_cuda_facts(torch) if cuda else {**no_gpu, "links": []})
    facts["fast_paths"] = [asdict(fp) for fp in evaluate_fast_paths(facts)]
    facts["comm_backends"] = backend_rows(facts)
    facts["comm_tables"] = table_summaries(cache_dir)
    return facts


def _min_cc(facts: dict[str, Any]) -> tuple[int, int]:
    return min(tuple(g["compute_capability"]) for g in facts["gpus"])


def _attention(facts: dict[str, Any]) -> FastPath:
    name = "GPU attention kernels (Triton)"
    backend = facts["triton_backend"]
    if facts["triton"] == "not installed":
        return FastPath(name, False, "triton is not installed (pip install 'specserve[gpu]')")
    if _min_cc(facts) < (8, 0):
        return FastPath(name, False, f"compute capability {_min_cc(facts)} < (8, 0)")
    if backend is None:
        return FastPath(name, False, "specserve.layers.backends.triton_backend is missing")
    if not backend["available"]:
        return FastPath(name, False, backend["reason"])
    return FastPath(name, True, "")


def _symm_mem(facts: dict[str, Any]) -> FastPath:
    from specserve.distributed.backends import availability

    name = "symmetric-memory all-reduce"
    reason = availability(comm_facts(facts))["symm-one-shot"]
    if reason:
        return FastPath(name, False, reason)
    note = f"NVLink multicast disabled ({MULTICAST_ENV}=1)" if facts["multicast_disabled"] else ""
    return FastPath(name, True, note)


def _tensor_parallel(facts: dict[str, Any]) -> FastPath:
    """Which --tensor-parallel-size values this box can run, and over what links."""
    name = "NCCL tensor parallelism"
    n = len(facts["gpus"])
    if n < 2:
        return FastPath(name, False, f"needs >= 2 GPUs, found {n}")
    if not facts["nccl_available"]:
        return FastPath(name, False, "this torch build has no NCCL")
    sizes = [s for s in (2, 4, 8) if s <= n]
    kinds = sorted({link["kind"] for link in facts.get("links", [])})
    no_peer = [(i, j) for i in range(n) for j in range(i + 1, n)
               if not facts["peer_access"][i][j]]
    links = "links " + "/".join(kinds) if kinds else "links unknown (no nvidia-smi topo)"
    peer = (f"no P2P between GPUs {no_peer[0]} (+{len(no_peer) - 1} more pairs): "
            "all-reduces go through host memory" if no_peer else "P2P between every pair")
    return FastPath(name, True, f"TP sizes {','.join(map(str, sizes))} on {n} GPUs; {links}; "
                    f"{peer}; NCCL {facts['nccl']}")


def _w4a16(facts: dict[str, Any]) -> list[FastPath]:
    """INT4 W4A16 and the path NVFP4 checkpoints take: weight-only through the same Triton
    dequant-GEMM on every GPU (no FP4 tensor-core GEMM is wired in, Blackwell included)."""
    cc = _min_cc(facts)
    if facts["triton"] == "not installed" or cc < (8, 0):
        why = (
            "triton is not installed"
            if facts["triton"] == "not installed"
            else f"compute capability {cc} < (8, 0)"
        )
        return [
            FastPath("W4A16 (INT4, weight-only)", False, why),
            FastPath("NVFP4", False, f"{why} (the NVFP4 path is W4A16)"),
        ]
    if cc < (8, 9):
        fp4 = (f"weight-only W4A16 (Triton), its e4m3 scales decoded from their bits: no FP8 "
               f"or FP4 types at compute capability {cc}")
    elif cc < (10, 0):
        fp4 = f"weight-only W4A16 (Triton): no FP4 tensor cores at compute capability {cc}"
    else:
        fp4 = (
            "weight-only W4A16 (Triton): this GPU has FP4 tensor cores, but no FP4 (W4A4) "
            "GEMM is wired in"
        )
    return [
        FastPath("W4A16 (INT4, weight-only)", True, "Triton dequant-GEMM"),
        FastPath("NVFP4", True, fp4),
    ]


def evaluate_fast_paths(facts: dict[str, Any]) -> list[FastPath]:
    """One verdict per fast path; the first unmet requirement is the reason."""
    if not facts["cuda_available"] or not facts["gpus"]:
        why = "no CUDA GPU visible (torch.cuda.is_available() is False)"
        return [FastPath(name, False, why) for name in FAST_PATHS]
    cc = _min_cc(facts)
    return [
        _attention(facts),
        FastPath("CUDA graphs", True, ""),
        FastPath("bf16", facts["bf16"], "" if facts["bf16"] else f"compute capability {cc}"),
        _tensor_parallel(facts),
        _symm_mem(facts),
        FastPath("FP8", cc >= (8, 9), "" if cc >= (8, 9) else f"compute capability {cc} < (8, 9)"),
        *_w4a16(facts),
    ]


def format_report(facts: dict[str, Any]) -> str:
    """The human-readable report."""
    out = [
        "specserve doctor",
        f"  python        {facts['python']}",
        f"  torch         {facts['torch']}",
        f"  CUDA runtime  {facts['cuda_runtime']}; driver {facts['driver']}",
        f"  triton        {facts['triton']}",
        f"  NCCL          {facts['nccl']}",
        "GPUs",
    ]
    for g in facts["gpus"]:
        cc = ".".join(map(str, g["compute_capability"]))
        out.append(f"  {g['index']}  {g['name']}  {g['memory_gib']} GiB  cc {cc}")
    if not facts["gpus"]:
        out.append("  (none visible)")
    if len(facts["gpus"]) > 1:
        out.append("GPU links")
        for link in facts["links"]:
            peer = "yes" if facts["peer_access"][link["a"]][link["b"]] else "no"
            out.append(f"  {link['a']}-{link['b']}  {link['link']} ({link['kind']})  peer {peer}")
        if not facts["links"]:
            out.append("  (nvidia-smi topo -m unavailable)")
    out.append("Fast paths")
    width = max(len(fp["name"]) for fp in facts["fast_paths"])
    for fp in facts["fast_paths"]:
        verdict = "yes" if fp["usable"] else "no "
        out.append(f"  {fp['name']:<{width}}  {verdict}  {fp['reason']}".rstrip())
    if "comm_backends" in facts:
        out.extend(format_comm(facts))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    cache_dir = getattr(args, "comm_cache_dir", "")
    try:
        facts = collect(cache_dir)
    except ImportError as err:
        print(f"torch cannot be imported ({err}); reinstall torch for this Python")
        return 1
    if getattr(args, "comm_measure", False):
        measure(args, facts)
        facts = collect(cache_dir)
    print(json.dumps(facts, indent=2) if args.json else format_report(facts))
    return 0
