"""Summarize an adaptive-policy trace (`scripts/bench_spec_policy.py --trace` writes one
trace-c<C>-<run>.jsonl per adaptive run: each step's decision, then what the step measured).

What it prints, to judge the policy's choices against what its steps delivered:
- per kind of step (a mode, "off" or "fold"; "+mixed" when prefill chunks rode along): steps,
  mean decode rows, ms a step, tokens a row-step and tokens per second, and where the trace
  holds the engine's records (bench_spec_policy.py writes one after each step), positions
  caught up a step and the share of steps whose cycle was the one launched ahead;
- the decisions: steps per chosen mode, switches (the chosen mode changed) and one-step runs
  of a mode between two others (probes), positions caught up when coming back on;
- per mode, its mean score where the policy scored it against the tokens per second its own
  pure steps delivered at a similar batch (rows within 2x of the scored step's), and the
  share of its steps the policy expected to carry prefill chunks (its mean over the scored
  steps) against the share of its steps that did.

    python scripts/policy_trace.py TRACE.jsonl [TRACE.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> tuple[list[dict], list[dict]]:
    """(decisions, observations) of one trace, in step order."""
    decisions, observed = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "engine" in rec:  # what the engine did in the step observed last
            observed[-1].update(rec["engine"])
            continue
        (observed if "observed" in rec else decisions).append(rec)
    return decisions, observed


def kinds(observed: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind of step: steps, rows, ms, tokens (rows + accepted drafts) and their rates;
    where the engine's records are in the trace, positions caught up a step and the share of
    steps whose cycle was launched ahead."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0, 0, 0, 0])
    for r in observed:
        if r.get("ms") is None:
            continue
        a = acc[r["observed"] + ("+mixed" if r.get("mixed") else "")]
        a[0] += 1
        a[1] += r["b"]
        a[2] += r["ms"]
        a[3] += r["b"] + r.get("accepted", 0)
        if "caught_up" in r:
            a[4] += 1
            a[5] += r["caught_up"]
            a[6] += r["ahead"] > 0
    return {k: {"steps": n, "rows": rows / n, "ms": ms / n,
                "tokens_per_row": tok / rows if rows else 0.0,
                "tok_s": tok / ms * 1e3 if ms else 0.0,
                "caught_up": caught / seen if seen else None,
                "ahead": ahead / seen if seen else None}
            for k, (n, rows, ms, tok, seen, caught, ahead) in sorted(acc.items())}


def decisions_summary(decisions: list[dict]) -> dict:
    """Steps per chosen mode, switches, probes (a mode chosen for one step between two
    steps of another) and the positions behind at each switch from off to a mode."""
    chosen = [d["mode"] for d in decisions]
    steps: dict[str, int] = defaultdict(int)
    for m in chosen:
        steps[m] += 1
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    probes = sum(a == c != b for a, b, c in zip(chosen, chosen[1:], chosen[2:]))
    behind = [d2["behind"] for d1, d2 in zip(decisions, decisions[1:])
              if d1["mode"] == "off" and d2["mode"] != "off"]
    return {"steps": dict(steps), "switches": switches, "probes": probes,
            "switches_on": len(behind), "behind_at_switch_on": sum(behind)}


def scores_vs_delivered(decisions: list[dict], observed: list[dict]) -> dict[str, dict]:
    """Per mode: its mean score over the scored steps, and the tokens per second of its own
    pure steps at rows within 2x of each scored step's (None where it ran no such step)."""
    pure: dict[str, list[tuple[int, float, int]]] = defaultdict(list)  # (rows, ms, tokens)
    for r in observed:
        if r.get("ms") is not None and not r.get("mixed") and r["b"]:
            pure[r["observed"]].append((r["b"], r["ms"], r["b"] + r.get("accepted", 0)))
    out: dict[str, dict] = {}
    for mode in sorted({m for d in decisions for m in d.get("scores", {})}):
        scored = [(d["b"], d["scores"][mode]) for d in decisions if mode in d.get("scores", {})]
        ms = tok = 0.0
        for b, _ in scored:
            near = [(m, t) for rows, m, t in pure.get(mode, ()) if b / 2 <= rows <= 2 * b]
            ms += sum(m for m, _ in near)
            tok += sum(t for _, t in near)
        shares = [d["share"][mode] for d in decisions if mode in d.get("share", {})]
        ran = [r.get("mixed", False) for r in observed if r["observed"] == mode and r["b"]]
        out[mode] = {"scored": len(scored), "score": sum(s for _, s in scored) / len(scored),
                     "delivered": tok / ms * 1e3 if ms else None,
                     "share": sum(shares) / len(shares) if shares else None,
                     "ran_share": sum(ran) / len(ran) if ran else None}
    return out


def report(path: Path) -> str:
    decisions, observed = load(path)
    lines = [f"{path}: {len(decisions)} decisions, {len(observed)} steps measured",
             "kind               steps   rows   ms/step  tok/row    tok/s  caught-up/step"
             "  launched ahead"]
    for k, v in kinds(observed).items():
        extra = "" if v["caught_up"] is None else \
            f" {v['caught_up']:15.1f} {v['ahead']:15.2f}"
        lines.append(f"{k:18s} {v['steps']:5d} {v['rows']:6.1f} {v['ms']:9.2f} "
                     f"{v['tokens_per_row']:8.2f} {v['tok_s']:8.0f}{extra}")
    s = decisions_summary(decisions)
    lines.append(f"chosen: {s['steps']}; switches {s['switches']}, probes {s['probes']}, "
                 f"on from off {s['switches_on']} ({s['behind_at_switch_on']} positions "
                 "behind)")
    lines.append("mode               scored    score  delivered (pure steps, rows within 2x)"
                 "  mixed share: expected  ran")
    for mode, v in scores_vs_delivered(decisions, observed).items():
        got = "-" if v["delivered"] is None else f"{v['delivered']:.0f}"
        share = "-" if v["share"] is None else f"{v['share']:.3f}"
        ran = "-" if v["ran_share"] is None else f"{v['ran_share']:.3f}"
        lines.append(f"{mode:18s} {v['scored']:6d} {v['score']:8.0f}  {got:>9s}"
                     f"{'':30s}{share:>8s} {ran:>6s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.traces if not p.is_file()]
    if missing:
        ap.error(f"no such trace: {', '.join(missing)}")
    for path in args.traces:
        try:
            print(report(path))
        except (ValueError, KeyError) as err:
            print(f"{path}: not a policy trace ({type(err).__name__}: {err})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
