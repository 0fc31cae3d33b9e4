"""`bench latency --exact` (or `--exact-attention`): the cost of exact mode (or of its attention
part alone) against the default, in one invocation.

After the exact-mode points are timed, the same grid (contexts x batch sizes, same prompts,
same modes) is timed again on an engine built from the same config with both off; each point
reports both throughputs and the cost (default tok/s / exact tok/s - 1).
"""

from __future__ import annotations

from typing import Any

from specserve.config import EngineConfig


def measure_default(
    config: EngineConfig, grid: list[tuple[int, int]], modes: list[str], args: Any
) -> dict[tuple[int, int], dict[str, float]]:
    """{(context, batch): {mode: tok/s}} of the default (non-exact) engine."""
    from specserve.bench.latency import bench_point
    from specserve.bench.prompts import make_prompts
    from specserve.llm import LLM

    llm = LLM(config.replace(exact=False, exact_attention=False))
    try:
        out = {}
        for ctx, bs in grid:
            prompts = make_prompts(llm.engine, args.prompts, bs, ctx, config.seed)
            point = bench_point(llm.engine, prompts, modes, args.output_len, args.runs, args.warmup)
            out[(ctx, bs)] = {m: r.tok_s.mean for m, r in point.items()}
        return out
    finally:
        llm.close()


def cost_rows(
    exact_points: list[tuple[Any, dict[str, Any]]], default: dict[tuple[int, int], dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per (context, batch, mode): exact and default tok/s and the cost."""
    rows = []
    for _, point in exact_points:
        for mode, r in point.items():
            base = default[(r.context_len, r.batch_size)][mode]
            exact = r.tok_s.mean
            rows.append(
                {
                    "context_len": r.context_len,
                    "batch_size": r.batch_size,
                    "mode": mode,
                    "exact_tok_s": exact,
                    "default_tok_s": base,
                    "cost": base / exact - 1 if exact > 0 else None,
                }
            )
    return rows


def format_cost(rows: list[dict[str, Any]], what: str = "exact mode") -> str:
    lines = [f"{what} vs default (cost = default tok/s / exact tok/s - 1):"]
    for r in rows:
        cost = "n/a" if r["cost"] is None else f"{100 * r['cost']:+.1f}%"
        lines.append(
            f"  ctx {r['context_len']} bs {r['batch_size']} {r['mode']}: exact "
            f"{r['exact_tok_s']:.1f} tok/s, default {r['default_tok_s']:.1f} tok/s, "
            f"cost {cost}"
        )
    return "\n".join(lines)
