"""Continuous-batching scheduler with chunked prefill and preemption by recompute (torch-free).

One step's plan, in priority order (a running request's priority is its admission order):
  1. decodes: running requests whose only uncomputed token is their newest output token; each
     runs 1 token and owns `lookahead` extra KV slots past it for speculative drafts, costing
     1 + lookahead tokens of the budget;
  2. running requests still mid-prefill, chunked to the remaining token budget and free pages;
  3. waiting requests, FIFO, while budget, seats and free pages allow (never by preempting).
     With a prefix cache, an admitted request first takes the cached pages of its longest
     cached prefix (shared, read-only) and runs only the rest: cached tokens cost no budget.
When a running request cannot get its pages, the lowest-priority running request (admitted
last) is preempted: its pages are freed and it returns to the FRONT of the waiting queue with
its output tokens kept, to be re-prefilled later. The highest-priority running request always
progresses, so every request that fits the pool alone eventually completes. With decode overlap,
2-3 wait a step after a step whose decodes the runner launched ahead (defer_prefill): the next
step runs them with those decodes in one forward rather than a second one beside the launch.

Prefix caching (kv_cache/prefix_cache.py): after each update a request's full pages whose KV is
complete (the target's, and the draft's as far as the step reports it) are registered: read-only
from then on, they outlive the request until evicted, so recompute restarts from them.
"""

from __future__ import annotations

import time
from collections import deque

