"""`specserve bench latency`: offline decode latency, plain vs speculative, in one process.

Method. One engine (one copy of the weights) serves both modes, switched between runs with
`Engine.set_speculation`. For every (context, batch) point: warm-up runs, then the timed runs
with the modes interleaved (A B A B ...) on the same prompts. One run adds `bs` requests of the
context length (greedy, ignore_eos), steps through the prefill until every request holds its
first token, then times the decode phase alone (perf_counter from the return of the last
untimed step, whose tokens are then on the host, to the return of the step that delivers the
last needed token) until each request has decoded at least `output_len` tokens, and aborts
the requests. Every decode step therefore
runs the full batch. A run gives decode tok/s and ms/step; speculation also gives the accept
length (tokens per draft-verify cycle, bonus included) and the per-position acceptance from
counter deltas over the timed phase.
    speculative efficiency = spec tok/s / (accept length x plain tok/s)   (1.0: drafting free)
With a synthetic accept length every number is a cost-only measurement and says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from specserve.bench.exact_cost import cost_rows, format_cost, measure_default
from specserve.bench.floor import sync, touched_experts
from specserve.bench.latency_report import BASELINE, SYNTHETIC, format_report, write_log
from specserve.bench.log import environment_info
from specserve.bench.prompts import make_prompts
from specserve.bench.stats import (
    Summary,
    summarize,
)
from specserve.bench.verify_floor import verify_floor_ms
from specserve.config import EngineConfig
from specserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)



@dataclass
class RunResult:
    """One timed decode phase."""

    decode_s: float
    steps: int
    tokens: int  # generated in the timed phase, all requests
    drafts: int = 0  # draft-verify cycles (counter deltas)
    accepted: int = 0  # accepted draft tokens, bonus excluded
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s

    @property
    def ms_per_step(self) -> float:
        return self.decode_s * 1e3 / self.steps

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.drafts) / self.drafts if self.drafts else float("nan")


def _spec_counters(engine: Any) -> tuple[int, int, list[int]]:
    stats = engine.stats()
    return stats["num_drafts"], stats["num_accepted_tokens"], list(stats["accepted_per_pos"])


def max_new_tokens(config: EngineConfig, prompt_tokens: int, output_len: int,
                   spec: bool) -> int:
    """Tokens a timed request may generate: output_len plus room for those decoded while later
    requests of the batch still prefill (every prompt through the token budget), so none
    finishes early."""
    per_step = config.spec.verify_tokens if spec else 1
    prefill_steps = math.ceil(prompt_tokens / config.scheduler.max_num_batched_tokens) + 2
    return output_len + 2 * per_step * (prefill_steps + 1)


def run_once(engine: Any, prompts: list[list[int]], output_len: int, spec: bool,
             probe: Callable[[list[str]], None] | None = None) -> RunResult:
    """Prefill the batch, then time a decode phase of >= output_len tokens per request;
    `probe(request ids)` runs after the timed phase, before the requests are aborted."""
    max_tokens = max_new_tokens(engine.config, sum(map(len, prompts)), output_len, spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    produced = dict.fromkeys(ids, 0)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                raise ValueError(f"request {out.request_id} ended ({out.finish_reason}) inside the "
                                 "timed phase; lower --output-len or raise --max-model-len")
            produced[out.request_id] = out.num_output_tokens

    try:
        while min(produced.values()) < 1:
            step()
        start = dict(produced)
        before = _spec_counters(engine) if spec else (0, 0, [])
        # a step returns once its tokens are on the host, so the clock runs from one delivery
        # to the last: with decode overlap the device may already be computing the step after
        # either end, and neither that work nor an idle gap belongs to the measured steps
        t0 = time.perf_counter()
        steps = 0
        while min(produced[i] - start[i] for i in ids) < output_len:
            step()
            steps += 1
        decode_s = time.perf_counter() - t0
        sync(engine.runner.device)
        after = _spec_counters(engine) if spec else (0, 0, [])
        if probe is not None:
            probe(ids)
    finally:  # the engine is left empty either way
        for i in ids:
            engine.abort_request(i)
    per_pos = tuple(a - b for a, b in zip(after[2], before[2]))
    return RunResult(decode_s, steps, sum(produced[i] - start[i] for i in ids),
                     after[0] - before[0], after[1] - before[1], per_pos)


@dataclass
class ModeResult:
    """The timed runs of one mode at one (batch, context) point."""

    mode: str
    batch_size: int
    context_len: int
    runs: list[RunResult]

    @property
    def tok_s(self) -> Summary:
        return summarize([r.tok_s for r in self.runs])

    @property
    def ms_per_step(self) -> Summary:
        return summarize([r.ms_per_step for r in self.runs])

    @property
    def accept_length(self) -> Summary | None:
        return summarize([r.accept_length for r in self.runs]) if self.mode != BASELINE else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        """P(draft position d accepted) per cycle, over all timed runs."""
        drafts = sum(r.drafts for r in self.runs)
        totals = [sum(col) for col in zip(*(r.accepted_per_pos for r in self.runs))]
        return [t / drafts for t in totals] if drafts else []

    def to_dict(self) -> dict[str, Any]:
        al = self.accept_length
        return {
            "mode": self.mode, "batch_size": self.batch_size, "context_len": self.context_len,
            "tok_s": self.tok_s.to_dict(), "ms_per_step": self.ms_per_step.to_dict(),
            "accept_length": al.to_dict() if al else None,
            "acceptance_per_pos": self.acceptance_per_pos,
            "runs": [{**asdict(r), "tok_s": r.tok_s, "ms_per_step": r.ms_per_step}
                     for r in self.runs],
        }


def efficiency(spec: ModeResult, plain: ModeResult) -> float:
    """spec tok/s / (accept length x plain tok/s), on the means."""
    assert spec.accept_length is not None
    return spec.tok_s.mean / (spec.accept_length.mean * plain.tok_s.mean)


def check_point(config: EngineConfig, max_model_len: int, kv_capacity: int | None,
                batch_size: int, context_len: int, output_len: int) -> None:
    """ValueError (what to change) for a point that cannot run at the full batch;
    kv_capacity None: not known yet (a GPU's cache is sized when the engine is built)."""
    sched = config.scheduler
    if batch_size > sched.max_num_seqs:
        raise ValueError(f"batch size {batch_size} exceeds --max-num-seqs {sched.max_num_seqs}; "
                         "raise --max-num-seqs")
    lookahead = config.spec.verify_tokens if config.spec.enabled else 1
    room = max_new_tokens(config, batch_size * context_len, output_len, config.spec.enabled)
    need = context_len + room + lookahead
    if need > max_model_len:
        raise ValueError(
            f"context {context_len} + output {output_len} (+ {room - output_len} tokens decoded "
            f"while the batch of {batch_size} prefills, + drafts) exceeds the context length "
            f"{max_model_len}; raise --max-model-len to at least {need}")
    if kv_capacity is not None and batch_size * (need + config.cache.page_size) > kv_capacity:
        raise ValueError(f"batch {batch_size} x {need} tokens does not fit the KV cache "
                         f"({kv_capacity} tokens); lower the batch or context, or give the cache "
                         "more memory (--gpu-memory-utilization / --kv-cache-bytes)")


def planned_capacity(config: EngineConfig) -> tuple[int, int | None]:
    """(context length, KV tokens) the engine will have, from the model's config alone, once
    its weights are known to fit (ValueError otherwise): the checks run before the weights are
    built. The KV size is known up front on the CPU only."""
    from specserve.engine.local_worker import resolve_model
    from specserve.engine.memory import check_fits
    from specserve.worker.device import resolve_device, resolve_dtype

    _, mc = resolve_model(config)
    device = resolve_device(config.device)
    # the weights first: the biggest thing a preset on the wrong machine gets wrong
    check_fits(config.model, mc, None, resolve_dtype(config.dtype, mc, device), device,
               config.cache, tp_size=config.parallel.tp_size)
    mpe = mc.max_position_embeddings
    max_len = min(config.scheduler.max_model_len or mpe, mpe)
    cache = config.cache
    if cache.num_pages:
        return max_len, cache.num_pages * cache.page_size
    if device.type == "cuda":
        return max_len, None
    per_token = mc.kv_bytes_per_token(resolve_dtype(config.dtype, mc, device).itemsize)
    if config.spec.enabled:  # one EAGLE-3 layer, the target's KV shape (MHA targets only)
        if mc.mla is not None:
            return max_len, None  # an MHA head over a latent cache: checked once built
        per_token += per_token // mc.num_layers
    return max_len, cache.kv_cache_bytes // (per_token * cache.page_size) * cache.page_size


def bench_point(engine: Any, prompts: list[list[int]], modes: list[str], output_len: int,
                runs: int, warmup: int, experts: dict[Any, list[int]] | None = None,
                bar: Any = None) -> dict[str, ModeResult]:
    """Warm-up, then `runs` timed runs per mode, interleaved A B A B; `bar` (a tqdm) advances
    per run. With `experts` (a MoE model), the routed experts the batch touches in a decode
    step after the last run are recorded as experts[bs] (for the floor), and with a speculative
    mode those of a verify pass as experts["verify", bs] (bench/verify_floor.py)."""
    bs, ctx = len(prompts), len(prompts[0])
    results = {m: ModeResult(m, bs, ctx, []) for m in modes}

    def probe(ids: list[str]) -> None:
        assert experts is not None
        experts.setdefault(bs, touched_experts(engine, ids))
        if modes != [BASELINE]:
            nodes = engine.config.spec.verify_tokens
            experts.setdefault(("verify", bs), touched_experts(engine, ids, nodes))

    for i in range(warmup + runs):
        for mode in modes:
            engine.set_speculation(mode != BASELINE)
            last = i == warmup + runs - 1 and mode == modes[0]
            run = run_once(engine, prompts, output_len, mode != BASELINE,
                           probe if last and experts is not None else None)
            if i >= warmup:
                results[mode].runs.append(run)
            log.info("bs %d ctx %d %s run %d: %.1f tok/s", bs, ctx, mode, i - warmup,
                     run.tok_s)
            if bar is not None:
                bar.set_postfix_str(f"ctx {ctx} bs {bs} {mode} {run.tok_s:.1f} tok/s")
                bar.update(1)
    return results


# -- the command ------------------------------------------------------------------------------


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """`specserve bench latency` with its flags already checked (specserve/cli/bench.py)."""
    from specserve.bench.floor import measure_copy_bandwidth, measure_references
    from specserve.bench.verify_floor import measure_verify_floor
    from specserve.distributed import comm
    from specserve.distributed.comm import emulated_tables
    from specserve.llm import LLM
    from specserve.worker.device import resolve_device

    batch_sizes, contexts = args.batch_sizes, args.context_len
    modes = ([] if args.no_baseline else [BASELINE]) + (
        [config.spec.algorithm] if config.spec.enabled else [])  # the method names its mode
    if not modes:
        raise ValueError("--no-baseline without speculation leaves nothing to time; add "
                         "--spec-algorithm eagle3 --spec-draft-model PATH|dummy")
    tables = emulated_tables(config.comm) or [None]  # checked before the model loads
    device = resolve_device(config.device)
    floor = device.type == "cuda" if args.floor is None else args.floor
    # before the engine: its KV cache takes most of the free memory
    grid = [(ctx, bs) for ctx in contexts for bs in batch_sizes]
    planned = planned_capacity(config)
    for ctx, bs in grid:  # before the weights are built
        check_point(config, *planned, bs, ctx, args.output_len)
    copy = measure_copy_bandwidth(device).to_dict() if floor else None
    t0 = time.perf_counter()
    llm = LLM(config)  # owns the engine: it is closed when the LLM goes
    engine = llm.engine
    startup_s = time.perf_counter() - t0
    capacity = engine.stats()["kv_token_capacity"]
    for ctx, bs in grid:  # the engine's real sizes (a sliding window, a GPU's KV cache)
        check_point(engine.config, engine.max_model_len, capacity, bs, ctx, args.output_len)
    bar = tqdm(total=len(tables) * len(grid) * len(modes) * (args.runs + args.warmup),
               desc="bench latency",
               unit="run", disable=not args.progress)
    points = []
    experts: dict[Any, list[int]] = {}  # MoE: routed experts a decode step reads, per batch
    # the probe is one eager forward on this process: with TP ranks elsewhere the floor
    # counts top_k experts per token instead
    probe_experts = floor and config.parallel.tp_size == 1
    for table, (ctx, bs) in ((t, g) for t in tables for g in grid):
        if table is not None:  # swapped in place: the captured graphs stay valid
            comm.emulator().set_table(table)
        prompts = make_prompts(engine, args.prompts, bs, ctx, config.seed)
        point = bench_point(engine, prompts, modes, args.output_len, args.runs, args.warmup,
                            experts if probe_experts else None, bar)
        points.append((table, point))
        if args.progress:
            where = f" comm {table.name}" if table is not None else ""
            bar.write(f"ctx {ctx} bs {bs}{where}: " + ", ".join(
                f"{m} {r.tok_s.mean:.1f} tok/s" + (
                    f" (accept length {r.accept_length.mean:.2f})" if r.accept_length else "")
                for m, r in point.items()), file=sys.stderr)
    bar.close()
    first = make_prompts(engine, args.prompts, 1, contexts[0], config.seed)[0]
    refs = measure_references(engine, batch_sizes, floor, args.compare_hf, first,
                              args.output_len, args.runs, args.warmup, experts or None)
    refs["verify_floor"] = measure_verify_floor(engine.runner.model, experts,
                                                config.spec.verify_tokens)
    spec = config.spec
    report = {
        "benchmark": "latency", "label": args.label, "model": config.model,
        "device": str(engine.runner.device), "dtype": str(engine.runner.dtype).split(".")[-1],
        "acceptance": None if not spec.enabled else (
            SYNTHETIC if spec.synthetic else "real"),
        "output_len": args.output_len, "runs": args.runs, "warmup": args.warmup,
        "prompts": args.prompts or "random token ids", "startup_s": startup_s,
        "environment": environment_info(),
        "engine_startup_s": engine.startup_seconds, "config": asdict(engine.config),
        "copy": copy or {"skipped": "runs with --floor"}, **refs,
        "points": [{**_point_dict(p, refs, _roofline(engine, refs, copy, p, args.output_len)),
                    "comm_table": t and t.name} for t, p in points],
    }
    exact = "exact mode" if config.exact else "exact attention" if config.exact_attention else ""
    if exact:  # the same grid with exact off: the mode's cost (bench/exact_cost.py)
        llm.close()  # its KV cache and graphs go before the default engine sizes its own
        report["exact_cost"] = cost_rows(points, measure_default(config, grid, modes, args))
    print(format_report(report))
    if exact:
        print(format_cost(report["exact_cost"], exact))
    if args.log:
        write_log(report, args.exp_dir)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=str)
    llm.close()
    return 0


