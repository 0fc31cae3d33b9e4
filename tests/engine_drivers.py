"""Drivers for engine and model tests: a paged-KV session over a bare model (the engine's
attention metadata without the engine), preemption recording, and a random arrival workload."""

from __future__ import annotations

import random

import torch


class PagedSession:
    """Drives a model over a paged KV cache with the torch reference backend, the way the
    engine does: each step runs some new tokens for some requests; pages come from a shuffled
    free list so page tables are not contiguous."""

    def __init__(
        self, model: torch.nn.Module, num_pages: int = 64, page_size: int = 4, seed: int = 0
    ) -> None:
        from specserve.kv_cache.pool import KVPool
        from specserve.layers.attention import attention_modules
        from specserve.layers.backends.torch_ref import TorchRefBackend

        attns = attention_modules(model)  # any attention kind: the pool follows their specs
        param = next(model.parameters())
        self.device = param.device
        specs = [m.kv_spec for m in attns]
        self.pool = KVPool(specs, num_pages, page_size, param.dtype, self.device)
        self.pool.bind(attns)
        self.model = model
        self.page_size = page_size
        self.backend = TorchRefBackend()
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.seq_lens: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}

    def step(self, new_tokens: dict[int, list[int]], logits: bool = True,
             custom_mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run new_tokens[req] for each request; returns per request its logits [n, vocab]
        (or its final hidden states [n, H] with logits=False). custom_mask [bs, max_q, W] and
        positions [T] replace the causal mask and the linear positions (tree verify)."""
        from specserve.layers.attention_metadata import ForwardContext, set_forward_context
        from specserve.worker.forward_batch import build_attention_metadata, build_positions

        reqs = list(new_tokens)
        q_lens = [len(new_tokens[r]) for r in reqs]
        for r, q_len in zip(reqs, q_lens):
            total = self.seq_lens.get(r, 0) + q_len
            pages = self.pages.setdefault(r, [])
            while len(pages) * self.page_size < total:
                pages.append(self.free.pop())
            self.seq_lens[r] = total
        seq_lens = [self.seq_lens[r] for r in reqs]
        md = build_attention_metadata(
            q_lens, seq_lens, [self.pages[r] for r in reqs], self.page_size, self.device,
            custom_mask,
        )
        if positions is None:
            positions = build_positions(q_lens, seq_lens, self.device)
        ids = torch.tensor([t for r in reqs for t in new_tokens[r]], device=self.device)
        set_forward_context(ForwardContext(md, self.backend))
        try:
            with torch.no_grad():
                out = self.model(ids, positions.to(self.device))
                if logits:
                    out = self.model.compute_logits(out)
        finally:
            set_forward_context(None)
        return list(out.split(q_lens))


def record_preemptions(scheduler) -> list:
    """Wrap scheduler.schedule so every preempted request is appended to the returned list."""
    preempted: list = []
    schedule = scheduler.schedule

    def spy(**kw):
        out = schedule(**kw)
        preempted.extend(out.preempted)
        return out

    scheduler.schedule = spy
    return preempted


def random_workload(engine, seed: int, max_tokens: int, arrival_p: float,
                    arrivals_until: int = 120, max_steps: int = 600,
                    params_out: dict | None = None) -> dict:
    """A scripted random workload: greedy and sampled requests (seeded, with stop tokens)
    arrive over the first `arrivals_until` steps, some are aborted; stepped until all end.
    Returns {request id: (tokens, finish reason)}; params_out gets each one's params."""
    from specserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for step in range(max_steps):
        if step < arrivals_until and rng.random() < arrival_p:
            rid = f"r{step}"
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
            greedy = rng.random() < 0.5
            params = SamplingParams(
                temperature=0.0 if greedy else 0.9, top_k=0 if greedy else 40,
                seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, max_tokens),
                stop_token_ids=[rng.randrange(3, 500) for _ in range(3)], ignore_eos=True)
            engine.add_request(rid, prompt, params)
            outputs[rid] = []
            if params_out is not None:
                params_out[rid] = params
        if rng.random() < 0.03 and outputs:
            victim = rng.choice(sorted(outputs))
            if victim not in finished and engine.get_request(victim) is not None:
                engine.abort_request(victim)
                finished[victim] = "abort"
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if step >= arrivals_until and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return {k: (v, finished.get(k)) for k, v in outputs.items()}
