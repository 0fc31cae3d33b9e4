#!/usr/bin/env python3
"""Plain decode against its bandwidth roofline, from `bench latency --floor --json-out` reports.

For every (context, batch) point of the given reports: the step's roofline ratio (roofline ms /
measured ms: 1.0 = the step reads its weights and every request's KV at the copy bandwidth
measured in the same run), one line per batch size over context. Prints the table and writes
a PNG:

    python scripts/plot_roofline.py OUT/longctx-8k.json OUT/longctx-32k.json --out roofline.png \
        [--goal 0.9 --goal-context 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def roofline_rows(reports: list[dict]) -> list[dict]:
    """One row per plain-decode point: context, batch, ms/step, roofline ms and their ratio
    (points without a roofline, i.e. run without --floor, are left out)."""
    rows = []
    for report in reports:
        for p in report["points"]:
            if not p.get("roofline") or "baseline" not in p["modes"] or p.get("comm_table"):
                continue
            rows.append({"context": p["context_len"], "batch": p["batch_size"],
                         "ms": p["modes"]["baseline"]["ms_per_step"]["mean"],
                         "roofline_ms": p["roofline"]["ms"], "ratio": p["roofline_ratio"],
                         "bound": p["roofline"]["bound"]})
    return sorted(rows, key=lambda r: (r["batch"], r["context"]))


def plot(rows: list[dict], out: Path, title: str, goal: float | None,
         goal_context: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for bs in sorted({r["batch"] for r in rows}):
        pts = [r for r in rows if r["batch"] == bs]
        ax.plot([r["context"] for r in pts], [r["ratio"] for r in pts], marker="o",
                label=f"bs {bs}")
    if goal is not None:
        ax.axhline(goal, color="grey", linestyle="--", linewidth=1,
                   label=f"goal {goal:g}" + (f" at {goal_context}" if goal_context else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("roofline ms / measured ms")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="bench latency --json-out files")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--goal", type=float, default=None, help="a horizontal goal line")
    ap.add_argument("--goal-context", type=int, default=None, help="where the goal applies")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        print(f"plot_roofline: no such report: {', '.join(missing)}", file=sys.stderr)
        return 2
    reports = [json.loads(p.read_text()) for p in args.reports]
    rows = roofline_rows(reports)
    if not rows:
        print("plot_roofline: no plain-decode point with a roofline (run bench latency with "
              "--floor)", file=sys.stderr)
        return 2
    print(f"{'ctx':>6} {'bs':>4} {'ms/step':>8} {'roof ms':>8} {'rf/step':>7} bound")
    for r in rows:
        print(f"{r['context']:>6} {r['batch']:>4} {r['ms']:>8.3f} {r['roofline_ms']:>8.3f} "
              f"{r['ratio']:>7.3f} {r['bound']}")
    first = reports[0]
    title = f"{first['model']} plain decode vs roofline ({first['device']}, {first['dtype']})"
    plot(rows, args.out, title, args.goal, args.goal_context)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
