"""`specserve doctor`: the CPU report, topology parsing and the fast-path rules."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from specserve import doctor

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")

TOPO_NVLINK = """\
\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\t0-47\t0\t\tN/A
GPU1\tNV18\t X \t0-47\t0\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""

TOPO_PCIE = """\
        GPU0    GPU1    GPU2    NIC0    CPU Affinity    NUMA Affinity
GPU0     X      PIX     SYS     NODE    0-15    0
GPU1    PIX      X      SYS     NODE    0-15    0
GPU2    SYS     SYS      X      SYS     16-31   1
NIC0    NODE    NODE    SYS      X

Legend:
  X    = Self
"""


def _parser() -> argparse.ArgumentParser:
    from specserve.cli import build_parser

    return build_parser()


@no_cuda
def test_cpu_report_lists_fast_paths_as_unusable(capsys: pytest.CaptureFixture) -> None:
    args = _parser().parse_args(["doctor", "--json"])
    assert args.func(args) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["torch"] == torch.__version__ and facts["gpus"] == []
    paths = {fp["name"]: fp for fp in facts["fast_paths"]}
    assert set(paths) == set(doctor.FAST_PATHS)
    for fp in paths.values():
        assert fp["usable"] is False and "no CUDA GPU" in fp["reason"]

    args = _parser().parse_args(["doctor"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "Fast paths" in text and "(none visible)" in text
    assert text.count(" no ") >= len(doctor.FAST_PATHS)


def test_broken_torch_exits_nonzero(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    def broken(*_args: object) -> dict:
        raise ImportError("libtorch_cuda.so: cannot open shared object file")

    monkeypatch.setattr(doctor, "collect", broken)
    args = _parser().parse_args(["doctor"])
    assert args.func(args) == 1
    assert "reinstall torch" in capsys.readouterr().out


def test_parse_topology() -> None:
    assert doctor.parse_topology(TOPO_NVLINK) == [
        {"a": 0, "b": 1, "link": "NV18", "kind": "NVLink"}
    ]
    links = {(x["a"], x["b"]): (x["link"], x["kind"]) for x in doctor.parse_topology(TOPO_PCIE)}
    assert links == {
        (0, 1): ("PIX", "PCIe, one switch"),
        (0, 2): ("SYS", "PCIe, across NUMA nodes"),
        (1, 2): ("SYS", "PCIe, across NUMA nodes"),
    }
    assert doctor.parse_topology("") == [] and doctor.parse_topology("No devices found") == []


def _facts(ccs: list[tuple[int, int]], **over: object) -> dict:
    n = len(ccs)
    facts = {
        "cuda_available": True,
        "triton": "3.6.0",
        "nccl": "2.27.3",
        "nccl_available": True,
        "bf16": all(cc >= (8, 0) for cc in ccs),
        "symm_mem_importable": True,
        "multicast_disabled": False,
        "triton_backend": {"available": True, "reason": "ok"},
        "gpus": [
            {"index": i, "name": "gpu", "memory_gib": 80.0, "compute_capability": list(cc)}
            for i, cc in enumerate(ccs)
        ],
        "peer_access": [[i != j for j in range(n)] for i in range(n)],
        "cuda_runtime": "12.8",
    }
    return {**facts, **over}


def _verdicts(facts: dict) -> dict[str, tuple[bool, str]]:
    return {fp.name: (fp.usable, fp.reason) for fp in doctor.evaluate_fast_paths(facts)}


def test_two_hoppers_can_use_everything() -> None:
    v = _verdicts(_facts([(9, 0), (9, 0)], multicast_disabled=True))
    assert all(usable for usable, _ in v.values()), v
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in v["symmetric-memory all-reduce"][1]
    assert "2 GPUs" in v["NCCL tensor parallelism"][1]


def test_old_or_single_gpu_rules() -> None:
    v = _verdicts(_facts([(7, 5)]))  # one T4-class GPU
    assert v["CUDA graphs"] == (True, "")
    assert v["GPU attention kernels (Triton)"] == (False, "compute capability (7, 5) < (8, 0)")
    assert v["bf16"][0] is False and v["FP8"][0] is False
    assert v["NCCL tensor parallelism"] == (False, "needs >= 2 GPUs, found 1")
    assert v["symmetric-memory all-reduce"] == (False, "needs >= 2 GPUs, found 1")
    v = _verdicts(_facts([(8, 0), (8, 9)]))  # mixed: FP8 needs every GPU >= 8.9
    assert v["FP8"][0] is False and v["GPU attention kernels (Triton)"][0] is True
    assert _verdicts(_facts([(8, 9)]))["FP8"] == (True, "")


def test_nvfp4_path_is_named() -> None:
    v = _verdicts(_facts([(9, 0)]))
    assert v["W4A16 (INT4, weight-only)"] == (True, "Triton dequant-GEMM")
    assert v["NVFP4"][0] and "no FP4 tensor cores at compute capability (9, 0)" in v["NVFP4"][1]
    blackwell = _verdicts(_facts([(10, 0)]))["NVFP4"]
    assert blackwell[0] and "FP4 tensor cores, but no FP4 (W4A4) GEMM" in blackwell[1]
    ampere = _verdicts(_facts([(8, 0)]))["NVFP4"]
    assert ampere[0] and "e4m3 scales decoded from their bits" in ampere[1]
    old = _verdicts(_facts([(7, 5)]))
    assert old["NVFP4"] == (False, "compute capability (7, 5) < (8, 0) (the NVFP4 path is W4A16)")


def test_missing_pieces_give_reasons() -> None:
    no_peer = _facts([(8, 0), (8, 0)], peer_access=[[False, False], [False, False]])
    usable, reason = _verdicts(no_peer)["symmetric-memory all-reduce"]
    assert not usable and "peer access" in reason
    v = _verdicts(_facts([(9, 0)], triton="not installed"))
    assert not v["GPU attention kernels (Triton)"][0]
    assert "triton is not installed" in v["GPU attention kernels (Triton)"][1]
    backend = {"available": False, "reason": "kernels failed to compile"}
    v = _verdicts(_facts([(9, 0)], triton_backend=backend))
    assert v["GPU attention kernels (Triton)"] == (False, "kernels failed to compile")
    v = _verdicts(_facts([(9, 0)], triton_backend=None))
    assert "triton_backend is missing" in v["GPU attention kernels (Triton)"][1]
    v = _verdicts(_facts([(9, 0), (9, 0)], nccl_available=False, symm_mem_importable=False))
    assert v["NCCL tensor parallelism"] == (False, "this torch build has no NCCL")
    assert "not importable" in v["symmetric-memory all-reduce"][1]


def test_report_text_from_facts() -> None:
    facts = _facts([(9, 0), (9, 0)])
    facts |= {
        "python": "3.11.0",
        "torch": "2.11.0+cu130",
        "cuda_runtime": "13.0",
        "driver": "580.1",
        "links": doctor.parse_topology(TOPO_NVLINK),
    }
    facts["fast_paths"] = [vars(fp) for fp in doctor.evaluate_fast_paths(facts)]
    text = doctor.format_report(facts)
    assert "0-1  NV18 (NVLink)  peer yes" in text and "cc 9.0" in text
    assert "13.0; driver 580.1" in text


def test_tp_verdict_names_sizes_links_and_missing_p2p() -> None:
    links = [{"a": a, "b": b, "link": "NODE", "kind": "PCIe (same NUMA node)"}
             for a in range(4) for b in range(a + 1, 4)]
    facts = _facts([(9, 0)] * 4, links=links)
    facts["peer_access"][1][2] = facts["peer_access"][2][1] = False
    usable, reason = _verdicts(facts)["NCCL tensor parallelism"]
    assert usable
    assert "TP sizes 2,4 on 4 GPUs" in reason
    assert "PCIe (same NUMA node)" in reason
    assert "no P2P between GPUs (1, 2)" in reason
    facts["peer_access"][1][2] = facts["peer_access"][2][1] = True
    assert "P2P between every pair" in _verdicts(facts)["NCCL tensor parallelism"][1]


@no_cuda
def test_cpu_report_lists_allreduce_backends(tmp_path, capsys: pytest.CaptureFixture) -> None:
    args = _parser().parse_args(["doctor", "--comm-cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "All-reduce backends" in text and "none measured on this machine" in text
    rows = {line.split()[0]: line for line in text.splitlines()[-7:-1]}
    assert rows["gloo"].split()[1] == "yes"
    assert "no CUDA GPU" in rows["nccl"] and "peer access" in rows["symm-one-shot"]
    assert "TRITON_INTERPRET" in rows["triton-one-shot"]


def test_dispatch_table_text() -> None:
    from specserve.comm_report import format_table

    us = {"nccl": 24.1, "symm-one-shot": 7.5}
    record = {
        "key": {"world": 2, "dtype": "bfloat16", "hidden": 4096, "gpus": ["H200", "H200"]},
        "measured": "2026-12-01T10:00:00",
        "path": "/c/allreduce-x.json",
        "entries": [
            {"op": "all_reduce", "nbytes": 8192, "rows": 1, "us": us, "choice": "symm-one-shot"},
            {
                "op": "add_rms_norm",
                "nbytes": 8192,
                "rows": 1,
                "us": {"nccl": 27.0, "triton-one-shot+fused": 8.2},
                "choice": "triton-one-shot+fused",
            },
        ],
        "unavailable": {"symm-two-shot": "initialisation failed: RuntimeError: x"},
    }
    lines = format_table(record)
    assert "world 2, bfloat16, hidden 4096, 2 x H200" in lines[0]
    assert lines[2].split() == [
        "1",
        "8192",
        "symm-one-shot",
        "7.5",
        "us",
        "triton-one-shot+fused",
        "8.2",
        "us",
    ]
    assert "symm-two-shot: initialisation failed" in lines[3]


@pytest.mark.slow
@no_cuda
def test_comm_measure_on_cpu(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """--comm-measure spawns two gloo processes through the engine's start-up path."""
    args = _parser().parse_args(
        [
            "doctor",
            "--comm-measure",
            "--comm-hidden",
            "64",
            "--comm-rows",
            "1,4",
            "--comm-cache-dir",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "All-reduce dispatch: world 2, float32, hidden 64" in text
    table = [line.split() for line in text.splitlines() if line.strip().startswith(("1 ", "4 "))]
    assert [row[:3] for row in table] == [["1", "256", "gloo"], ["4", "1024", "gloo"]]
