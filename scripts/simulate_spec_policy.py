"""The adaptive speculation policy in a step-level model engine (specserve/bench/policy_sim.py):
adaptive against off and each static mode at every concurrency, from a GPU run's start-up
cost table, with no GPU. What it shows is the policy's own logic (exploration, dwell,
hysteresis, what it learns of mixed steps) under the model's costs; fit those (--prefill-ms-
per-token, --mixed-ms, ...) to a policy sweep's per-kind step times before reading tok/s.

    python scripts/simulate_spec_policy.py --report OUT/policy-0.65/spec_policy.json
    python scripts/simulate_spec_policy.py --report OUT/policy-0.65/spec_policy.json --fit \
        --accept-rate 0.65    # the chunk costs the sweep's adaptive policy learnt
    python scripts/simulate_spec_policy.py --report OUT/policy-0.65/spec_policy.json \
        --fit --fit-static    # and each kind's mixed-step line from the static runs
    python scripts/simulate_spec_policy.py --report OUT/policy-0.65/spec_policy.json \
        --fit --fit-trace     # or from the adaptive runs' per-step traces (--trace)
    python scripts/simulate_spec_policy.py --report OUT/policy-0.65/spec_policy.json \
        --fit --fit-static --profiled-priors   # the policy starts from the run's own profile
    python scripts/simulate_spec_policy.py --results experiments/results.jsonl --sha dd72cd7 \
        --accept-rate 0.65,0.3 --concurrency 1,2,4,8,16,32,64,128,256 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.policy_sim import ADAPTIVE, OFF, SimConfig, sweep  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.engine.goodput import _interpolate  # noqa: E402
from specserve.spec_modes import parse_mode, split_mode  # noqa: E402


def load_table(args) -> dict:
    """The cost_table_ms of a spec_policy report, or of the newest results.jsonl row of a
    policy sweep whose SHA starts with --sha."""
    if args.report:
        report = json.loads(Path(args.report).read_text())
    else:
        rows = [json.loads(line) for line in Path(args.results).read_text().splitlines()
                if '"spec_policy"' in line]
        rows = [r for r in rows if r.get("git_sha", "").startswith(args.sha or "")]
        if not rows:
            raise ValueError(f"no policy sweep row in {args.results} with SHA "
                             f"{args.sha!r}: pass --sha of a row there, or --report")
        report = rows[-1]
    table = report.get("cost_table_ms")
    if not table or "off" not in table:
        raise ValueError("the report has no cost_table_ms with an 'off' row")
    return {m: {int(b): t / 1e3 for b, t in row.items()} for m, row in table.items()}


def fitted_costs(report: dict) -> dict[str, float]:
    """Model costs from what a policy sweep's adaptive policy learnt (its report's last
    `learnt` chunk lines, fixed ms and us a chunk token per kind of step): the plain step's
    slope as the prefill cost a token, the speculative modes' mean fixed part as the mixed
    step's, the fold's fixed part; {} when the report has none."""
    learnt = {}
    for point in report.get("points", ()):
        for run in point.get("adaptive", {}).get("runs", ()):
            learnt = run.get("learnt") or learnt
    lines = learnt.get("chunk_lines") or {}
    out: dict[str, float] = {}
    if "off" in lines:
        out["plain_mixed_ms"] = lines["off"][0]
        out["prefill_ms_per_token"] = lines["off"][1] / 1e3
        # a catch-up runs the target over the positions as a prefill does (no KV written)
        out["catchup_ms_per_token"] = lines["off"][1] / 1e3
    spec = [a for k, (a, _) in lines.items() if k not in ("off", "fold")]
    if spec:
        out["mixed_ms"] = sum(spec) / len(spec)
    if "fold" in lines:
        out["fold_ms"] = lines["fold"][0]
    return out


def static_mixed_lines(report: dict, prompt_len: int) -> dict[str, tuple[float, float]]:
    """Per kind of step ("off" from the forced-off runs, each static mode): the line (fixed
    ms, ms a chunk token) through what its mixed steps took over its decode steps, by least
    squares over the report's concurrencies: at each, the mean mixed step's time minus the
    mean decode step's, against the chunk tokens a mixed step carried (every prompt is
    prefilled in the run's mixed steps: requests x prompt_len over their count). A fixed
    part fitted below zero gives the line through the origin and the points' mean."""
    pts: dict[str, list[tuple[float, float]]] = {}
    for point, kind, seconds in _static_runs(report):
        mixed, pure = seconds.get(f"{kind}+mixed"), seconds.get(kind)
        if mixed and pure and mixed[0] and pure[0]:
            extra = 1e3 * (mixed[1] / mixed[0] - pure[1] / pure[0])
            pts.setdefault(kind, []).append((point["requests"] * prompt_len / mixed[0], extra))
    return {kind: _line(p) for kind, p in pts.items()}


