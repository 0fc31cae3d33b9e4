"""Timing pieces of the paged-attention launch-parameter sweep (scripts/bench_attention.py):
the cases and configs, random paged batches, CUDA-graph timing, and which configs are the same
launch. The script holds the command line, the parallel precompile and the report."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kernels import paged_attention as pa
from specserve.kernels.dispatch import triton

ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # max abs error
RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}  # worst row's rel. L2


@dataclass(frozen=True)
class CaseSpec:
    name: str
    q_len: int
    mask: str | None  # None: causal (or decode); "causal": a tril custom mask; "tree": a tree


CASES = [
    CaseSpec("decode", 1, None),
    CaseSpec("verify4_mask", 4, "causal"),
    CaseSpec("causal4", 4, None),  # a chain's verify as a causal extend (exact mode's route)
    CaseSpec("verify16_tree", 16, "tree"),
    CaseSpec("causal16", 16, None),
]


@dataclass(frozen=True)
class Config:
    num_warps: int | None  # None: Triton's default
    num_stages: int | None  # None: Triton's default
    block_n: int | None  # None: paged_attention's default (128 for decode or under a mask, else 64)
    num_splits: int | None  # None: default_num_splits (depends on the grid)


DEFAULT_CONFIG = Config(None, None, None, None)


@dataclass
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    context_len: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class Batch:
    """One case at one batch size: `sets` KV sets (disjoint shuffled pages) over one cache."""

    q: torch.Tensor  # [bs * q_len, H, D]
    k_cache: torch.Tensor  # [num_pages, page_size, KVH, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [bs + 1] int32 (passed as None for decode)
    seq_lens: torch.Tensor  # [bs] int32
    page_tables: list[torch.Tensor]  # per KV set: [bs, pages per request] int32
    mask: torch.Tensor | None  # [bs, q_len, q_len] bool
    out: torch.Tensor

    def call(self, spec: CaseSpec, cfg: Config, kv_set: int = 0) -> torch.Tensor:
        decode = spec.q_len == 1 and spec.mask is None
        return pa.paged_attention(
            self.q, self.k_cache, self.v_cache, None if decode else self.query_start_loc,
            self.seq_lens, self.page_tables[kv_set], spec.q_len, self.q.shape[-1] ** -0.5,
            self.mask, self.out, num_splits=cfg.num_splits, block_n=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def reference(self, spec: CaseSpec) -> torch.Tensor:
        return pa.paged_attention_ref(
            self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
            self.page_tables[0], self.q.shape[-1] ** -0.5, self.mask,
        )  # fmt: skip


def tree_mask(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """[q_len, q_len]: node i sees its ancestors (a random parent < i) and itself."""
    mask = torch.zeros(q_len, q_len, dtype=torch.bool)
    for i in range(q_len):
        if i:
            mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        mask[i, i] = True
    return mask


def fit_kv_sets(sets: int, spec: CaseSpec, bs: int, s: Shapes, free_bytes: int) -> int:
    """KV sets (one per captured call, so that calls read cold KV) that fit in half the free
    memory, at least 1: a long context at a large batch is GBs a set (32k x 64 requests of
    Llama-8B: 8.6 GB; 20 sets asked for 172 GB), where a few sets already leave nothing
    of one call's KV in L2 for the next."""
    pages = math.ceil((s.context_len + spec.q_len) / s.page_size)
    per_set = 2 * bs * pages * s.page_size * s.num_kv_heads * s.head_dim * s.dtype.itemsize
    return max(1, min(sets, free_bytes // 2 // per_set))


def make_batch(spec: CaseSpec, bs: int, s: Shapes, sets: int, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(s.device).manual_seed(seed)
    seq_len = s.context_len + spec.q_len
    per_req = math.ceil(seq_len / s.page_size)
    num_pages = sets * bs * per_req + 1  # one page belongs to nobody
    order = torch.randperm(num_pages, generator=gen).int()
    tables = [order[i * bs * per_req : (i + 1) * bs * per_req].view(bs, per_req).to(s.device)
              for i in range(sets)]  # separate tensors: same alignment for every set
    shape = (num_pages, s.page_size, s.num_kv_heads, s.head_dim)
    k = torch.randn(shape, generator=dgen, device=s.device, dtype=s.dtype)
    v = torch.randn(shape, generator=dgen, device=s.device, dtype=s.dtype)
    q = torch.randn(bs * spec.q_len, s.num_heads, s.head_dim, generator=dgen, device=s.device,
                    dtype=s.dtype)  # fmt: skip
    mask = None
    if spec.mask == "causal":
        mask = torch.ones(spec.q_len, spec.q_len, dtype=torch.bool).tril().expand(bs, -1, -1)
    elif spec.mask == "tree":
        mask = torch.stack([tree_mask(spec.q_len, gen) for _ in range(bs)])
    qsl = torch.arange(0, bs * spec.q_len + 1, spec.q_len, dtype=torch.int32)
    return Batch(
        q, k, v, qsl.to(s.device), torch.full((bs,), seq_len, dtype=torch.int32, device=s.device),
        tables, None if mask is None else mask.contiguous().to(s.device), torch.empty_like(q),
    )  # fmt: skip


def active_splits(seq_len: int, splits: int, block_n: int) -> int:
    """Splits that get any KV: each split's range is rounded up to whole KV blocks."""
    split_len = math.ceil(math.ceil(seq_len / splits) / block_n) * block_n
    return math.ceil(seq_len / split_len)


def triton_launch_defaults(device: torch.device) -> tuple[int | None, int | None]:
    """Triton's default (num_warps, num_stages) on this GPU; (None, None) if unknown."""
    if device.type != "cuda":
        return None, None
    try:
        from triton.compiler import make_backend

        opts = make_backend(triton.runtime.driver.active.get_current_target()).parse_options({})
        return int(opts.num_warps), int(opts.num_stages)
    except Exception:  # noqa: BLE001 - internal API; only used to merge duplicate configs
        return None, None


def resolved(cfg: Config, spec: CaseSpec, bs: int, s: Shapes,
             launch_defaults: tuple[int | None, int | None]) -> tuple:  # fmt: skip
    """What the launch actually uses: configs with equal keys are the same kernel launch."""
    _, _, splits, block_n, warps, stages = pa.launch_plan(
        bs, spec.q_len, s.num_heads // s.num_kv_heads, s.num_kv_heads, spec.mask is not None,
        s.device, cfg.num_splits, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return (warps if warps is not None else launch_defaults[0],
            stages if stages is not None else launch_defaults[1], block_n, splits)


def configs_for(spec: CaseSpec, bs: int, s: Shapes, grid: dict[str, list[int | None]],
                launch_defaults: tuple[int | None, int | None]) -> list[Config]:  # fmt: skip
    """The grid with the default config first, one config per distinct launch."""
    seen: set[tuple] = set()
    out = []
    for w in [DEFAULT_CONFIG.num_warps, *grid["num_warps"]]:
        for st in [DEFAULT_CONFIG.num_stages, *grid["num_stages"]]:
            for bn in [DEFAULT_CONFIG.block_n, *grid["block_n"]]:
                for sp in [DEFAULT_CONFIG.num_splits, *grid["num_splits"]]:
                    cfg = Config(w, st, bn, sp)
                    in_grid = (w in grid["num_warps"] and st in grid["num_stages"]
                               and bn in grid["block_n"] and sp in grid["num_splits"])
                    key = resolved(cfg, spec, bs, s, launch_defaults)
                    if (cfg == DEFAULT_CONFIG or in_grid) and key not in seen:
                        seen.add(key)
                        out.append(cfg)
    return out


def warm_up(call: Callable[[int], object], sets: int, device: torch.device, calls: int,
            seconds: float = 0.5) -> None:  # fmt: skip
    """Run the group's workload for a moment before timing it, so that the GPU's clocks settle
    at this load (after a matmul warm-up instead, the first config timed ~15% slower than when
    re-timed at the end of its group)."""
    if device.type != "cuda":
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % sets)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize(device)


def time_us(call: Callable[[int], object], sets: int, device: torch.device, calls: int,
            replays: int, graphs: bool) -> tuple[list[float], bool]:  # fmt: skip
    """Microseconds per call of each replay, and whether a CUDA graph was used."""
    if device.type != "cuda":
        out = []
        for r in range(replays):
            t0 = time.perf_counter()
            call(r % sets)
            out.append((time.perf_counter() - t0) * 1e6)
        return out, False

    def events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(calls):
                    call(i % sets)
            graph.replay()  # warm
            times = []
            for _ in range(replays):
                start, end = events()
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / calls)
            return times, True
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing, flagged in the row
            print(f"  CUDA graph failed ({type(exc).__name__}: {exc}); timing eagerly",
                  file=sys.stderr)  # fmt: skip
            torch.cuda.synchronize()
    for i in range(calls):  # eager: launch overhead included
        call(i % sets)
    times = []
    for _ in range(replays):
        start, end = events()
        start.record()
        for i in range(calls):
            call(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return times, False


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, worst row's relative L2 error); inf if anything is not finite."""
    if not torch.isfinite(out).all():
        return float("inf"), float("inf")
    diff = out.float() - ref.float()
    rel = diff.norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
    return diff.abs().max().item(), rel.max().item()
