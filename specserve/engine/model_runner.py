"""ModelRunner: owns the target model, its KV pool and attention backend; runs one forward.

The runner turns a scheduled batch into device tensors (input ids, positions, attention
metadata), runs the model under a forward context, and samples. The only device-to-host copy of
a plain step is the final `tolist()` of the sampled ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.config import EngineConfig, ModelConfig
from specserve.engine.cuda_graph import BatchGraphs
from specserve.engine.device import resolve_device, resolve_dtype, select_backend
from specserve.engine.forward_batch import build_attention_metadata, to_device
from specserve.engine.scheduler import ScheduledRequest
from specserve.kv_cache.pool import KVPool, plan_num_pages
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention import attention_modules
from specserve.layers.attention_metadata import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)
from specserve.layers.rotary import ensure_rope_capacity
from specserve.layers.sampler import (
    Sampler,
    SamplingTensors,
    graph_sampling_inputs,
    host_fields,
)
from specserve.models.loader import build_model, load_model
from specserve.models.presets import random_init

log = logging.getLogger(__name__)

DECODE_MODES = ("greedy", "sample")
@dataclass
class BatchInputs:
    """Device tensors for one forward over a set of scheduled requests."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    sample_rows: torch.Tensor  # [n_sample] rows of the hidden states to turn into logits
    sample_index: list[int]  # which scheduled entries sample, in sample_rows order