def _static_runs(report: dict) -> Iterator[tuple[dict, str, dict]]:
    """(point, kind of step, the run's step_seconds) of every static run in the report
    ("off" for the forced-off runs)."""
    for point in report.get("points", ()):
        for name, cfg in point.items():
            if name in ("plain", ADAPTIVE) or not isinstance(cfg, dict):
                continue
            kind = OFF if name == "forced-off" else name
            for run in cfg.get("runs", ()):
                yield point, kind, run.get("step_seconds", {})


def static_step_scales(report: dict, costs: dict[str, dict[int, float]]) -> dict[str, float]:
    """Per kind ("off" from the forced-off runs, each static mode): its decode steps' mean
    time over the cost table's at their mean rows, pooled over the report's concurrencies
    (weighted by steps)."""
    acc: dict[str, list[float]] = {}
    for _, kind, seconds in _static_runs(report):
        pure = seconds.get(kind)
        if pure and pure[0] and kind in costs:
            n, sec, rows = pure
            a = acc.setdefault(kind, [0.0, 0.0])
            a[0] += sec
            a[1] += n * _interpolate(sorted(costs[kind].items()), max(1, rows / n))
    return {k: sec / tab for k, (sec, tab) in acc.items() if tab > 0}


def trace_mixed_lines(traces: list[Path], costs: dict[str, dict[int, float]]
                      ) -> dict[str, tuple[float, float]]:  # costs: seconds, as load_table
    """Per kind of step: the line (fixed ms, ms a chunk token) of what its mixed steps took
    over the cost table's decode step at their rows, by least squares over every such step
    of the adaptive runs' traces (bench_spec_policy.py --trace: one step a line), leaving
    out the steps that switched kind (their extra is the switch's) and folds. A fixed part
    fitted below zero gives the line through the origin and the mean point."""
    pts: dict[str, list[tuple[float, float]]] = {}
    for path in traces:
        prev = None
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            kind = rec.get("observed")
            if kind is None:
                continue
            switched, prev = prev is not None and kind != prev, kind
            if switched or kind == "fold" or not rec.get("chunk") or not rec.get("b") \
                    or rec.get("ms") is None or kind not in costs:
                continue
            decode = 1e3 * _interpolate(sorted(costs[kind].items()), rec["b"])
            pts.setdefault(kind, []).append((float(rec["chunk"]), rec["ms"] - decode))
    return {kind: _line(p) for kind, p in pts.items() if len(p) >= 2}


