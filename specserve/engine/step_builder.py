"""SchedulerOutput -> StepInput: the scheduler's plan as the plain arrays every rank runs."""

from __future__ import annotations

import numpy as np

from specserve.engine.scheduler import SchedulerOutput
from specserve.worker.step_input import StepInput


def build_step_input(out: SchedulerOutput, spec_mode: str | None = None,
                     speculate: bool | np.ndarray = True) -> StepInput:
    """One row per scheduled entry, in out.scheduled order (a StepOutput's rows align).
    spec_mode: the draft mode of this step (None: plain); speculate: which rows may use it
    (one flag for all, or one per row)."""
    if spec_mode is None:
        speculate = False
    rows = out.scheduled
    token_ids: list[int] = []
    page_ids: list[int] = []
    next_ids: list[int] = []
    for s in rows:
        req = s.request
        end = s.start + s.num_new_tokens
        token_ids.extend(req.all_token_ids[s.start : end])
        page_ids.extend(req.page_ids)
        next_ids.append(-1 if s.samples else req.all_token_ids[end])
    reqs = [s.request for s in rows]
    params = [r.params for r in reqs]
    return StepInput(
        request_ids=[r.request_id for r in reqs],
        starts=np.fromiter((s.start for s in rows), np.int64, len(rows)),
        num_new_tokens=np.fromiter((s.num_new_tokens for s in rows), np.int64, len(rows)),
        next_token_ids=np.array(next_ids, dtype=np.int64),
        samples=np.fromiter((s.samples for s in rows), np.bool_, len(rows)),
        is_decode=np.fromiter((s.is_decode for s in rows), np.bool_, len(rows)),
        speculate=np.broadcast_to(np.asarray(speculate, dtype=np.bool_), (len(rows),)),
        lookahead=np.fromiter((s.lookahead for s in rows), np.int64, len(rows)),
        from_cache=np.fromiter((s.from_cache for s in rows), np.bool_, len(rows)),
        num_tokens=np.fromiter((r.num_tokens for r in reqs), np.int64, len(rows)),
        tokens_left=np.fromiter(
            (r.max_tokens - r.num_output_tokens for r in reqs), np.int64, len(rows)
        ),
        page_counts=np.fromiter((len(r.page_ids) for r in reqs), np.int64, len(rows)),
        # greedy judged once (SamplingParams.greedy, in float32): such rows carry 0
        temperature=np.array(
            [0.0 if p.greedy else p.temperature for p in params], dtype=np.float32
        ),
        top_k=np.array([p.top_k for p in params], dtype=np.int64),
        top_p=np.array([p.top_p for p in params], dtype=np.float32),
        min_p=np.array([p.min_p for p in params], dtype=np.float32),
        seed=np.fromiter((r.seed for r in reqs), np.int64, len(rows)),
        token_ids=np.array(token_ids, dtype=np.int64),
        page_ids=np.array(page_ids, dtype=np.int32),
        finished_ids=list(out.finished_ids),
        preempted_ids=[r.request_id for r in out.preempted],
        spec_mode=spec_mode or "",
    )