@dataclass
class LaunchedStep:
    """A decode step launched before the host read the step that feeds it (see execute)."""

    requests: list  # the rows' Request objects
    starts: list[int]  # the position each row decodes (its input token's position)
    tokens: torch.Tensor  # [rows] sampled tokens on the device (a graph output buffer)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str | None,
                 extra_kv_specs: Sequence[KVCacheSpec] = ()) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        if self.device.type == "cpu":
            threads = config.cpu_threads or (1 if model_config.hidden_size <= 1024 else 0)
            if threads:
                torch.set_num_threads(threads)
        self.page_size = config.cache.page_size
        if config.load_format == "dummy" or model_path is None:
            self.model: nn.Module = build_model(model_config, self.dtype, self.device)
            random_init(self.model, config.seed)
        else:
            self.model = load_model(model_config, model_path, self.dtype, self.device)
        self.backend = select_backend(self.device)
        self.sampler = Sampler()
        self.attn_layers = attention_modules(self.model)
        self.extra_kv_specs = list(extra_kv_specs)  # layers past the target's (draft heads)
        self.kv_pool = self._allocate_kv_pool()
        self.kv_pool.bind(self.attn_layers)
        # RoPE tables must cover every position before graphs are captured (replays run no
        # Python); speculation writes up to a few dozen positions past the context
        self.max_positions = config.scheduler.max_model_len + 256
        ensure_rope_capacity(self.model, self.max_positions)
        self.decode_graphs = self._capture_decode_graphs()
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

    def page_table(self, reqs: list) -> tuple[np.ndarray, int]:
        """[bs, width] int32 host array of the requests' page tables (width: the longest),
        padded with the spare page; and the width."""
        width = max(len(r.page_ids) for r in reqs)
        table = np.full((len(reqs), width), self.spare_page, dtype=np.int32)
        for i, req in enumerate(reqs):
            table[i, : len(req.page_ids)] = req.page_ids
        return table, width

    @property
    def num_graphs(self) -> int:
        return sum(len(g.graphs) for g in (self.decode_graphs or {}).values())

    # -- KV memory ---------------------------------------------------------------------------
    def _allocate_kv_pool(self) -> KVPool:
        cc = self.config.cache
        specs = [m.kv_spec for m in self.attn_layers] + self.extra_kv_specs
        num_pages = plan_num_pages(cc, specs, self.dtype, self.device)
        # one spare page past the allocator's range: CUDA-graph padding rows point at it
        self.spare_page = num_pages
        return KVPool(specs, num_pages + 1, cc.page_size, self.dtype, self.device)

    @property
    def num_pages(self) -> int:
        """Pages the allocator hands out (the pool holds one spare page more)."""
        return self.spare_page

    # -- one forward -------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, page_tables = [], [], []
        sample_rows: list[int] = []
        sample_index: list[int] = []
        for i, s in enumerate(scheduled):
            req = s.request
            end = s.start + s.num_new_tokens
            ids.extend(req.all_token_ids[s.start:end])
            positions.extend(range(s.start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            page_tables.append(req.page_ids)
            if s.samples:
                sample_rows.append(len(ids) - 1)
                sample_index.append(i)
        md = build_attention_metadata(query_lens, seq_lens, page_tables, self.page_size,
                                      self.device)
        return BatchInputs(
            input_ids=self.tensor(ids),
            positions=self.tensor(positions),
            md=md,
            sample_rows=self.tensor(sample_rows),
            sample_index=sample_index,
        )

    def tensor(self, values: list[int]) -> torch.Tensor:
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

    def sampling_tensors(self, scheduled: list[ScheduledRequest], index: list[int],
                         extra_offset: int = 0) -> SamplingTensors:
        """Sampling parameters of the entries that sample; the noise counter is the position
        of the token being sampled, so a seeded request samples the same token whatever the
        batch around it."""
        reqs = [scheduled[i].request for i in index]
        return SamplingTensors.build(
            [r.params for r in reqs], [r.seed for r in reqs],
            [r.num_tokens + extra_offset for r in reqs], self.model_config.vocab_size,
            self.device)

    def _graph_decode(self, scheduled: list[ScheduledRequest]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sampled tokens [bs], logits [bs, V]) of an all-decode batch through a CUDA graph,
        or None when no graph applies. The outputs live in the graph's buffers."""
        if self.decode_graphs is None or len(scheduled) > self.graph_max_bs:
            return None
        if not all(s.num_new_tokens == 1 and s.samples for s in scheduled):
            return None
        reqs = [s.request for s in scheduled]
        starts = [s.start for s in scheduled]
        ids = np.fromiter((r.all_token_ids[p] for r, p in zip(reqs, starts)), dtype=np.int64,
                          count=len(reqs))
        return self._replay_decode(reqs, starts, ids)

    def _replay_decode(self, reqs: list, starts: list[int], ids: np.ndarray | torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode graph replay: request r's token ids[r] at position starts[r]."""
        ps, bs = self.page_size, len(reqs)
        params = [r.params for r in reqs]
        pos = np.asarray(starts, dtype=np.int64)
        table, width = self.page_table(reqs)
        slots = table[np.arange(bs), pos // ps].astype(np.int64) * ps + pos % ps
        mode = "greedy" if all(p.greedy for p in params) else "sample"
        return self.decode_graphs[mode].replay(
            bs, widths={"page_table": width}, input_ids=ids.reshape(bs, 1),
            positions=pos[:, None], slots=slots[:, None], seq_lens=pos + 1, page_table=table,
            **host_fields(params, [r.seed for r in reqs], self.model_config.vocab_size))

    def _launch(self, scheduled: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor | None]:
        """Enqueue forward + sampling over `scheduled` without waiting for the device:
        (indices of the entries that sample, their tokens on the device)."""
        graphed = self._graph_decode(scheduled)
        if graphed is not None:
            return list(range(len(scheduled))), graphed[0]
        batch = self.prepare(scheduled)
        hidden = self.forward(batch.input_ids, batch.positions, batch.md)
        if not batch.sample_index:
            return [], None
        logits = self.compute_logits(hidden[batch.sample_rows])
        st = self.sampling_tensors(scheduled, batch.sample_index)
        return batch.sample_index, self.sampler.sample(logits, st)

    def _decode_rows(self, reqs: list, starts: list[int], ids: torch.Tensor) -> torch.Tensor:
        """Sampled tokens [n] of one decode step whose input ids are already on the device."""
        if self.decode_graphs is not None and len(reqs) <= self.graph_max_bs:
            return self._replay_decode(reqs, starts, ids)[0]
        n = len(reqs)
        md = build_attention_metadata([1] * n, [p + 1 for p in starts],
                                      [r.page_ids for r in reqs], self.page_size, self.device)
        hidden = self.forward(ids.reshape(-1), self.tensor(starts), md)
        st = SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs],
                                   [p + 1 for p in starts], self.model_config.vocab_size,
                                   self.device)
        return self.sampler.sample(self.compute_logits(hidden), st)

    def discard_launched(self) -> None:
        """Forget a step launched ahead (its KV writes are harmless: see execute)."""
        self._launched = None

    @staticmethod
    def _match(launched: LaunchedStep | None, scheduled: list[ScheduledRequest]) -> dict[int, int]:
        """{index in scheduled: row of the launched step} for the entries it already decoded."""
        if launched is None:
            return {}
        row_of = {id(r): j for j, r in enumerate(launched.requests)}
        out = {}
        for i, s in enumerate(scheduled):
            j = row_of.get(id(s.request))
            if j is not None and s.num_new_tokens == 1 and s.samples \
                    and s.start == launched.starts[j]:
                out[i] = j
        return out

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """Plain step: forward, sample the entries that reached their last token.

        With overlap on, the next decode step of every request decoding here is launched
        before this step's tokens are read (its input ids are this step's sampled tokens, on
        the device), so the device runs it while the host updates requests and schedules.
        The next call takes the rows it scheduled unchanged (same request, position + 1) from
        that launch and runs only the rest. Rows it does not take were decoded for nothing;
        their KV writes went to slots their requests still held (the scheduler keeps one
        slot ahead), and any later owner of those pages writes after them in stream order.
        The device-to-host copy of the tokens is the step's only synchronisation.
        """
        launched, self._launched = self._launched, None
        matched = self._match(launched, scheduled)
        parts: list[torch.Tensor] = []
        where: dict[int, int] = {}  # entry index -> row of the step's token vector
        if matched:  # copied before any replay below overwrites the graph output
            parts.append(launched.tokens.clone())
            where.update(matched)
            self.rows_launched_ahead += len(matched)
        rest = [i for i in range(len(scheduled)) if i not in matched]
        if rest:
            index, tokens = self._launch([scheduled[i] for i in rest])
            if tokens is not None:
                base = len(launched.tokens) if matched else 0
                where.update({rest[j]: base + k for k, j in enumerate(index)})
                parts.append(tokens)
        out: list[list[int]] = [[] for _ in scheduled]
        if not parts:
            return out
        step_tokens = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        host = step_tokens.to("cpu", non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if self.overlap:
            self._launch_next(scheduled, where, step_tokens)
        if done is not None:
            done.synchronize()  # this step's tokens only; the next one keeps running
        values = host.tolist()
        for i, row in where.items():
            out[i] = [values[row]]
        return out

    def _launch_next(self, scheduled: list[ScheduledRequest], where: dict[int, int],
                     step_tokens: torch.Tensor) -> None:
        """Launch the next decode step of this step's decodes that will still run it."""
        rows, reqs, starts = [], [], []
        for i, s in enumerate(scheduled):
            req, nxt = s.request, s.start + 1
            if i not in where or s.num_new_tokens != 1:
                continue
            if len(req.page_ids) * self.page_size <= nxt:  # no slot for it (yet)
                continue
            if req.num_output_tokens + 1 >= req.max_tokens:  # this step's token ends it
                continue
            rows.append(where[i])
            reqs.append(req)
            starts.append(nxt)
        if not reqs:
            return
        if self.decode_graphs is not None and len(reqs) > self.graph_max_bs:
            return  # an eager step launched ahead would gain nothing
        ids = (step_tokens[:len(rows)] if rows == list(range(len(rows)))
               else step_tokens.index_select(0, self.tensor(rows)))
        self._launched = LaunchedStep(reqs, starts, self._decode_rows(reqs, starts, ids))

