"""Engine: scheduler + model runner (+ drafter) + detokenization, driven one step at a time.

    step = schedule -> StepInput -> execute (plain, or draft -> verify -> accept)
           -> update -> postprocess

The workers (ModelRunner, SpecWorker) see only the StepInput built from the scheduler's
plan and answer a StepOutput; Request objects stay here.

Not thread-safe: one thread owns an Engine (the server runs it in its own thread).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import random
import time

from specserve.config import EngineConfig
from specserve.engine.cache_key import cache_identity
from specserve.engine.executor import Executor
from specserve.engine.local_worker import ProposerFactory, resolve_model
from specserve.engine.memory import check_fits, drafter_configs
from specserve.engine.outputs import RequestOutput, record_logprobs, record_prompt_logprobs
from specserve.engine.plan import SchedulerOutput
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.engine.spec_policy import AdaptivePolicy, SpecPolicy, StaticPolicy
from specserve.engine.step_builder import build_step_input
from specserve.engine.text import TextState, engine_tokenizer
from specserve.generation_config import load_generation_defaults
from specserve.kv_cache.allocator import PageAllocator
from specserve.kv_cache.prefix_cache import PrefixCache
from specserve.sampling_params import SamplingParams
from specserve.speculative.worker import SpecWorker
from specserve.worker.device import resolve_device, resolve_dtype
from specserve.worker.step_input import StepOutput

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig,
                 proposer: ProposerFactory | None = None) -> None:
        """proposer: builds the drafter from the runner (a class with a `num_kv_layers`
        attribute); default: the one config.spec.algorithm names. With one, the engine
        speculates with the draft shape of config.spec."""
        if not config.model:
            raise ValueError("no model given: pass --model PATH (a directory or cached repo id)")
        self.model_name = config.model
        self.model_path, self.model_config = resolve_model(config)
        self.tokenizer = engine_tokenizer(config, self.model_path)
        self.generation_defaults = load_generation_defaults(config.generation_config,
                                                            self.model_path)
        if self.generation_defaults.unapplied:
            log.warning("%s", self.generation_defaults.describe())
        max_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.max_model_len = min(max_len, self.model_config.max_position_embeddings)
        window = self.model_config.sliding_window
        if window and window < self.max_model_len:
            # attention is full, so results are exact only inside the window: cap the context
            log.warning("model attends over a sliding window of %d tokens; context capped "
                        "there (sliding-window attention is not implemented)", window)
            self.max_model_len = window
        self.config = config.replace(scheduler={"max_model_len": self.max_model_len})
        # the drafters' own models, for the memory check
        drafts = [] if proposer is not None else drafter_configs(config, self.model_config,
                                                                 self.model_path)
        device = resolve_device(config.device)
        check_fits(self.model_name, self.model_config, drafts,
                   resolve_dtype(config.dtype, self.model_config, device), device, config.cache,
                   tp_size=config.parallel.tp_size)
        t0 = time.perf_counter()
        # rank 0 here; with tp_size > 1 the other ranks in worker processes
        self.executor = Executor(self.config, self.model_path, proposer)
        self.runner = self.executor.runner
        self.drafter: SpecWorker | None = self.executor.drafter
        self._drafter = self.drafter  # kept while speculation is switched off
        self.spec_policy: SpecPolicy | None = None
        # speculative: (steps, seconds, decode rows) per mode ("off", "fold"; "+mixed": chunks)
        self.step_seconds: dict[str, tuple[int, float, int]] = {}
        if self.drafter is not None:
            self.spec_policy = (self._adaptive_policy() if config.spec.policy == "adaptive"
                                else StaticPolicy(self.drafter.default_mode))
        self.startup_seconds = time.perf_counter() - t0
        self.allocator = PageAllocator(self.runner.num_pages)
        self.prefix_cache = self._prefix_cache()
        eos = tuple(self.model_config.eos_token_ids)
        if not eos and self.tokenizer is not None:
            eos = tuple(self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.allocator, config.cache.page_size,
                                   self.max_model_len, eos, self.prefix_cache)
        if self.drafter is not None:
            self.scheduler.lookahead = self.drafter.lookahead
        self._set_keep_ahead()
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._text: dict[str, TextState] = {}
        self._requests: dict[str, Request] = {}
        self.closed = self._ahead = False  # _ahead: the last step let the runner launch ahead
        pages, ps = self.runner.num_pages, config.cache.page_size
        log.info("model %s: %d KV pages x %d tokens = %d tokens of context capacity",
                 self.model_name, pages, ps, pages * ps)

    def default_sampling_params(self, **overrides: object) -> SamplingParams:
        """SamplingParams from the generation config's defaults, under `overrides`."""
        return self.generation_defaults.sampling_params(**overrides)

    def _cache_identity(self, drafter: SpecWorker | None) -> tuple[str, bool] | None:
        return cache_identity(self.config, self.runner.dtype, drafter)

    def _prefix_cache(self) -> PrefixCache | None:
        """The prefix cache, on unless switched off or unsafe (a drafter whose state the
        pages may not hold)."""
        wanted = self.config.cache.enable_prefix_caching
        if wanted is False:
            return None
        identity = self._cache_identity(self._drafter)
        if identity is None:
            if wanted:
                raise ValueError("prefix caching needs the drafter to name its KV content "
                                 "(a `prefix_cache_key` attribute); pass "
                                 "--no-enable-prefix-caching or give the proposer one")
            log.info("prefix caching off: the drafter names no prefix_cache_key")
            return None
        return PrefixCache(self.allocator, self.config.cache.page_size, *identity)

    def _adaptive_policy(self) -> AdaptivePolicy:
        """Profile each mode and plain steps at powers of two to max_num_seqs, and chunks,
        within spec.profile_budget seconds (speculative/profile_budget.py)."""
        from specserve.speculative.profile import format_table
        from specserve.speculative.profile_budget import profile_within

        top, control = self.config.scheduler.max_num_seqs, self.executor.control
        sizes = sorted({min(1 << i, top) for i in range(top.bit_length() + 1)})
        prof = profile_within(  # each call on every rank, decided here; rows: profile_within
            self.config.spec.profile_budget, sizes, min(64, top - 1),
            lambda b: control("profile_costs", batch_sizes=b),
            lambda b, c: control("profile_mixed", batch_size=b, chunks=c))
        table = self.spec_cost_table = prof.table
        mixed = self.spec_mixed_table = prof.mixed  # the policy's priors
        self.spec_cost_seconds = prof.seconds
        log.info("speculation cost table (ms per step; %s):\n%s\nextra ms of a prefill chunk "
                 "(columns: its tokens):\n%s", prof.describe(), format_table(table),
                 format_table(mixed) if mixed else "-")
        return self.new_adaptive_policy()

    def new_adaptive_policy(self) -> AdaptivePolicy:
        """A fresh adaptive policy over the start-up cost table: the drafter's modes, each
        row's share of the step's token budget, the scheduler's budget and row limit."""
        modes = {name: (m.method, m.shape.topk, m.shape.num_steps)
                 for name, m in self.drafter.modes.items()}
        widths = {name: 1 + self.drafter.lookahead_of(name) for name in modes}
        sched = self.config.scheduler
        return AdaptivePolicy(modes, self.spec_cost_table, widths=widths,
                              token_budget=sched.max_num_batched_tokens,
                              max_rows=sched.max_num_seqs, mixed_priors=self.spec_mixed_table)

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation off or on between runs (no request in flight): a plain step
        runs no draft forward, so the draft KV would go stale under running requests."""
        if self.has_unfinished():
            raise ValueError("speculation can only be switched while no request is in flight")
        if enabled and self._drafter is None:
            raise ValueError("this engine was built without a draft model")
        self.executor.control("set_speculation", enabled=enabled)
        self.drafter = self.executor.drafter
        if self.prefix_cache is not None:  # the pages hold draft KV from now on, or not
            self.prefix_cache.rekey(*self._cache_identity(self.drafter))
        self.scheduler.lookahead = self._drafter.lookahead if enabled else 0
        self._set_keep_ahead()

    def _set_keep_ahead(self) -> None:
        """With overlap the next decode step (ModelRunner.execute) or speculative cycle
        (CycleRunner.speculate) is launched early: the slots it may write stay owned."""
        if self.drafter is not None:
            self.scheduler.keep_ahead = self.drafter.keep_ahead
        else:
            self.scheduler.keep_ahead = 1 if self.runner.overlap else 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None) -> str:
        if self.closed:
            raise RuntimeError("this engine was closed; create a new one")
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"SamplingParams.n = {params.n}: an engine request is one sequence; "
                             "LLM.generate and the server run one per choice "
                             "(params.for_choice(i))")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._prompt_ids(prompt)
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cap:
                raise ValueError(f"{name} must be at most {cap} (--max-logprobs), got {k}")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be < the vocab size {vocab}, got "
                             f"{bad[0]}")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(request_id, ids, params, seed=seed)
        self.scheduler.add(req)  # validates lengths; may raise ValueError / QueueFullError
        self._requests[request_id] = req
        self._text[request_id] = TextState(self.tokenizer, req)
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return list(prompt)

    def abort_request(self, request_id: str) -> None:
        # the workers drop the request's state on the next step (StepInput.finished_ids)
        self.scheduler.abort(request_id)
        if self.spec_policy is not None:
            self.spec_policy.forget(request_id)
        self._requests.pop(request_id, None)
        if not self.scheduler.has_unfinished:
            self._release(self.scheduler.schedule())
        self._text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        mode = None
        policy = self.spec_policy
        if self.drafter is not None:  # decided before scheduling: off reserves no lookahead
            sched = self.scheduler
            # what the policy reads of the running requests: ids and positions behind
            decoding, behind = sched.decoding() if policy.needs_batch else ([], 0)
            mode = policy.choose(decoding, sched.num_running + sched.num_waiting - len(decoding),
                                 behind if self.drafter.stateful else 0)
            if isinstance(mode, bool):  # True: the configured mode, False: off
                mode = self.drafter.default_mode if mode else None
            self.scheduler.lookahead = self.drafter.lookahead_of(mode)
        # the plain step launched ahead last time holds decodes: prefill joins the next one
        out = self.scheduler.schedule(defer_prefill=self._ahead and mode is None)
        self._ahead = mode is None and self.runner.overlap and bool(out.scheduled) \
            and not self.scheduler.expects_prefill(out)
        if not out.scheduled:
            self._release(out)
            return []
        decodes = [s.request.request_id for s in out.scheduled if s.is_decode]
        mixed = len(decodes) < len(out.scheduled)
        # a cycle launched ahead for these decodes runs anyway: a fold would discard its work
        held = mode is not None and mode in self.drafter.modes \
            and self.drafter.modes[mode].cycles.holds_requests(decodes)
        fold = bool(mode is not None and mixed and decodes and not held
                    and policy.fold(mode, decodes))
        step = build_step_input(out, mode, eos_token_ids=self.scheduler.eos_token_ids,
                                cached_prefixes=self.drafter is not None
                                and self.drafter.host_drafts, fold=fold,
                                launch_ahead=self._ahead)
        result = self.executor.execute(step)
        accepted, chain_runs = self._record_spec(out, result)
        before = [s.request.num_output_tokens for s in out.scheduled]
        self.scheduler.update(out, result.token_ids, result.num_computed,
                              result.draft_computed)
        if result.logprobs is not None:
            record_logprobs(out, before, result.logprobs)
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(out, result.prompt_logprobs)
        outputs = self._postprocess(out)
        if policy is not None:
            seconds = time.perf_counter() - t0
            chunk_tokens = sum(s.num_new_tokens for s in out.scheduled if not s.is_decode)
            policy.observe(mode, accepted, seconds, len(decodes), mixed=mixed, folded=fold,
                           chunk_tokens=chunk_tokens, chain_runs=chain_runs)
            # wall time per kind of step: what the policy's model must explain
            kind = ("fold" if fold else mode or "off") + ("+mixed" if mixed else "")
            n, total, rows = self.step_seconds.get(kind, (0, 0.0, 0))
            self.step_seconds[kind] = (n + 1, total + seconds, rows + len(decodes))
        if not self.scheduler.has_unfinished:  # idle: the workers drop the last requests' state
            self._release(self.scheduler.schedule())
        return outputs

    def _release(self, out: SchedulerOutput) -> None:
        """An empty plan still carries release lists: a step of no rows delivers them."""
        assert not out.scheduled
        if out.finished_ids or out.preempted:
            self.executor.execute(build_step_input(out))

    @staticmethod
    def _record_spec(out: SchedulerOutput, result: StepOutput
                     ) -> tuple[dict[str, int], dict[str, int] | None]:
        """Per-request speculation statistics of the rows that ran a verify cycle: {request
        id: drafts accepted} and, after a tree's cycle, its chain runs (StepOutput)."""
        accepted: dict[str, int] = {}
        if result.num_drafted is None:
            return accepted, None
        for s, drafted, emitted in zip(out.scheduled, result.num_drafted, result.token_ids):
            if drafted:
                s.request.record_spec_cycle(drafted, len(emitted) - 1)
                accepted[s.request.request_id] = len(emitted) - 1
        runs = result.chain_runs
        return accepted, None if runs is None else {
            s.request.request_id: r for s, r in zip(out.scheduled, runs) if r >= 0}

    def _postprocess(self, out: SchedulerOutput) -> list[RequestOutput]:
        results = []
        for s in out.scheduled:
            req = s.request
            state = self._text.get(req.request_id)
            if state is None:
                continue
            new_ids = req.output_token_ids[state.emitted:]
            if not new_ids and not req.is_finished:
                continue
            first = state.emitted == 0
            state.emitted = len(req.output_token_ids)
            text, stopped = state.new_text(req, new_ids)
            if stopped and not req.is_finished:
                self.scheduler.finish(req, "stop", stop_reason=state.stops.matched)
            lps = (None if req.output_logprobs is None
                   else req.output_logprobs[len(req.output_logprobs) - len(new_ids):])
            results.append(RequestOutput(
                req.request_id, new_ids, text, req.is_finished, req.finish_reason,
                req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens, lps,
                req.prompt_logprobs if first else None))
            if req.is_finished:
                if self.spec_policy is not None:
                    self.spec_policy.forget(
                        req.request_id, req.num_prompt_tokens - req.num_cached_tokens,
                        req.num_output_tokens)
                del self._text[req.request_id]
                del self._requests[req.request_id]
        return results

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        total = self.allocator.num_total
        free = self.allocator.num_free
        stats = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefill_deferrals": self.scheduler.num_deferrals,
            "kv_free_pages": free,
            "kv_total_pages": total,
            "kv_usage": 1.0 - free / total,
            "kv_token_capacity": total * self.config.cache.page_size,
            "startup_seconds": self.startup_seconds,
            "cuda_graphs": getattr(self.runner, "num_graphs", 0),
        }
        if self.prefix_cache is not None:
            pcs = self.prefix_cache.stats
            stats.update(prefix_cache_queries=pcs.queries, prefix_cache_hits=pcs.hits,
                         kv_cached_pages=self.allocator.num_cached)
        if self.drafter is not None:
            stats["cuda_graphs"] += self.drafter.num_graphs
            stats.update(dataclasses.asdict(self.drafter.counters))  # mode_steps: per mode
            stats["step_seconds"] = dict(self.step_seconds)
            if isinstance(self.spec_policy, AdaptivePolicy):
                # expected tokens/s per mode for the last decode batch (its acceptance view)
                stats["spec_mode_scores"] = dict(self.spec_policy.last_scores)
        return stats

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def close(self) -> None:
        """Abort every request, stop the TP workers and release the model, KV pool and CUDA
        graphs now, so the next engine in this process sizes its KV cache from the memory
        they held. Idempotent; the engine accepts no request afterwards."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self._requests):  # the workers go too: no release step
            self.scheduler.abort(request_id)
        self._requests.clear()
        self._text.clear()
        device = self.runner.device
        self.executor.close()
        self.runner = self.drafter = self._drafter = None
        gc.collect()  # graphs and modules can sit in reference cycles
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
