"""ModelRunner: owns the target model, its KV pool and attention backend; runs one step.

`execute(StepInput) -> StepOutput` is what a rank runs for a plain step: the runner turns the
step's arrays into device tensors (input ids, positions, attention metadata), runs the model
under a forward context, and samples. It reads no Request object: requests are known by id.
The only device-to-host copy of a plain step is the final `tolist()` of the sampled ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.config import EngineConfig, ModelConfig
from specserve.distributed.comm import init_comm
from specserve.distributed.parallel_state import min_over_ranks
from specserve.kernels.dispatch import set_exact
from specserve.kv_cache.pool import KVPool, plan_num_pages
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention import attention_modules
from specserve.layers.attention_metadata import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)
from specserve.layers.rotary import ensure_rope_capacity
from specserve.layers.sampler import Sampler, SamplingTensors, graph_sampling_inputs, host_fields
from specserve.models.loader import build_model, load_model
from specserve.models.presets import random_init
from specserve.worker.cuda_graph import BatchGraphs, comm_message_rows
from specserve.worker.device import resolve_device, resolve_dtype, select_backend
from specserve.worker.eager_warm import warm_target, warms
from specserve.worker.forward_batch import (
    BatchInputs,
    build_attention_metadata,
    prepare_batch,
    to_device,
)
from specserve.worker.logits import logprob_lists, prompt_logprobs, sample_logits
from specserve.worker.step_input import StepInput, StepOutput
from specserve.worker.token_graphs import build_token_graphs, forward_step

log = logging.getLogger(__name__)

DECODE_MODES = ("greedy", "sample")


@dataclass
class LaunchedStep:
    """A decode step launched before the host read the step that feeds it (see execute)."""

    request_ids: list[str]
    starts: list[int]  # the position each row decodes (its input token's position)
    tokens: torch.Tensor  # [rows] sampled tokens on the device (a graph output buffer)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str | None,
                 extra_kv_specs: Sequence[KVCacheSpec] = (), reserve_bytes: int = 0) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        if self.device.type == "cpu":
            threads = config.cpu_threads or (1 if model_config.hidden_size <= 1024 else 0)
            if threads:
                torch.set_num_threads(threads)
        self.page_size = config.cache.page_size
        # before any launch: exact mode fixes kernel plans (kernels/dispatch.py)
        set_exact(config.exact, max_positions=config.scheduler.max_model_len + 256, max_splits=32,
                  attention=config.exact_attention)
        init_comm(config.comm, hidden=model_config.hidden_size, dtype=self.dtype,
                  device=self.device, rows=comm_message_rows(config))
        if config.load_format == "dummy" or model_path is None:
            self.model: nn.Module = build_model(model_config, self.dtype, self.device)
            random_init(self.model, config.seed)
        else:
            self.model = load_model(model_config, model_path, self.dtype, self.device)
        self.backend = select_backend(self.device)
        self.sampler = Sampler()
        self.attn_layers = attention_modules(self.model)
        self.extra_kv_specs = list(extra_kv_specs)  # layers past the target's (draft heads)
        self.reserve_bytes = reserve_bytes  # for weights built after the pool (drafters')
        self.kv_pool = self._allocate_kv_pool()
        self.kv_pool.bind(self.attn_layers)
        # RoPE tables must cover every position before graphs are captured (replays run no
        # Python); speculation writes up to a few dozen positions past the context
        self.max_positions = config.scheduler.max_model_len + 256
        ensure_rope_capacity(self.model, self.max_positions)
        self.decode_graphs = self._capture_decode_graphs()
        self.token_graphs = build_token_graphs(self)  # steps with prefill chunks
        if warms(self):  # eager forwards' kernels compiled now, not inside a step
            warm_target(self)
        overlap = config.decode_overlap
        self.overlap = overlap == "on" or (overlap == "auto" and self.decode_graphs is not None)
        self._launched: LaunchedStep | None = None
        self.rows_launched_ahead = 0  # decode rows whose step ran before the host asked

    def _capture_decode_graphs(self) -> dict[str, BatchGraphs] | None:
        """Decode graphs per batch bucket, forward + LM head + sampling, for two modes:
        all-greedy batches (argmax) and any other mix (the general sampling path)."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return None
        if getattr(self.backend, "name", "") != "triton":
            log.warning("CUDA graphs off: the %s attention backend is not graph-safe",
                        getattr(self.backend, "name", "?"))
            return None
        self.graph_max_bs = min(cfg.cuda_graph_max_bs, cfg.scheduler.max_num_seqs)
        self.graph_pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for mode in DECODE_MODES:
            inputs, pads = self.static_inputs(self.graph_max_bs, 1)
            st_inputs, st_pads = graph_sampling_inputs(
                self.graph_max_bs, self.model_config.vocab_size, self.device)
            graphs[mode] = BatchGraphs(self._decode_fn(mode), {**inputs, **st_inputs},
                                       {**pads, **st_pads}, self.graph_max_bs, f"decode {mode}",
                                       pool=self.graph_pool)
        return graphs

    def static_inputs(self, max_bs: int, q_len: int) -> tuple[dict[str, torch.Tensor], dict]:
        """Batch-major buffers of a forward with q_len tokens per request, and their padding."""
        dev, long = self.device, torch.long
        inputs = {
            "input_ids": torch.zeros(max_bs, q_len, dtype=long, device=dev),
            "positions": torch.zeros(max_bs, q_len, dtype=long, device=dev),
            "slots": torch.zeros(max_bs, q_len, dtype=long, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "page_table": torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=dev),
        }
        pads = {"input_ids": 0, "positions": 0, "slots": -1, "seq_lens": 1,
                "page_table": self.spare_page}
        return inputs, pads

    @property
    def max_pages(self) -> int:
        return -(-self.max_positions // self.page_size)

    def graph_metadata(self, slots: torch.Tensor, seq_lens: torch.Tensor,
                       page_table: torch.Tensor, q_len: int,
                       custom_mask: torch.Tensor | None = None) -> AttentionMetadata:
        """Metadata from device tensors only (no host values that vary per step)."""
        bs = seq_lens.shape[0]
        return AttentionMetadata(
            slot_mapping=slots.reshape(-1),
            query_start_loc=torch.arange(0, bs * q_len + 1, q_len, dtype=torch.int32,
                                         device=self.device),
            seq_lens=seq_lens, page_table=page_table, max_query_len=q_len,
            max_seq_len=self.max_positions, custom_mask=custom_mask)

    def _decode_fn(self, mode: str):
        assert mode in DECODE_MODES

        def fn(input_ids, positions, slots, seq_lens, page_table, temperatures, top_ks, top_ps,
               min_ps, seeds) -> tuple[torch.Tensor, torch.Tensor]:
            md = self.graph_metadata(slots, seq_lens, page_table, 1)
            hidden = self.forward(input_ids.reshape(-1), positions.reshape(-1), md)
            logits = self.compute_logits(hidden)  # [bs, V] float32
            if mode == "greedy":
                return logits.argmax(dim=-1), logits
            # the noise counter is the position of the token being sampled
            st = SamplingTensors.general(temperatures, top_ks, top_ps, min_ps, seeds,
                                         positions.reshape(-1) + 1)
            return self.sampler.sample(logits, st), logits

        return fn

    def page_table(self, step: StepInput) -> tuple[np.ndarray, int]:
        """[bs, width] int32 host array of the rows' page tables (width: the longest),
        padded with the spare page; and the width."""
        return step.page_table(self.spare_page)

    def sampling_fields(self, step: StepInput) -> dict[str, np.ndarray]:
        """The rows' sampling fields as a captured graph's static inputs take them."""
        return host_fields(step.temperature, step.top_k, step.top_p, step.min_p, step.seed,
                           self.model_config.vocab_size)

    @property
    def num_graphs(self) -> int:
        tokens = len(self.token_graphs.graphs) if self.token_graphs is not None else 0
        return tokens + sum(len(g.graphs) for g in (self.decode_graphs or {}).values())

    # -- KV memory ---------------------------------------------------------------------------
    def _allocate_kv_pool(self) -> KVPool:
        cc = self.config.cache
        specs = [m.kv_spec for m in self.attn_layers] + self.extra_kv_specs
        num_pages = plan_num_pages(cc, specs, self.dtype, self.device, self.reserve_bytes)
        # every rank holds the same pages (one allocator on rank 0): the least free memory wins
        num_pages = min_over_ranks(num_pages)
        # one spare page past the allocator's range: CUDA-graph padding rows point at it
        self.spare_page = num_pages
        return KVPool(specs, num_pages + 1, cc.page_size, self.dtype, self.device)

    @property
    def num_pages(self) -> int:
        """Pages the allocator hands out (the pool holds one spare page more)."""
        return self.spare_page

    # -- one forward -------------------------------------------------------------------------
    def prepare(self, step: StepInput) -> BatchInputs:
        return prepare_batch(step, self.page_size, self.device)

    def tensor(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """Run the target over the batch; returns the final hidden states [T, H]."""
        set_forward_context(ForwardContext(md, self.backend))
        try:
            return self.forward_eager(input_ids, positions, md)
        finally:
            set_forward_context(None)

    def forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      md: AttentionMetadata) -> torch.Tensor:
        """The model call itself (the forward context is set by the caller)."""
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sampling_tensors(self, step: StepInput, index: list[int] | None = None,
                         counters: np.ndarray | None = None) -> SamplingTensors:
        """Sampling parameters of the rows `index` (default all); the noise counter is the
        position of the token being sampled (default the request's length), so a seeded
        request samples the same token whatever the batch around it."""
        rows = step if index is None else step.select(index)
        return SamplingTensors.from_fields(
            self.sampling_fields(rows), rows.num_tokens if counters is None else counters,
            self.model_config.vocab_size, self.device)

    def _graph_decode(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sampled tokens [bs], logits [bs, V]) of an all-decode batch through a CUDA graph,
        or None when no graph applies. The outputs live in the graph's buffers."""
        if self.decode_graphs is None or step.bs > self.graph_max_bs:
            return None
        if not (step.samples.all() and (step.num_new_tokens == 1).all()) or step.eager:
            return None
        return self._replay_decode(step, step.starts, step.token_ids)

    def _replay_decode(self, rows: StepInput, starts: np.ndarray, ids: np.ndarray | torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode graph replay: row r's token ids[r] at position starts[r]."""
        ps, bs = self.page_size, rows.bs
        pos = np.asarray(starts, dtype=np.int64)
        table, width = self.page_table(rows)
        slots = table[np.arange(bs), pos // ps].astype(np.int64) * ps + pos % ps
        mode = "greedy" if rows.greedy.all() else "sample"
        return self.decode_graphs[mode].replay(
            bs, widths={"page_table": width}, input_ids=ids.reshape(bs, 1),
            positions=pos[:, None], slots=slots[:, None], seq_lens=pos + 1, page_table=table,
            **self.sampling_fields(rows))

    def launch(self, step: StepInput
               ) -> tuple[list[int], torch.Tensor | None, tuple | None, list | None]:
        """Enqueue forward + sampling over the step's rows without waiting for the device:
        (indices of the rows that sample, their tokens on the device, their log-probs when
        a row asks, the prompt log-probs per row when one asks: see worker/logits.py)."""
        graphed = self._graph_decode(step)
        if graphed is not None:
            return list(range(step.bs)), graphed[0], None, None
        hidden, sample_rows, sample_index = forward_step(self, step)
        prompt_lps = prompt_logprobs(self, step, hidden)
        if not sample_index:
            return [], None, None, prompt_lps
        logits = self.compute_logits(hidden[sample_rows])
        rows = step.select(sample_index)
        tokens, lp = sample_logits(self, rows, logits, self.sampling_tensors(rows))
        return sample_index, tokens, lp, prompt_lps

    def _decode_rows(self, rows: StepInput, starts: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
        """Sampled tokens [n] of one decode step whose input ids are already on the device."""
        if self.decode_graphs is not None and rows.bs <= self.graph_max_bs:
            return self._replay_decode(rows, starts, ids)[0]
        n = rows.bs
        md = build_attention_metadata([1] * n, (starts + 1).tolist(), rows.page_lists(),
                                      self.page_size, self.device)
        hidden = self.forward(ids.reshape(-1), self.tensor(starts), md)
        st = self.sampling_tensors(rows, counters=starts + 1)
        return self.sampler.sample(self.compute_logits(hidden), st)

    def discard_launched(self) -> None:
        """Forget a step launched ahead (its KV writes are harmless: see execute)."""
        self._launched = None

    def close(self) -> None:
        """Drop the CUDA graphs, the KV pool and the weights (idempotent): nothing of this
        runner holds device memory afterwards, even while the object itself is referenced."""
        self._launched = None
        self.decode_graphs = self.token_graphs = self.graph_pool = None
        for layer in self.attn_layers:  # the layers' views would keep the pool alive
            layer.bind_kv_cache({name: torch.empty(0) for name in layer.kv_spec.names})
        self.attn_layers = []
        self.kv_pool = None
        self.model = None

    @staticmethod
    def _match(launched: LaunchedStep | None, step: StepInput) -> dict[int, int]:
        """{row of step: row of the launched step} for the rows it already decoded: same
        request id, a decode at the position launched. Rows of requests released since are
        never taken."""
        if launched is None:
            return {}
        released = set(step.finished_ids) | set(step.preempted_ids)
        row_of = {rid: j for j, rid in enumerate(launched.request_ids) if rid not in released}
        out = {}
        for i, rid in enumerate(step.request_ids):
            j = row_of.get(rid)
            if j is not None and step.num_new_tokens[i] == 1 and step.samples[i] \
                    and step.starts[i] == launched.starts[j]:
                out[i] = j
        return out

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Plain step: forward, sample the rows that reached their last token.

        With overlap on, the next decode step of every request that sampled here is launched
        before this step's tokens are read (its input ids are this step's sampled tokens, on
        the device), so the device runs it while the host updates requests and schedules.
        The next call takes the rows it scheduled unchanged (same request id, position + 1)
        from that launch and runs only the rest. Rows it does not take were decoded for
        nothing; their KV writes went to slots their requests still held (the scheduler keeps
        one slot ahead), and any later owner of those pages writes after them in stream order.
        The device-to-host copy of the tokens is the step's only synchronisation.
        """
        launched, self._launched = self._launched, None
        matched = self._match(launched, step)
        parts: list[torch.Tensor] = []
        where: dict[int, int] = {}  # row index -> row of the step's token vector
        if matched:  # copied before any replay below overwrites the graph output
            parts.append(launched.tokens.clone())
            where.update(matched)
            self.rows_launched_ahead += len(matched)
        rest = [i for i in range(step.bs) if i not in matched]
        logprobs = prompt_logprobs = None
        if rest:
            index, tokens, lp, plp = self.launch(step if not matched else step.select(rest))
            if plp is not None:
                prompt_logprobs = [None] * step.bs
                for j, entries in enumerate(plp):
                    prompt_logprobs[rest[j]] = entries
            if lp is not None:
                logprobs = [None] * step.bs
                ks = step.logprobs.tolist()
                for j, entry in zip(index, logprob_lists(lp, [ks[rest[j]] for j in index])):
                    logprobs[rest[j]] = [entry]
            if tokens is not None:
                base = len(launched.tokens) if matched else 0
                where.update({rest[j]: base + k for k, j in enumerate(index)})
                parts.append(tokens)
        out: list[list[int]] = [[] for _ in range(step.bs)]
        if not parts:
            return StepOutput(out, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        step_tokens = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        host = step_tokens.to("cpu", non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if self.overlap:
            self._launch_next(step, where, step_tokens)
        if done is not None:
            done.synchronize()  # this step's tokens only; the next one keeps running
        values = host.tolist()
        for i, row in where.items():
            out[i] = [values[row]]
        return StepOutput(out, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _launch_next(self, step: StepInput, where: dict[int, int],
                     step_tokens: torch.Tensor) -> None:
        """Launch the next decode of every row that sampled here (decodes, prompts done),
        unless the engine expects prefill chunks next step (StepInput.launch_ahead)."""
        ps = self.page_size
        if step.eager or not step.launch_ahead:
            return  # logits processing reads tokens the host has not seen yet
        ends = step.starts + step.num_new_tokens  # the next token's position; a slot for it
        index = [i for i in range(step.bs) if i in where and step.page_counts[i] * ps > ends[i]
                 and step.tokens_left[i] > 1]  # this step's token does not end it
        if not index:
            return
        if self.decode_graphs is not None and len(index) > self.graph_max_bs:
            return  # an eager step launched ahead would gain nothing
        rows = [where[i] for i in index]
        ids = (step_tokens[:len(rows)] if rows == list(range(len(rows)))
               else step_tokens.index_select(0, self.tensor(rows)))
        nxt = step if len(index) == step.bs else step.select(index)
        starts = nxt.starts + nxt.num_new_tokens
        self._launched = LaunchedStep(nxt.request_ids, starts.tolist(),
                                      self._decode_rows(nxt, starts, ids))