def _line(p: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(p)
    mx, my = sum(x for x, _ in p) / n, sum(y for _, y in p) / n
    sxx = sum((x - mx) ** 2 for x, _ in p)
    slope = sum((x - mx) * (y - my) for x, y in p) / sxx if sxx > 0 else 0.0
    fixed = my - slope * mx
    if sxx <= 0 or fixed < 0 or slope < 0:
        fixed, slope = 0.0, max(0.0, my) / mx
    return fixed, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--report", help="a spec_policy.json of scripts/bench_spec_policy.py")
    src.add_argument("--results", help="experiments/results.jsonl (with --sha)")
    ap.add_argument("--fit", action="store_true",
                    help="with --report: the model's prefill, mixed-step and fold costs from "
                         "what the sweep's adaptive policy learnt (overrides those flags)")
    ap.add_argument("--fit-static", action="store_true",
                    help="with --report: each kind's mixed-step line (fixed ms, ms a chunk "
                         "token) from the sweep's static runs (forced-off and each mode)")
    ap.add_argument("--fit-trace", action="store_true",
                    help="with --report: each kind's mixed-step line from the per-step traces "
                         "beside it (trace-*.jsonl of bench_spec_policy.py --trace), over the "
                         "lines --fit-static gives")
    ap.add_argument("--profiled-priors", action="store_true",
                    help="start the policy from the report's start-up profile of mixed steps "
                         "(mixed_table_ms), not from the model's own costs")
    ap.add_argument("--sha", default="", help="with --results: the sweep's SHA prefix")
    ap.add_argument("--accept-rate", default="0.65")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--seeds", type=int, default=3, help="sweeps averaged (seeds)")
    ap.add_argument("--repeats", type=int, default=6, help="runs per configuration per sweep")
    ap.add_argument("--policy", default="server", choices=("server", "fresh"))
    ap.add_argument("--output-len-spread", type=float, default=0.0,
                    help="request i's output tokens uniform on --output-len x [1 - S, 1 + S]")
    for name, default in (("prompt-len", 128), ("output-len", 64), ("token-budget", 2048)):
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("prefill-ms-per-token", 0.03), ("mixed-ms", 2.0), ("fold-ms", 1.0),
                          ("plain-mixed-ms", 0.0),
                          ("catchup-ms", 1.0), ("catchup-ms-per-token", 0.02),
                          ("noise", 0.02)):
        ap.add_argument(f"--{name}", type=float, default=default)
    args = ap.parse_args()
    try:
        rates = parse_positive_list(args.accept_rate, float, "--accept-rate")
        levels = parse_positive_list(args.concurrency, int, "--concurrency")
    except ValueError as e:
        ap.error(str(e))
    if any(not 0 < r < 1 for r in rates):
        ap.error("--accept-rate must be in (0, 1)")
    if min(args.seeds, args.repeats, args.prompt_len, args.output_len, args.token_budget) < 1:
        ap.error("--seeds, --repeats, --prompt-len, --output-len and --token-budget must be "
                 "at least 1")
    if not 0.0 <= args.output_len_spread < 1.0:
        ap.error(f"--output-len-spread must be in [0, 1), got {args.output_len_spread}")
    try:
        costs = load_table(args)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read the cost table: {e}")
    report = json.loads(Path(args.report).read_text()) if args.report else {}
    model = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in (
        "prefill-ms-per-token", "mixed-ms", "fold-ms", "plain-mixed-ms",
        "catchup-ms-per-token")}
    if args.fit:
        if not args.report:
            ap.error("--fit reads a --report (a spec_policy.json of the sweep)")
        fit = fitted_costs(json.loads(Path(args.report).read_text()))
        if not fit:
            ap.error("--fit: the report's adaptive runs carry no learnt chunk lines "
                     "(a sweep from before they were recorded)")
        model.update(fit)
        print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in fit.items()))
    lines: dict[str, tuple[float, float]] = {}
    scales: dict[str, float] = {}
    if args.fit_static:
        if not args.report:
            ap.error("--fit-static reads a --report (a spec_policy.json of the sweep)")
        lines = static_mixed_lines(report, args.prompt_len)
        if not lines:
            ap.error("--fit-static: the report's static runs carry no mixed and decode steps")
        scales = static_step_scales(report, costs)
        print("decode steps over the table: " + ", ".join(f"{k} {v:.2f}"
                                                          for k, v in scales.items()))
    if args.fit_trace:
        if not args.report:
            ap.error("--fit-trace reads the traces beside a --report")
        traces = sorted(Path(args.report).parent.glob("trace-*.jsonl"))
        fitted = trace_mixed_lines(traces, costs)
        if not fitted:
            ap.error(f"--fit-trace: no mixed steps in the traces beside {args.report}")
        lines.update(fitted)
        spec = [ln for k, ln in fitted.items() if k != OFF]
        for name in costs:  # a mode no traced step ran with chunks: as the traced modes
            if name not in lines and spec:
                lines[name] = tuple(sum(x) / len(spec) for x in zip(*spec))
    if lines:
        print("mixed-step lines (fixed ms, ms a chunk token): " + ", ".join(
            f"{k} ({a:.2f}, {c:.4f})" for k, (a, c) in lines.items()))
    priors: dict = {}
    if args.profiled_priors:
        priors = report.get("mixed_table_ms") or {}
        if not args.report or not priors:
            ap.error("--profiled-priors reads the mixed_table_ms of a --report")
    modes, verify = {}, {}
    for name in costs:
        if name != OFF:
            topk, steps, verify[name] = parse_mode(split_mode(name)[1])
            modes[name] = (topk, steps)
    for rate in rates:
        cfg = SimConfig(costs=costs, modes=modes, verify_tokens=verify, accept_rate=rate,
                        prompt_len=args.prompt_len,
                        output_len=args.output_len, token_budget=args.token_budget,
                        output_spread=args.output_len_spread,
                        **model, catchup_ms=args.catchup_ms, noise=args.noise,
                        mixed_lines=lines, step_scale=scales, mixed_priors=priors)
        names = [OFF, *modes, ADAPTIVE]
        per: dict[int, dict[str, list[float]]] = {c: {} for c in levels}
        for seed in range(args.seeds):
            for p in sweep(cfg, levels, seed=1000 * seed, repeats=args.repeats,
                           server=args.policy == "server"):
                for n in names + ["adaptive_vs_best"]:
                    value = p[n] if n == "adaptive_vs_best" else p[n]["tok_s"]
                    per[p["concurrency"]].setdefault(n, []).append(value)
        print(f"accept rate {rate} (mean tok/s of {args.seeds} x {args.repeats} runs)")
        print("C " + " ".join(names) + " adaptive/best")
        worst = 1e9
        gpu = {p["concurrency"]: p for p in report.get("points", ())
               if report.get("accept_rate") == rate}
        for c in levels:
            ratio = statistics.mean(per[c]["adaptive_vs_best"])
            worst = min(worst, ratio)
            print(f"{c} " + " ".join(f"{statistics.mean(per[c][n]):.0f}" for n in names)
                  + f" {ratio:.3f}")
            if c in gpu:  # the sweep's own runs at this point, to judge the model by
                got = [gpu[c].get("forced-off" if n == OFF else n, {}).get("tok_s")
                       for n in names]
                print(f"  GPU {c} " + " ".join("-" if t is None else f"{t:.0f}" for t in got))
        print(f"adaptive / best >= {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
