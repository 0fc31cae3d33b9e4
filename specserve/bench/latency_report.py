"""What `bench latency` prints and logs: the end-of-run table, and one experiments/ LOG.md
row + JSON record per (mode, batch, context) with a tok/s-across-runs PNG per point."""

from __future__ import annotations

import math
import os
from typing import Any

from specserve.bench.floor import describe_references
from specserve.bench.log import append_result
from specserve.bench.stats import format_range, relative_change
from specserve.bench.verify_floor import describe_verify_floor

BASELINE = "baseline"
SYNTHETIC = "synthetic acceptance (cost-only)"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def format_report(report: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    head = (f"bench latency: {report['model']} on {report['device']} ({report['dtype']}), "
            f"{report['output_len']} decode tokens/request, {report['runs']} runs")
    if report["acceptance"] == SYNTHETIC:
        head += f"  [{SYNTHETIC}]"
    lines = [head, f"{'ctx':>6} {'bs':>4} {'mode':<9} {'tok/s mean (min-max)':<26} "
             f"{'95% CI':<19} {'ms/step':>8} {'floor ms':>8} {'fl/step':>7} {'roof ms':>8} "
             f"{'rf/step':>7} {'AL':>5} {'eff':>5}"]
    table = None
    for p in report["points"]:
        if p.get("comm_table") != table:
            table, cc = p["comm_table"], report["config"]["comm"]
            lines.append(f"-- emulated communication: table {table}, TP {cc['emulate_tp']}, "
                         f"compute {cc['emulate_compute']}")
        for mode, r in p["modes"].items():
            t, spec = r["tok_s"], mode != BASELINE
            al = r["accept_length"]["mean"] if spec else None
            lines.append(
                f"{p['context_len']:>6} {p['batch_size']:>4} {mode:<9} "
                f"{format_range(t['mean'], t['min'], t['max']):<26} "
                f"{format_range(t['mean'], t['ci95_low'], t['ci95_high']):<19} "
                f"{r['ms_per_step']['mean']:>8.3f} {_num(p['floor_ms'], '.3f'):>8} "
                f"{_num(None if spec else p['floor_ratio'], '.3f'):>7} "
                f"{_num(p['roofline']['ms'] if p['roofline'] else None, '.3f'):>8} "
                f"{_num(None if spec else p['roofline_ratio'], '.3f'):>7} {_num(al, '.2f'):>5} "
                f"{_num(p['efficiency'] if spec else None, '.2f'):>5}")
    lines.append(f"start-up {report['startup_s']:.2f} s (engine: weights + graph capture "
                 f"{report['engine_startup_s']:.2f} s)")
    lines.extend(_describe_roofline(p) for p in report["points"] if p["roofline"])
    speedup = next((p["hf_speedup"] for p in report["points"] if p["hf_speedup"]), None)
    lines.extend(describe_references(report, speedup))
    lines.extend(describe_verify_floor(report))
    return "\n".join(lines)


def _describe_roofline(p: dict[str, Any]) -> str:
    r = p["roofline"]
    return (f"roofline ctx {p['context_len']} bs {p['batch_size']}: {r['ms']:.3f} ms "
            f"({r['bound']}-bound: {r['weight_bytes'] / 1e9:.4g} GB weights + "
            f"{r['kv_bytes'] / 1e9:.4g} GB KV at mean context {r['context']:.0f} -> "
            f"{r['memory_ms']:.3f} ms; {r['flops'] / 1e9:.4g} GFLOP -> {r['compute_ms']:.3f} ms)")


def write_log(report: dict[str, Any], exp_dir: str) -> list[str]:
    """One LOG.md row + JSON record per (mode, batch, context); a tok/s-across-runs PNG per
    point. Returns the PNG paths."""
    from specserve.bench.plots import plot_runs

    shared = {k: v for k, v in report.items() if k not in ("points", "environment")}
    spec_cfg = report["config"]["spec"]
    tag = "".join(c if c.isalnum() or c in "-_." else "-" for c in report["label"])
    pngs = []
    for p in report["points"]:
        where = f"bs={p['batch_size']} ctx={p['context_len']}" + (
            f" comm={p['comm_table']}" if p.get("comm_table") else "")
        base = p["modes"].get(BASELINE)
        for mode, r in p["modes"].items():
            spec = mode != BASELINE
            config = f"{report['model']} {mode} {where} out={report['output_len']} " + (
                f"steps={spec_cfg['num_steps']} topk={spec_cfg['topk']} " if spec else "") + (
                f"{report['dtype']} {report['label']}")
            notes = [f"ms/step {r['ms_per_step']['mean']:.3f}"]
            if not spec and p["floor_ratio"]:
                notes.append(f"floor/step {p['floor_ratio']:.3f}")
            if not spec and p["roofline_ratio"]:
                roof = p["roofline"]
                notes.append(f"roofline/step {p['roofline_ratio']:.3f} ({roof['bound']}-bound, "
                             f"{(roof['weight_bytes'] + roof['kv_bytes']) / 1e9:.4g} GB "
                             "weights+KV)")
            if spec:
                notes.append(f"AL {r['accept_length']['mean']:.2f}")
                if p["efficiency"] is not None:
                    notes.append(f"efficiency {p['efficiency']:.2f}")
                if report["acceptance"] == SYNTHETIC:
                    notes.append(SYNTHETIC)
            t = r["tok_s"]
            change = (relative_change(t["mean"], base["tok_s"]["mean"]) if spec and base
                      else "baseline" if not spec else "n/a")
            row = {"benchmark": "latency", "config": config, "change": change,
                   "tok_s": format_range(t["mean"], t["min"], t["max"]), "notes": "; ".join(notes)}
            append_result(exp_dir, {**shared, "mode": mode, "point": p}, row)
        series = {m: [run["tok_s"] for run in r["runs"]] for m, r in p["modes"].items()}
        title = f"{report['model']} {where}" + (
            f" [{SYNTHETIC}]" if report["acceptance"] == SYNTHETIC else "")
        pngs.append(plot_runs(os.path.join(
            exp_dir, f"{tag}-ctx{p['context_len']}-bs{p['batch_size']}"
            + (f"-{p['comm_table']}" if p.get("comm_table") else "") + ".png"), series,
            "decode tok/s", title))
    return pngs