def _roofline(engine: Any, refs: dict[str, Any], copy: dict[str, Any] | None,
              modes: dict[str, ModeResult], output_len: int) -> dict[str, Any] | None:
    """The plain decode step's roofline at this point (None without --floor). Each request's
    context during the timed phase averages the prompt + half the decoded tokens."""
    from specserve.bench.floor import decode_roofline
    from specserve.distributed.parallel_state import get_tp_size

    if copy is None or "points" not in refs["floor"]:
        return None
    mc, tp = engine.model_config, get_tp_size()
    any_mode = next(iter(modes.values()))
    floor_pt = next(f for f in refs["floor"]["points"] if f["batch_size"] == any_mode.batch_size)
    return decode_roofline(
        floor_pt["weight_bytes"], refs["floor"]["weight_params"],  # a MoE: experts touched
        mc.kv_bytes_per_token(engine.runner.dtype.itemsize) // (1 if mc.mla else tp),
        mc.num_layers,
        mc.num_heads * mc.head_dim // tp, any_mode.batch_size,
        any_mode.context_len + output_len / 2, copy["bandwidth_gbs"], refs["peak"]["tflops"])


def _point_dict(modes: dict[str, ModeResult], refs: dict[str, Any],
                roofline: dict[str, Any] | None) -> dict[str, Any]:
    """One (batch, context) point: the modes, efficiency, floor and roofline ratios (of the
    plain decode step), HF speedup."""
    any_mode = next(iter(modes.values()))
    bs, plain = any_mode.batch_size, modes.get(BASELINE)
    spec = next((m for name, m in modes.items() if name != BASELINE), None)
    floor_ms = next((f["ms"] for f in refs["floor"].get("points", ())
                     if f["batch_size"] == bs), None)
    hf = refs["hf"]
    hf_tok_s = hf["tok_s"]["mean"] if "tok_s" in hf and bs == 1 and (
        hf["context_len"] == any_mode.context_len) else None
    return {
        "batch_size": bs, "context_len": any_mode.context_len,
        "modes": {m: r.to_dict() for m, r in modes.items()},
        "efficiency": efficiency(spec, plain) if spec and plain else None,
        "floor_ms": floor_ms,
        "verify_floor_ms": verify_floor_ms(refs, bs) if spec else None,
        "floor_ratio": floor_ms / plain.ms_per_step.mean if floor_ms and plain else None,
        "roofline": roofline,
        "roofline_ratio": roofline["ms"] / plain.ms_per_step.mean if roofline and plain
        else None,
        "hf_speedup": {m: r.tok_s.mean / hf_tok_s for m, r in modes.items()} if hf_tok_s
        else None,
    }
