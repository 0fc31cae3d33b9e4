"""SchedulerOutput -> StepInput: the scheduler's plan as the plain arrays every rank runs."""

from __future__ import annotations

import numpy as np

from specserve.engine.plan import SchedulerOutput
from specserve.worker.step_input import StepInput


def build_step_input(out: SchedulerOutput, spec_mode: str | None = None,
                     speculate: bool | np.ndarray = True,
                     eos_token_ids: tuple[int, ...] = (),
                     cached_prefixes: bool = False, fold: bool = False,
                     launch_ahead: bool = True) -> StepInput:
    """One row per scheduled entry, in out.scheduled order (a StepOutput's rows align).
    spec_mode: the draft mode of this step (None: plain); speculate: which rows may use it
    (one flag for all, or one per row); eos_token_ids: what min_tokens masks besides the
    request's stop_token_ids; cached_prefixes: a row admitted on a cached prefix carries the
    prefix's tokens (for a drafter that reads whole histories on the host); fold: the
    decodes run one token each in the prefill chunks' forward (StepInput.fold);
    launch_ahead: StepInput.launch_ahead."""
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
    extra = {}
    if any(p.processed or p.logprobs is not None or r.prompt_logprobs_left
           for p, r in zip(params, reqs)):
        extra = _processing_rows(rows, eos_token_ids)
    if cached_prefixes and any(s.from_cache for s in rows):
        prefixes = [s.request.all_token_ids[: s.start] if s.from_cache else [] for s in rows]
        extra["prefix_counts"] = np.array([len(p) for p in prefixes], dtype=np.int64)
        extra["prefix_ids"] = np.array([t for p in prefixes for t in p], dtype=np.int64)
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
        fold=fold and spec_mode is not None,
        launch_ahead=launch_ahead,
        **extra,
    )


def _processing_rows(rows: list, eos_token_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The logits-processing arrays (worker/step_input.py), for batches where a row uses
    them. Token lists travel only for rows that sample this step and are penalized."""
    n = len(rows)
    f32 = {k: np.zeros(n, np.float32) for k in ("presence_penalty", "frequency_penalty")}
    rep = np.ones(n, np.float32)
    ints = {k: np.zeros(n, np.int64) for k in ("min_left", "history_counts", "history_outputs",
                                                "bias_counts", "suppress_counts")}
    logprobs = np.full(n, -1, np.int64)
    prompt_logprobs = np.full(n, -1, np.int64)
    num_prompt = np.zeros(n, np.int64)
    history: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    suppress: list[int] = []
    for i, s in enumerate(rows):
        req, p = s.request, s.request.params
        if p.logprobs is not None:
            logprobs[i] = p.logprobs
        if req.prompt_logprobs_left and s.start < req.num_prompt_tokens - 1:
            prompt_logprobs[i] = p.prompt_logprobs
            num_prompt[i] = req.num_prompt_tokens
        if not (p.processed and s.samples):
            continue
        num_out = req.num_tokens - req.num_prompt_tokens  # outputs before the token decided
        f32["presence_penalty"][i] = p.presence_penalty
        f32["frequency_penalty"][i] = p.frequency_penalty
        rep[i] = p.repetition_penalty
        if p.penalized:
            tokens = req.all_token_ids if p.repetition_penalty != 1.0 else req.output_token_ids
            history.extend(tokens)
            ints["history_counts"][i] = len(tokens)
            ints["history_outputs"][i] = num_out
        if p.logit_bias:
            bias_ids.extend(p.logit_bias)
            bias_values.extend(p.logit_bias.values())
            ints["bias_counts"][i] = len(p.logit_bias)
        if num_out < p.min_tokens:
            ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))
            suppress.extend(ids)
            ints["min_left"][i] = p.min_tokens - num_out
            ints["suppress_counts"][i] = len(ids)
    return {**f32, "repetition_penalty": rep, **ints, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs, "num_prompt": num_prompt,
            "history_ids": np.array(history, np.int64), "bias_ids": np.array(bias_ids, np.int64),
            "bias_values": np.array(bias_values, np.float32),
            "suppress_ids": np.array(suppress, np.int64)}
