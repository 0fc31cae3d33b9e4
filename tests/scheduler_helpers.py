"""The scheduler tests' builders: a small scheduler, a request, a step (schedule + update)."""

from __future__ import annotations

from specserve.config import SchedulerConfig
from specserve.engine.plan import SchedulerOutput
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache.allocator import PageAllocator
from specserve.sampling_params import SamplingParams

EOS = 0


def make(
    budget: int = 64,
    seqs: int = 8,
    pages: int = 64,
    page_size: int = 4,
    max_model_len: int = 128,
    max_waiting: int = 100,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_waiting=max_waiting)
    return Scheduler(cfg, PageAllocator(pages), page_size, max_model_len, eos_token_ids=(EOS,))


def req(rid: str, n: int, max_tokens: int = 16, **kw: object) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def step(s: Scheduler, tokens: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """schedule + update, emitting token 7 (or the given list) for every sampling entry."""
    out = s.schedule()
    tokens = tokens or {}
    emitted = [tokens.get(e.request.request_id, [7]) if e.samples else [] for e in out.scheduled]
    s.update(out, emitted)
    return out