from specserve.config import SchedulerConfig
from specserve.engine.plan import QueueFullError, ScheduledRequest, SchedulerOutput, StepPlan
from specserve.engine.request import Request, RequestStatus
from specserve.kv_cache.allocator import PageAllocator, pages_for
from specserve.kv_cache.prefix_cache import PrefixCache


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if page_size < 1 or max_model_len < 2:
            raise ValueError(
                f"need page_size >= 1 and max_model_len >= 2, got {page_size}, {max_model_len}"
            )
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        self.allocator = allocator
        assert prefix_cache is None or prefix_cache.allocator is allocator
        self.prefix_cache = prefix_cache
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order = priority order
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._lookahead = 0
        self.deferred = False  # the last schedule() put prefill off (defer_prefill)
        self.num_deferrals = 0  # cumulative: steps that did
        # KV slots each decoding request keeps past its valid KV after a step: 1 lets the
        # runner launch the next decode step before this one's tokens reach the host, W +
        # lookahead the drafter its next speculative cycle
        self.keep_ahead = 0
        self._finished_ids: list[str] = []  # running requests ended since the last schedule
        self.num_preemptions = 0  # cumulative

    # -- state ---------------------------------------------------------------------------------

    @property
    def lookahead(self) -> int:
        return self._lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        if not 0 <= value < self.config.max_num_batched_tokens:
            raise ValueError(f"lookahead must be in [0, max_num_batched_tokens), got {value}")
        self._lookahead = value

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def decoding_ids(self) -> list[str]:
        """Ids of the running requests whose next step is a decode."""
        return self.decoding()[0]

    def decoding(self) -> tuple[list[str], int]:
        """(ids of the running requests whose next step is a decode, their positions that
        their drafters' state does not cover: tokens made while speculation was off, what a
        catch-up would run the target over before they speculate again), in one pass."""
        ids, behind = [], 0
        for r in self.running:
            if self._is_decode(r):
                ids.append(r.request_id)
                behind += max(0, r.num_computed_tokens - r.draft_covered)
        return ids, behind

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- admission -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; ValueError for one that can never run, QueueFullError when full."""
        ids = request.prompt_token_ids
        n = len(ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but the context length is {self.max_model_len}; shorten it"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            bad = next(t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0)
            raise ValueError(f"prompt token ids must be non-negative integers, got {bad!r}")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_tokens = min(request.params.max_tokens, self.max_model_len - n)
        ahead = max(self._lookahead, self.keep_ahead)
        need = pages_for(n + max_tokens + ahead, self.page_size)
        if need > self.allocator.num_total:
            fit = self.max_new_tokens(n)
            fix = f"lower max_tokens to at most {fit}" if fit >= 1 else "shorten the prompt"
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV "
                f"pages but the cache holds {self.allocator.num_total}; {fix}"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting; retry later")
        request.max_tokens = max_tokens  # prompt + output <= max_model_len: ends with "length"
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens `add` accepts beside a prompt of this length: the context
        and the whole KV pool (less the slots kept ahead for drafts) both bound it; < 1 means
        the prompt itself does not fit."""
        ahead = max(self._lookahead, self.keep_ahead)
        pool = self.allocator.num_total * self.page_size - num_prompt_tokens - ahead
        return min(self.max_model_len - num_prompt_tokens, pool)

    # -- planning ------------------------------------------------------------------------------

    def schedule(self, defer_prefill: bool = False) -> SchedulerOutput:
        """The next step's plan. defer_prefill: decodes only (launched ahead: chunks beside
        them would take a second forward); the prefill next step, launched nothing ahead."""
        plan = StepPlan()
        decodes = [r for r in self.running if self._is_decode(r)]
        prefills = [r for r in self.running if not self._is_decode(r)]
        # never twice in a row (expects_prefill is then True): no request waits two steps
        self.deferred = bool(defer_prefill and decodes and (prefills or self.waiting and len(
            self.running) < self.config.max_num_seqs))
        self.num_deferrals += self.deferred
        for req in decodes + ([] if self.deferred else prefills):
            if req.status == RequestStatus.RUNNING:  # not preempted earlier in this step
                self._schedule_running(req, plan)
        if not plan.preempted and not self.deferred:
            self._admit_waiting(plan)
        entries = list(plan.entries.values())
        ordered = [e for e in entries if e.is_decode] + [e for e in entries if not e.is_decode]
        out = SchedulerOutput(scheduled=ordered, preempted=plan.preempted,
                              finished_ids=self._finished_ids)
        self._finished_ids = []
        return out

    def expects_prefill(self, out: SchedulerOutput) -> bool:
        """Whether the step after `out` will likely carry prefill chunks: a prompt is not
        done after it, or a waiting request could be admitted (a slot free once the rows
        reaching max_tokens end, pages for its first chunk). A wrong guess costs one step."""
        done = {s.request.request_id for s in out.scheduled if s.samples}
        if self.deferred or any(r.num_tokens - r.num_computed_tokens > 1
                                and r.request_id not in done for r in self.running):
            return True
        if not self.waiting:
            return False
        ending = sum(s.samples and s.request.max_tokens - s.request.num_output_tokens <= 1
                     for s in out.scheduled)
        n = pages_for(min(self.waiting[0].num_tokens, self.config.max_num_batched_tokens),
                      self.page_size)
        return (len(self.running) - ending < self.config.max_num_seqs
                and n + len(self.running) <= self.allocator.num_free)

    @staticmethod
    def _is_decode(req: Request) -> bool:
        return req.num_output_tokens > 0 and req.num_tokens - req.num_computed_tokens == 1

    def _schedule_running(self, req: Request, plan: StepPlan) -> None:
        budget = self.config.max_num_batched_tokens - plan.used
        start = req.num_computed_tokens
        if self._is_decode(req):
            la = self._lookahead
            if pages_for(start + 1 + la, self.page_size) > self.allocator.num_total:
                la = 0  # lookahead raised after admission past what the pool holds: plain decode
            own = start + 1 + max(la, self.keep_ahead)  # slots held (keep_ahead costs no budget)
            if pages_for(own, self.page_size) > self.allocator.num_total:
                own = start + 1 + la
            if 1 + la > budget or not self._reserve(req, own, plan):
                return
            self._add_entry(plan, ScheduledRequest(req, 1, start, la, is_decode=True))
            return
        n = min(req.num_tokens - start, budget)
        if n == 0 or not self._reserve(req, start + 1, plan):
            return
        # shrink the chunk to the slots the request can own now rather than preempt for more
        capacity = (len(req.page_ids) + self.allocator.num_free) * self.page_size - start
        n = min(n, capacity)
        self._grow_chunk(req, start + n)
        self._add_entry(plan, ScheduledRequest(req, n, start))

    def _reserve(self, req: Request, num_slots: int, plan: StepPlan) -> bool:
        """Preempt from the back until `req` can own `num_slots` slots; False if it was itself
        the victim."""
        while pages_for(num_slots, self.page_size) - len(req.page_ids) > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        self._grow(req, num_slots)
        return True

    def _grow_chunk(self, req: Request, end: int) -> None:
        """Own a prefill chunk's slots up to `end`, and on a plain step (no lookahead) with
        overlap, past a prompt's end the slot its first decode, launched ahead, writes."""
        self._grow(req, end)
        if end == req.num_tokens and self.keep_ahead and not self._lookahead \
                and pages_for(end + 1, self.page_size) - len(req.page_ids) <= self.allocator.num_free:
            self._grow(req, end + 1)

    def _grow(self, req: Request, num_slots: int) -> None:
        extra = pages_for(num_slots, self.page_size) - len(req.page_ids)
        if extra > 0:
            req.page_ids.extend(self.allocator.allocate(extra))

    def _add_entry(self, plan: StepPlan, entry: ScheduledRequest) -> None:
        assert entry.num_new_tokens >= 1
        plan.entries[entry.request.request_id] = entry
        plan.used += entry.cost
        assert plan.used <= self.config.max_num_batched_tokens

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Recompute-preemption: drop the KV, keep the tokens, requeue at the front."""
        entry = plan.entries.pop(victim.request_id, None)
        if entry is not None:
            plan.used -= entry.cost
        self.running.remove(victim)
        self._release_pages(victim)
        victim.num_computed_tokens = victim.draft_covered = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def _admit_waiting(self, plan: StepPlan) -> None:
        alloc = self.allocator
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            budget = self.config.max_num_batched_tokens - plan.used
            req = self.waiting[0]
            pc = self.prefix_cache
            # prompt log-probs need every prompt position computed: no cache hit
            hit = (pc.match(req.all_token_ids, req.page_keys)
                   if pc is not None and not req.prompt_logprobs_left else [])
            start = len(hit) * self.page_size
            n = min(req.num_tokens - start, budget)
            # keep one free page per running request so their next decode rarely preempts;
            # cached pages nobody holds leave the free count when shared
            new = pages_for(start + n, self.page_size) - len(hit)
            if n == 0 or new + alloc.num_evictable(hit) + len(self.running) > alloc.num_free:
                return
            self.waiting.popleft()
            assert req.num_computed_tokens == 0 and not req.page_ids
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if pc is not None:
                pc.record(req.num_tokens, start)
                alloc.share(hit)
                req.page_ids = list(hit)
                req.num_computed_tokens = start
                req.num_cached_pages = len(hit)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = start
            self._grow_chunk(req, start + n)
            self._add_entry(plan, ScheduledRequest(req, n, start, from_cache=start > 0))

    # -- results -------------------------------------------------------------------------------

    def update(
        self,
        out: SchedulerOutput,
        token_ids: list[list[int]],
        num_computed: list[int] | None = None,
        draft_computed: list[int] | None = None,
    ) -> list[Request]:
        """Apply one step's results; return the requests that finished in it.

        token_ids[i]: tokens emitted for out.scheduled[i] ([] for a mid-prefill chunk).
        num_computed[i]: KV entries that became valid (default num_new_tokens; a verify step
        keeps the root plus the accepted drafts).
        draft_computed[i]: positions whose draft KV is valid after the step, when the pages
        hold a drafter's own KV (the prefix cache registers no page past it).
        """
        assert len(token_ids) == len(out.scheduled)
        assert num_computed is None or len(num_computed) == len(out.scheduled)
        finished: list[Request] = []
        for i, entry in enumerate(out.scheduled):
            req = entry.request
            if req.status != RequestStatus.RUNNING:  # aborted or finished since schedule()
                continue
            assert req.num_computed_tokens == entry.start, (req, entry)
            n = entry.num_new_tokens if num_computed is None else num_computed[i]
            assert 1 <= n <= entry.num_new_tokens + entry.lookahead, (n, entry)
            req.num_computed_tokens += n
            if draft_computed is not None:
                req.draft_covered = draft_computed[i]
            new = token_ids[i]
            assert entry.samples or not new, "a mid-prefill chunk emits no token"
            assert len(new) <= 1 + entry.lookahead, (len(new), entry)
            stop = self._append(req, new)
            if self.prefix_cache is not None:
                self._cache_pages(req, None if draft_computed is None else draft_computed[i])
            if stop is not None:
                self.finish(req, *stop)
                finished.append(req)
                continue
            assert req.num_computed_tokens <= req.num_tokens - 1, req
            # drop pages reserved beyond the valid KV (speculative lookahead), keeping the
            # slots of the decode step that may already be launched
            self._trim(req, req.num_computed_tokens + self.keep_ahead)
        return finished

    def _append(self, req: Request, new: list[int]) -> tuple[str, int | None] | None:
        """Append tokens one by one until a stop condition; (finish reason, stop token) if
        one fired (tokens after it are dropped), else None."""
        params = req.params
        for t in new:
            req.append_token(t)
            if t in req.stop_token_set:
                return "stop", t
            if t in self.eos_token_ids and not params.ignore_eos:
                return "stop", None
            if req.num_output_tokens >= req.max_tokens:
                return "length", None
        return None

    def _cache_pages(self, req: Request, draft_computed: int | None) -> None:
        """Register the request's full pages whose KV is complete (the target's, and the
        draft's when pages are keyed for it: no report means none is known valid)."""
        valid = req.num_computed_tokens
        if self.prefix_cache.key_next_token:
            valid = min(valid, draft_computed or 0)
        req.num_cached_pages = self.prefix_cache.cache_pages(
            req.all_token_ids, req.page_keys, req.page_ids, req.num_cached_pages, valid)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stop condition, stop string or abort) and free its pages."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            # a waiting request holds no worker state (never run, or released when preempted)
            self._finished_ids.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_pages(request)
        self._requests.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.finish_time = time.monotonic()

    def abort(self, request_id: str) -> Request | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.finish(req, "abort")
        return req

    def _trim(self, req: Request, num_slots: int) -> None:
        keep = pages_for(num_slots, self.page_size)
        if len(req.page_ids) > keep:
            self.allocator.free(req.page_ids[keep:])
            del req.page_ids[keep:]

    def _release_pages(self, req: Request) -> None:
        self.allocator.free(req.page_ids)  # cached pages stay findable until evicted
        req.page_ids = []
        req.num_cached_pages = 0
