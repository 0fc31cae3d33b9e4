"""The floor of a speculative cycle's verify pass, for `bench latency --floor`.

A verify pass runs every drafted node of every request through the target (`verify_tokens`
nodes a request, the root included). On a dense model it streams the same weights as a decode
step. On a MoE model each node is routed on its own, so the pass reads the distinct experts all
the nodes touch: at batch 1, a 4-node chain on top 8 of 16 experts reads about 15 a layer
instead of a decode step's 8. The decode step's floor is then the wrong yardstick for a cycle,
and the usual efficiency (spec tok/s / (AL x plain tok/s)) is bounded by decode bytes / verify
bytes rather than by 1.

This floor is the weight-stream time (bench/floor.py's matmul chain in one CUDA graph) of a
verify pass: batch x nodes rows, with the experts counted on the benchmark's own requests by
running each request's newest `nodes` tokens in one pass (touched_experts). The cycle's drafting
is not in it, so a cycle can approach it but not beat it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from specserve.bench.floor import measure_floor


def measure_verify_floor(model: nn.Module, experts: dict[Any, list[int]],
                         nodes: int) -> dict[str, Any] | None:
    """{nodes, points: one per batch size}, None without verify probes; experts["verify", bs]:
    the routed experts each MoE block reads in the verify pass of that batch ([] for a dense
    model; bench latency's probe records them beside the decode step's experts[bs])."""
    verify = {k[1]: v for k, v in experts.items() if isinstance(k, tuple) and k[0] == "verify"}
    if not verify:
        return None
    points = []
    for bs, touched in sorted(verify.items()):
        rows = bs * nodes
        (point,) = measure_floor(model, [rows], experts={rows: touched} if touched else None)
        points.append({**point.to_dict(), "batch_size": bs, "rows": rows})
    return {"nodes": nodes, "points": points}


def verify_floor_ms(refs: dict[str, Any], batch_size: int) -> float | None:
    vf = refs.get("verify_floor") or {}
    return next((p["ms"] for p in vf.get("points", ()) if p["batch_size"] == batch_size), None)


def describe_verify_floor(report: dict[str, Any]) -> list[str]:
    """One line per batch size: the verify pass's floor and the cycle time against it."""
    vf = report.get("verify_floor") or {}
    cycles: dict[int, float] = {}
    for p in report["points"]:
        for mode, r in p["modes"].items():
            if mode != "baseline" and p["comm_table"] is None:
                cycles.setdefault(p["batch_size"], r["ms_per_step"]["mean"])
    lines = []
    for f in vf.get("points", ()):
        cycle = cycles.get(f["batch_size"])
        lines.append(
            f"verify floor bs {f['batch_size']} ({vf['nodes']} nodes a request, {f['rows']} rows): "
            f"{f['ms']:.3f} ms, {f['weight_bytes'] / 1e9:.3f} GB at {f['bandwidth_gbs']:.0f} GB/s"
            + (f", routed experts read per MoE layer {f['experts_per_layer']}"
               if f.get("experts_per_layer") else "")
            + (f"; the cycle takes {cycle:.3f} ms: floor/cycle {f['ms'] / cycle:.2f}"
               if cycle else ""))
    return lines
