"""One generation request and its bookkeeping (torch-free).

Token layout of a request (P prompt tokens, O output tokens):

    all_token_ids  p0 p1 ... p[P-1] o0 o1 ... o[O-1]      num_tokens = P + O
    KV computed    [0, num_computed_tokens)                 page_ids hold these slots
    read-only      page_ids[:num_cached_pages]              shared with the prefix cache

While running, `num_computed_tokens <= num_tokens - 1`: the newest token's KV is produced by
the next forward, which runs it and samples the token after it.
"""

from __future__ import annotations

import enum
import time

from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        seed: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params if params is not None else SamplingParams()
        # the request's own seed wins; otherwise the engine's (given here at construction)
        self.seed: int = self.params.seed if self.params.seed is not None else seed
        # looked up for every emitted token: a set, not the params' list
        self.stop_token_set: frozenset[int] = frozenset(self.params.stop_token_ids)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []  # append through append_token only
        # per output token when params.logprobs is set: [log-prob, [top ids], [top log-probs]]
        self.output_logprobs: list[list] | None = [] if self.params.logprobs is not None else None
        # params.prompt_logprobs: entry p for prompt position p (None at 0 and until computed)
        self.prompt_logprobs: list[list | None] | None = None
        self.prompt_logprobs_left = 0  # prompt positions still without an entry
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprobs_left = len(self.prompt_token_ids) - 1
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.draft_covered = 0  # positions the drafters' state covers (worker's report)
        self.page_ids: list[int] = []  # the block table
        # prefix caching: the leading pages that are cached (shared, never written again),
        # the keys of the sequence's full pages as far as computed (kv_cache/prefix_cache.py),
        # and the prompt tokens the first admission found cached (usage reports them)
        self.num_cached_pages = 0
        self.page_keys: list[bytes] = []
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # stop token id or stop string that fired
        # monotonic clock (time.monotonic), for latency metrics
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        # effective max_tokens: params.max_tokens clamped to the context (set by the scheduler)
        self.max_tokens: int = self.params.max_tokens
        # speculation statistics
        self.spec_cycles = 0
        self.spec_draft_tokens = 0  # draft tokens proposed
        self.spec_accepted_tokens = 0  # draft tokens accepted (the bonus token excluded)
        self.spec_accepted_per_pos: list[int] = []  # [i]: cycles whose depth-(i+1) draft held

    # -- token views ---------------------------------------------------------------------------

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output as one list (shared, not a copy: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self._all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    # -- speculation statistics ----------------------------------------------------------------

    def record_spec_cycle(self, num_draft: int, num_accepted: int) -> None:
        """One verify cycle: `num_draft` draft tokens proposed, the first `num_accepted` held."""
        assert 0 <= num_accepted <= num_draft, (num_accepted, num_draft)
        self.spec_cycles += 1
        self.spec_draft_tokens += num_draft
        self.spec_accepted_tokens += num_accepted
        if len(self.spec_accepted_per_pos) < num_draft:
            self.spec_accepted_per_pos.extend([0] * (num_draft - len(self.spec_accepted_per_pos)))
        for depth in range(num_accepted):
            self.spec_accepted_per_pos[depth] += 1

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was drafted)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"pages={len(self.page_ids)})"
        )
