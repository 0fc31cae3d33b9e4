"""Output tok/s against concurrency for plain decoding, each static draft mode and the
adaptive policy, in one engine (one copy of the weights, every mode's graphs captured), and
the speculative engine forced off on every step (the off switch's cost against plain).

At each concurrency C, N = max(C * requests_per_slot, min_requests) requests of random
prompt ids are fed so that at most C are in flight (a new one enters as one finishes);
tok/s is the steady state, from the first finish until the last admission (every slot
busy, admissions matching finishes), beside the whole run's (whose tail of slow requests
on few slots grows with how much acceptance varies between requests); each run's wall time
per kind of step (mode, with or without prefill chunks) is in the report. An untimed short
run of every configuration on C prompts first meets the load's kernel shapes. Acceptance
is random per request
(--accept-rate: each request draws its own rate around the mean, each cycle its rejection
point; prompt i is seeded i, so request i has the same rate and draws in every
configuration): a cost-only benchmark on dummy weights. Configurations are interleaved per
concurrency (plain, forced off, static modes, adaptive), --repeats rounds of them (tok/s:
the mean), each run from an idle engine with prefix caching off (every configuration
prefills the same prompts). The adaptive policy is a server's: one policy for the whole sweep
of a rate, built from the engine's start-up cost table, so what it learnt (step-time scales,
mixed-step and switch costs, the global acceptance prior) carries from one load to the next,
the untimed run at each concurrency included; each request's own acceptance estimates start
from that prior. --policy fresh starts it anew for every run instead (a cold start). --accept-rate 0 keeps the drafter's real acceptance (a trained
pair, with --prompts for text it can predict); --emulate-comm makes every all-reduce of an
--emulate-tp model cost that table's latency (the comm-bound regime on one GPU, as `bench
latency --emulate-comm`), so the policy's start-up costs see the expensive verify too.

    python scripts/bench_spec_policy.py --model llama-3.1-8b --concurrency 1,2,4,...,256 \
        --modes chain3,chain1,chain2,tree4x3x8 --accept-rate 0.65 --out OUT [--log]
    python scripts/bench_spec_policy.py ... --accept-rate 0.65,0.3   # one engine, both rates
    python scripts/bench_spec_policy.py ... --emulate-comm pcie-nccl-8gpu --emulate-compute shard
    python scripts/bench_spec_policy.py --model specserve/assets/tiny-code --load-format auto \
        --draft-model specserve/assets/tiny-code-eagle3 --accept-rate 0 --prompts code \
        --concurrency 1,16,64 --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.policy_run import run  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.engine.goodput import _interpolate  # noqa: E402
from specserve.engine.spec_policy import (  # noqa: E402
    AdaptivePolicy,
    ScriptedPolicy,
    StaticPolicy,
)
from specserve.llm import LLM  # noqa: E402
from specserve.speculative.profile import format_table  # noqa: E402

PLAIN, OFF, ADAPTIVE = "plain", "forced-off", "adaptive"


def tabled(table: dict[str, dict[int, float]], kind: str, rows: float) -> str:
    """' (table T ms)': the start-up cost table's time of a kind of decode step (no chunks)
    at its mean decode rows, beside the time the run measured; '' for other kinds."""
    if kind not in table or rows < 1:
        return ""
    return f" (table {1e3 * _interpolate(sorted(table[kind].items()), rows):.1f})"


def use(engine, name: str, policy) -> None:
    """Set the engine up for one configuration; policy() gives the adaptive policy."""
    engine.set_speculation(name != PLAIN)
    if name == ADAPTIVE:
        engine.spec_policy = policy()
    elif name == OFF:
        engine.spec_policy = ScriptedPolicy([None])
    elif name != PLAIN:
        engine.spec_policy = StaticPolicy(name)


def sweep(engine, args, levels: list[int], modes: list[str], rate: float, comm: dict,
          out: Path) -> None:
    """Every configuration at every concurrency at one mean acceptance: out/spec_policy.json,
    its plot, the summary line and (--log) an experiments row."""
    table = engine.spec_cost_table
    print("cost table (ms):\n" + format_table(table))
    if engine.spec_mixed_table:
        print("extra ms of a prefill chunk (columns: its tokens):\n"
              + format_table(engine.spec_mixed_table))
    server = engine.new_adaptive_policy()  # one for the sweep, unless --policy fresh

    def policy() -> AdaptivePolicy:
        return engine.new_adaptive_policy() if args.policy == "fresh" else server
    from specserve.bench.prompts import make_prompts, output_lengths

    report = {"model": args.model, "accept_rate": rate, "modes": modes,
              "output_len": args.output_len, "output_len_spread": args.output_len_spread,
              "prompts": args.prompts or "random ids", "emulate_comm": comm or None,
              "policy": args.policy, "cuda_graph_max_tokens": args.cuda_graph_max_tokens,
              "chunks_in_verify": args.chunks_in_verify,
              "cost_table_ms": {m: {b: t * 1e3 for b, t in row.items()}
                                for m, row in table.items()},
              # what a prefill chunk added to a step of each kind at start-up (chunk tokens)
              "mixed_table_ms": {k: {n: t * 1e3 for n, t in row.items()}
                                 for k, row in (engine.spec_mixed_table or {}).items()},
              "startup_s": engine.startup_seconds,
              "cost_table_s": engine.spec_cost_seconds, "points": []}
    print(f"start-up {engine.startup_seconds:.1f} s, the cost table's part "
          f"{engine.spec_cost_seconds:.1f} s")
    # forced-off: the speculative engine with every step off (its cost over plain: the off
    # switch's tax)
    configs = [PLAIN, OFF, *modes, ADAPTIVE]
    for c in levels:
        n = max(c * args.requests_per_slot, args.min_requests)
        prompts = make_prompts(engine, args.prompts, n, args.prompt_len, seed=c)
        lens = output_lengths(n, args.output_len, args.output_len_spread)
        point = {"concurrency": c, "requests": n}
        # untimed: kernels meet this load's shapes first (every configuration: eager
        # paths of mixed steps, catch-ups and folds compile per new shape class, a second
        # or so each, which would land in a short timed run)
        for name in configs if args.warmup_each else [PLAIN]:
            use(engine, name, policy)
            run(engine, prompts[:c], [min(k, 16) for k in lens[:c]], c)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.repeats):  # rounds of every configuration, interleaved
            for name in configs:
                use(engine, name, policy)
                if name == ADAPTIVE and args.trace:  # its decisions and steps, one a line
                    engine.spec_policy.trace = []
                runs[name].append(run(engine, prompts, lens, c))
                if name == ADAPTIVE:  # what the policy learnt in this run
                    pol = engine.spec_policy
                    if pol.trace is not None:
                        out.mkdir(parents=True, exist_ok=True)
                        path = out / f"trace-c{c}-{len(runs[name])}.jsonl"
                        path.write_text("".join(json.dumps(r) + "\n" for r in pol.trace))
                        pol.trace = None
                    runs[name][-1]["learnt"] = {
                        "steps": pol.steps, "switch_steps": dict(pol.switch_steps),
                        # measured / tabled step time (a mode not measured: what it borrows)
                        "scale": {m: pol.scale_of(m) for m in pol.scale},
                        "mixed_share": pol.mixed_share,
                        "mixed_extra_ms": {m: t * 1e3 for m, t in pol.mixed_extra.items()},
                        # prompt tokens per emitted token; per kind (fixed ms, us a token)
                        "rho": pol.chunk_ema / pol.emitted_ema if pol.emitted_ema else None,
                        "chunk_lines": {k: (pol.chunk_cost.line(k)[0] * 1e3,
                                            pol.chunk_cost.line(k)[1] * 1e6)
                                        for k in sorted(pol.chunk_cost.kinds())}}
        for name in configs:
            rs = runs[name]
            steps: dict[str, int] = {}
            for r in rs:
                for m, k in r["mode_steps"].items():
                    steps[m] = steps.get(m, 0) + k
            point[name] = {"tok_s": sum(r["tok_s"] for r in rs) / len(rs),
                           "tok_s_all": sum(r["tok_s_all"] for r in rs) / len(rs),
                           "runs_tok_s": [r["tok_s"] for r in rs], "mode_steps": steps,
                           "runs": rs}
            spread = (f" ({min(point[name]['runs_tok_s']):.1f}-"
                      f"{max(point[name]['runs_tok_s']):.1f})" if len(rs) > 1 else "")
            kinds: dict[str, list] = {}
            for r in rs:
                for kind, (n, t, b) in r["step_seconds"].items():
                    acc = kinds.setdefault(kind, [0, 0.0, 0])
                    acc[0] += n
                    acc[1] += t
                    acc[2] += b
            per = ", ".join(f"{k} {1e3 * t / n:.1f} ms x{n} @{b / n:.0f}"
                            f"{tabled(table, k, b / n)}"
                            for k, (n, t, b) in sorted(kinds.items()))
            joined = sum(r["chunks_in_verify"] for r in rs)
            per += f"; chunks in verify x{joined}" if joined else ""
            caught = sum(r["catch_up_tokens"] for r in rs)
            per += f"; {caught} catch-up tokens" if caught else ""
            jit = sum(sum(r["triton_compiles"].values()) for r in rs)
            per += f"; {jit} Triton compiles" if jit else ""
            for key in sorted({k for r in rs for k in r.get("triton_compile_keys", ())}):
                # a compile inside a timed run: which specialization the warm-up missed
                print(f"C={c} {name}: compiled inside the run: {key}", flush=True)
            print(f"C={c} {name}: {point[name]['tok_s']:.1f} tok/s{spread} (whole run "
                  f"{point[name]['tok_s_all']:.1f}) {steps}" + (f" [{per}]" if per else ""),
                  flush=True)
        learnt = runs[ADAPTIVE][-1]["learnt"]
        print(f"C={c} adaptive learnt: switch steps "
              f"{ {k: round(v, 2) for k, v in learnt['switch_steps'].items()} }, mixed share "
              f"{learnt['mixed_share']:.2f}, mixed extra ms "
              f"{ {k: round(v, 2) for k, v in learnt['mixed_extra_ms'].items()} }, chunk "
              f"tokens per emitted {learnt['rho'] or 0:.2f}, lines (fixed ms, us a token) "
              f"{ {k: (round(a, 2), round(c, 2)) for k, (a, c) in learnt['chunk_lines'].items()} }",
              flush=True)
        best = max(point[m]["tok_s"] for m in configs if m not in (ADAPTIVE, OFF))
        point["adaptive_vs_best"] = point[ADAPTIVE]["tok_s"] / best
        point["adaptive_vs_plain"] = point[ADAPTIVE]["tok_s"] / point[PLAIN]["tok_s"]
        point["forced_off_vs_plain"] = point[OFF]["tok_s"] / point[PLAIN]["tok_s"]
        report["points"].append(point)
        # after every concurrency: a run stopped by a time limit keeps the levels it finished
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec_policy.json").write_text(json.dumps(report, indent=1))
    from specserve.bench.plots import plot_sweep

    series = {m: [p[m]["tok_s"] for p in report["points"]] for m in configs}
    plot_sweep(str(out / "spec_policy.png"), levels, series,
               title=f"{args.model}, random acceptance (mean {rate})")
    worst_best = min(p["adaptive_vs_best"] for p in report["points"])
    worst_plain = min(p["adaptive_vs_plain"] for p in report["points"])
    worst_off = min(p["forced_off_vs_plain"] for p in report["points"])
    print(f"adaptive / best config >= {worst_best:.3f}; adaptive / plain >= {worst_plain:.3f}; "
          f"forced off / plain >= {worst_off:.3f}")
    if args.log:
        from specserve.bench.log import append_result

        label = args.label.replace("{rate}", str(rate)) or f"{args.model} policy sweep rate {rate}"
        append_result(args.exp_dir, {"benchmark": "spec_policy", **report},
                      {"benchmark": "spec_policy", "config": label,
                       "tok_s": report["points"][-1][ADAPTIVE]["tok_s"],
                       "notes": f"adaptive/best min {worst_best:.3f}, /plain min "
                                f"{worst_plain:.3f} over C {levels}, output lengths spread "
                                f"{args.output_len_spread}, token graphs to "
                                f"{args.cuda_graph_max_tokens} tokens"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--draft-model", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--modes", default="chain3,chain1,chain2,tree4x3x8",
                    help="draft modes; the first is the engine's configured shape")
    ap.add_argument("--accept-rate", default="0.65",
                    help="mean synthetic acceptance per draft (0.65: AL ~2.5 at chain 3, "
                         "0.3: ~1.5), or several (0.65,0.3: swept in one engine, a report "
                         "each under OUT/rate-R); 0: the drafter's real acceptance")
    ap.add_argument("--prompts", default=None,
                    help="a prompt set (chat, code, shared or a .jsonl file) cut to "
                         "--prompt-len tokens; default: random token ids")
    ap.add_argument("--emulate-comm", default="",
                    help="a comm latency table (distributed/comm_tables) for every all-reduce")
    ap.add_argument("--emulate-tp", type=int, default=8)
    ap.add_argument("--emulate-compute", default="full", choices=("full", "shard"))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-spread", type=float, default=0.0,
                    help="request i's output tokens uniform on --output-len x [1 - S, 1 + S] "
                         "(0: all equal; requests admitted together then finish together)")
    ap.add_argument("--requests-per-slot", type=int, default=4,
                    help="requests per concurrent slot (the steady window spans about this "
                         "many request lifetimes less one)")
    ap.add_argument("--no-warmup-each", dest="warmup_each", action="store_false",
                    help="warm up with plain decoding only (not every configuration)")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--policy", default="server", choices=("server", "fresh"),
                    help="server: one adaptive policy for the sweep of a rate (what it "
                         "learnt carries across loads); fresh: a new one every run")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of every configuration per concurrency (tok/s: their mean)")
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=8192,
                    help="the engine option (the same default): steps with prefill chunks "
                    "through token CUDA graphs up to this many tokens (0: eager)")
    ap.add_argument("--chunks-in-verify", default="auto", choices=("auto", "always", "never"),
                    help="a speculative step's prefill chunks ride in the cycle's verify "
                    "forward (always), run in their own forward before the cycle (never), or "
                    "the worker's default (auto: their own where the chunks' token graph and "
                    "the cycle's graph both hold the step)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", action="store_true",
                    help="write the adaptive runs' decisions and steps (out/trace-c<C>-<run>.jsonl)")
    ap.add_argument("--log", action="store_true", help="append to experiments/ (LOG.md)")
    ap.add_argument("--exp-dir", default="experiments")
    ap.add_argument("--label", default="", help="experiments row label ({rate}: the rate)")
    args = ap.parse_args()
    levels = parse_positive_list(args.concurrency, int, "--concurrency")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if not 0.0 <= args.output_len_spread < 1.0:
        ap.error(f"--output-len-spread must be in [0, 1), got {args.output_len_spread}")
    if args.requests_per_slot < 1 or args.min_requests < 1:
        ap.error(f"--requests-per-slot and --min-requests must be at least 1, got "
                 f"{args.requests_per_slot} and {args.min_requests}")
    try:
        rates = [float(r) for r in args.accept_rate.split(",")]
    except ValueError:
        ap.error(f"--accept-rate: numbers in [0, 1) separated by commas, got {args.accept_rate!r}")
    if not all(0.0 <= r < 1.0 for r in rates) or (len(rates) > 1 and 0.0 in rates):
        ap.error(f"--accept-rate must be in [0, 1) (0: real acceptance, alone), "
                 f"got {args.accept_rate}")
    if args.prompts is not None:
        from specserve.bench.prompts import load_prompts

        try:
            load_prompts(args.prompts)
        except ValueError as err:
            ap.error(f"--prompts: {err}")
    comm = {}
    if args.emulate_comm:
        from specserve.distributed.emulator import LatencyTable

        try:
            LatencyTable.load(args.emulate_comm)
        except (OSError, ValueError) as err:
            ap.error(f"--emulate-comm: {err}")
        comm = dict(emulate_comm=args.emulate_comm, emulate_tp=args.emulate_tp,
                    emulate_compute=args.emulate_compute)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from specserve.speculative.proposer import DraftShape

    first = DraftShape.parse(modes[0])
    spec = dict(algorithm="eagle3", draft_model=args.draft_model, topk=first.topk,
                num_steps=first.num_steps, num_draft_tokens=first.num_draft_tokens,
                modes=",".join(modes[1:]), policy="adaptive",
                synthetic_accept_rate=rates[0])
    top = max(levels)
    llm = LLM(args.model, speculative_config=spec, load_format=args.load_format, device=args.device,
              cuda_graph_max_bs=top, comm=comm,
              cuda_graph_max_tokens=args.cuda_graph_max_tokens,
              # every configuration re-runs the same prompts: a prefix cache would spare all
              # but the first their prefill
              cache={"enable_prefix_caching": False},
              scheduler={"max_model_len": args.prompt_len + 64
                         + round(args.output_len * (1 + args.output_len_spread)),
                         "max_num_seqs": top,
                         "max_num_batched_tokens": max(2048, args.prompt_len * 4)})
    engine = llm.engine
    engine.drafter.chunks_in_verify = args.chunks_in_verify
    for i, rate in enumerate(rates):
        if i:  # the same engine, graphs and cost table: only the acceptance changes
            for mode in engine.drafter.modes.values():
                mode.cycle.set_synthetic_accept_rate(rate)
        out = Path(args.out) / f"rate-{rate}" if len(rates) > 1 else Path(args.out)
        sweep(engine, args, levels, modes, rate, comm, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
