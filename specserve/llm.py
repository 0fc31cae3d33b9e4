"""Offline API: `LLM(model, ...).generate(prompts, SamplingParams(...))`, and `.chat(messages)`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from specserve import spec_config
from specserve.config import EngineConfig, SpecConfig, engine_config
from specserve.engine.engine import Engine
from specserve.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # speculation statistics of this request (zeros without speculation)
    spec_cycles: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # SamplingParams(logprobs=k): per output token [log-prob, [top ids], [top log-probs]] of
    # the target's raw distribution (k alternatives, most likely first); else None
    logprobs: list[list] | None = None
    # SamplingParams(prompt_logprobs=k): per prompt position its entry (None for the first)
    prompt_logprobs: list[list | None] | None = None
    # SamplingParams(n > 1): every choice's output, this one (choice 0) first
    choices: list[GenerationOutput] | None = None

    @property
    def outputs(self) -> list[GenerationOutput]:
        """The prompt's choices (vLLM's RequestOutput.outputs): [self] unless n > 1."""
        return self.choices or [self]

    @property
    def accept_length(self) -> float:
        """Tokens emitted per draft-verify cycle, bonus included."""
        return (self.spec_accepted_tokens + self.spec_cycles) / max(self.spec_cycles, 1)


class LLM:
    """The offline engine, shaped like vLLM's:

        LLM("/path/to/model", speculative_config={"method": "eagle3", "model": "/path/to/head",
            "num_speculative_tokens": 3}, tensor_parallel_size=1, dtype="bfloat16", seed=0)

    The LLM owns its engine: `close()`, the end of a `with` block, or the LLM being garbage
    collected releases the model, KV pool and graphs, so keep the LLM (not only `.engine`)
    alive while you use the engine. Keywords are EngineConfig fields, nested config fields by name or flag spelling
    (`page_size=32`, `max_num_seqs=8`, `gpu_memory_utilization=0.8`), or nested configs
    (`cache=CacheConfig(...)` or a dict). `speculative_config` takes vLLM's keys (method,
    model, num_speculative_tokens) and the tree fields (topk, num_draft_tokens); see
    specserve/spec_config.py. `proposer` brings a drafter of one's own (see Engine;
    speculative/proposer.py), drafting with the speculative config's shape."""

    def __init__(self, model: str | EngineConfig,
                 speculative_config: dict[str, Any] | str | SpecConfig | None = None,
                 proposer: Callable[..., Any] | None = None, **kwargs: Any) -> None:
        base = model if isinstance(model, EngineConfig) else EngineConfig(model=model)
        if speculative_config is not None:
            kwargs["spec"] = spec_config.speculative_config(speculative_config)
        self.engine = Engine(engine_config(base, **kwargs), proposer=proposer)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's TP workers and release its model, KV pool and CUDA graphs now
        (also on `del` and at the end of a `with` block); it generates nothing afterwards."""
        engine = getattr(self, "engine", None)  # None if __init__ failed before it was set
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone; nothing to release
            return

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() under the model's generation config (--generation-config)."""
        return self.engine.default_sampling_params()

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[GenerationOutput]:
        """Generate replies to one conversation or several, through the chat template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(params, list):
            params_list = params
        else:  # no params: the model's generation-config defaults (vLLM's rule)
            params_list = [params or self.get_default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        limit = engine.config.scheduler.max_waiting
        # one engine request per choice (SamplingParams.n): (prompt index, choice params)
        pending = deque((p, sp.for_choice(i)) for p, sp in enumerate(params_list)
                        for i in range(sp.n))
        first: list[str] = []  # choice 0's request id per prompt
        members: dict[str, list[str]] = {}  # choice 0's id -> every choice's id
        ids: list[str] = []
        texts: dict[str, list[str]] = {}
        reqs: dict = {}
        results: dict[str, GenerationOutput] = {}
        bar = tqdm(total=len(pending), desc="generate", disable=not use_tqdm)
        while pending or len(results) < len(ids):
            # feed the bounded waiting queue as it drains (any number of prompts)
            while pending and engine.scheduler.num_waiting < limit:
                index, sp = pending.popleft()
                rid = engine.add_request(None, prompts[index], sp)
                if len(first) == index:
                    first.append(rid)
                members.setdefault(first[index], []).append(rid)
                ids.append(rid)
                texts[rid] = []
                reqs[rid] = engine.get_request(rid)
            for out in engine.step():
                texts[out.request_id].append(out.new_text)
                if out.finished:
                    req = reqs[out.request_id]
                    results[out.request_id] = GenerationOutput(
                        out.request_id, req.prompt_token_ids, list(req.output_token_ids),
                        "".join(texts[out.request_id]), out.finish_reason, req.spec_cycles,
                        req.spec_accepted_tokens, list(req.spec_accepted_per_pos),
                        req.num_cached_tokens, req.output_logprobs, req.prompt_logprobs)
                    bar.update(1)
        bar.close()
        outs = []
        for rid in first:
            out = results[rid]
            if len(members[rid]) > 1:
                out.choices = [results[c] for c in members[rid]]
            outs.append(out)
        return outs
