"""What a step hands back per request (RequestOutput), and the log-prob bookkeeping of a
step's results on its requests."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.plan import SchedulerOutput


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str  # UTF-8-safe delta; stop strings already applied
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # per new token, when the request asked (SamplingParams.logprobs): [log-prob, [top ids],
    # [top log-probs]] of the target's raw distribution
    new_logprobs: list[list] | None = None
    # on a request's first output, when it asked (SamplingParams.prompt_logprobs): per prompt
    # position its entry (None for the first token)
    prompt_logprobs: list[list | None] | None = None


def record_logprobs(out: SchedulerOutput, before: list[int], logprobs: list) -> None:
    """Keep the entries of the tokens the request took (a stop drops the rest)."""
    for s, n0, entries in zip(out.scheduled, before, logprobs):
        req = s.request
        if entries is not None and req.output_logprobs is not None:
            req.output_logprobs.extend(entries[: req.num_output_tokens - n0])


def record_prompt_logprobs(out: SchedulerOutput, per_row: list) -> None:
    """Entries of prompt positions start + 1 ...; a recomputed chunk fills nothing twice."""
    for s, entries in zip(out.scheduled, per_row):
        req = s.request
        if entries is None or req.prompt_logprobs is None:
            continue
        for p, entry in enumerate(entries, start=s.start + 1):
            if req.prompt_logprobs[p] is None:
                req.prompt_logprobs[p] = entry
                req.prompt_logprobs_left -= 1
