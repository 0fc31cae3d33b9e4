"""Eagle3Drafter: one speculative engine step (draft -> verify -> accept -> draft extend).

Positions, for a running request whose root (last emitted token, KV not yet computed) sits at
target position P:
    target KV  covers [0, P)          the verify forward writes P .. P+n-1 (node i at P + i)
    draft KV   covers [0, P)          draft position i pairs feature f_i with token t_{i+1}
    last_out   the draft output at draft position P-1; it predicts the depth-1 candidates
Draft tree step s (1 .. num_steps-1) runs the k frontier nodes of depth s at RoPE position
P + s - 1 and writes their scratch K/V at slot positions P + (s-1)*k + j of the draft layer;
each query sees the draft prefix plus its ancestors among the scratch (a custom mask of width
s*k). After verification the accepted path's target KV is compacted to P .. P+m-1 and the draft
is extended over the m emitted tokens with the target features of the accepted nodes, which
overwrites the scratch. The decode cycle runs on the device only (speculative/cycle.py, one
CUDA graph per batch bucket on GPUs); one device-to-host copy per step: the emitted tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.layers.rotary import ensure_rope_capacity
from specserve.layers.sampler import SamplingTensors, graph_sampling_inputs
from specserve.models.capture import (
    AuxHiddenCapture,
    default_aux_layer_ids,
    find_embedding_and_head,
)
from specserve.models.eagle3 import Eagle3Head, load_eagle3_head
from specserve.speculative.cycle import MODES, SpecCycle
from specserve.worker.cuda_graph import BatchGraphs
from specserve.worker.forward_batch import build_attention_metadata
from specserve.worker.step_input import StepInput, StepOutput

DUMMY = "dummy"  # --spec-draft-model dummy: a random head (cost benchmarks)


def load_draft_config(spec: SpecConfig, target_cfg: ModelConfig) -> ModelConfig:
    if not spec.draft_model:
        raise ValueError("speculative algorithm eagle3 needs --spec-draft-model PATH")
    from specserve.models.loader import resolve_model_path

    if spec.draft_model == DUMMY:  # the target's shape, a 32k draft vocabulary
        cfg = dataclasses.replace(target_cfg, draft_vocab_size=min(32000, target_cfg.vocab_size))
        if cfg.mla is not None or cfg.moe is not None:
            # MLA / MoE targets (DeepSeek-V3, Kimi K2): a Llama-style head on the target's
            # hidden size, GQA with 8 KV heads of 128 dims and the dense MLP width, the shape
            # of the public Llama heads for these targets
            cfg = dataclasses.replace(cfg, mla=None, moe=None, num_mtp_layers=0, head_dim=128,
                                      num_kv_heads=math.gcd(8, cfg.num_heads))
    else:
        cfg = ModelConfig.from_hf(resolve_model_path(spec.draft_model))
    if spec.topk < 1 or spec.num_steps < 1:
        raise ValueError("--spec-topk and --spec-num-steps must be >= 1")
    max_nodes = 1 + spec.topk + (spec.num_steps - 1) * spec.topk**2
    if not 2 <= spec.verify_tokens <= max_nodes:
        raise ValueError(f"--spec-num-draft-tokens must be in [2, {max_nodes}] for topk "
                         f"{spec.topk} and {spec.num_steps} steps, got {spec.verify_tokens}")
    return dataclasses.replace(cfg, num_layers=1)


@dataclass
class SpecCounters:
    """Totals with the meaning of vLLM's spec_decode metrics."""

    num_drafts: int = 0  # draft-verify cycles
    num_draft_tokens: int = 0  # draft tokens proposed (root excluded)
    num_accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class LaunchedCycle:
    """A cycle launched before the host read the cycle that feeds it (see _speculate)."""

    request_ids: list[str]
    starts: list[int]  # each row's root position, known once the feeding cycle is read
    outputs: tuple[torch.Tensor, ...]  # _cycle's outputs (graph buffers on GPUs)


class Eagle3Drafter:
    def __init__(self, spec: SpecConfig, runner) -> None:  # runner: ModelRunner
        self.spec = spec
        self.runner = runner
        self.k = spec.topk
        self.num_steps = spec.num_steps
        self.n = spec.verify_tokens
        target = runner.model
        tcfg = runner.model_config
        self.head = self._load_head(spec, runner)
        # RoPE tables cover every position before any graph is captured (no growth later)
        ensure_rope_capacity(self.head, runner.max_positions)
        runner.kv_pool.bind([self.head.midlayer.attn], first_layer=len(runner.attn_layers))
        layer_ids = self.head.config.aux_layer_ids or default_aux_layer_ids(tcfg.num_layers)
        self.capture = AuxHiddenCapture(target, list(layer_ids))
        self.d2t = self.head.d2t if self.head.config.draft_vocab_size else None
        # slots past the root a decode must own: the verify nodes and the draft scratch
        self.lookahead = max(self.n, self.k * (self.num_steps - 1)) - 1
        self.counters = SpecCounters(accepted_per_pos=[0] * self.num_steps)
        self.last_out: dict[str, torch.Tensor] = {}  # request id -> [H] draft output at P-1
        self.draft_len: dict[str, int] = {}  # request id -> positions the draft KV covers
        self.cycle = SpecCycle(self)
        self.graphs = self._capture_graphs()
        # overlap: the next cycle is launched before this one is read (see _speculate); its
        # requests keep the slots it may write, up to W + lookahead past their valid KV
        self.overlap = runner.overlap
        self.keep_ahead = self.num_steps + 1 + self.lookahead if self.overlap else 0
        self._launched: LaunchedCycle | None = None
        self.cycles_launched = 0  # cycles launched ahead
        self.cycles_launched_ahead = 0  # of those, taken by the next step

    def _capture_graphs(self) -> dict[str, BatchGraphs] | None:
        """One graph per batch bucket for each verification mode this config can use."""
        runner = self.runner
        if runner.decode_graphs is None:  # no graphs on this device/backend
            return None
        max_bs = runner.graph_max_bs
        modes = ["synthetic"] if self.spec.synthetic_accept_len else ["greedy", "sample"]
        graphs = {}
        for mode in modes:
            inputs, pads = self._static_inputs(max_bs)
            graphs[mode] = BatchGraphs(self._graph_fn(mode), inputs, pads, max_bs,
                                       f"speculative {mode}", pool=runner.graph_pool)
        return graphs

    def _static_inputs(self, max_bs: int) -> tuple[dict[str, torch.Tensor], dict]:
        runner, dev = self.runner, self.runner.device
        hidden = self.head.config.hidden_size
        inputs = {
            "last_out": torch.zeros(max_bs, hidden, dtype=runner.dtype, device=dev),
            "root_pos": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "root_tokens": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "page_table": torch.zeros(max_bs, runner.max_pages, dtype=torch.int32, device=dev),
            "valid": torch.zeros(max_bs, dtype=torch.bool, device=dev),
        }
        pads = {"last_out": 0.0, "root_pos": 0, "root_tokens": 0,
                "page_table": runner.spare_page, "valid": False}
        st_inputs, st_pads = graph_sampling_inputs(max_bs, runner.model_config.vocab_size, dev)
        inputs.update(st_inputs)
        pads.update(st_pads)
        return inputs, pads

    def _graph_fn(self, mode: str):
        assert mode in MODES

        def fn(last_out, root_pos, root_tokens, page_table, valid, temperatures, top_ks, top_ps,
               min_ps, seeds):
            st = SamplingTensors.general(temperatures, top_ks, top_ps, min_ps, seeds, root_pos)
            return self._cycle(mode, last_out, root_pos, root_tokens, page_table, valid, st)

        return fn

    def _cycle(self, mode: str, last_out: torch.Tensor, root_pos: torch.Tensor,
               root_tokens: torch.Tensor, page_table: torch.Tensor, valid: torch.Tensor,
               st: SamplingTensors) -> tuple[torch.Tensor, ...]:
        """The cycle plus the inputs of the cycle after it, on the device: (emitted,
        num_emitted, new_last, next root position, next root token)."""
        emitted, num, new_last = self.cycle.run(mode, last_out, root_pos, root_tokens,
                                                page_table, valid, st)
        last = emitted.gather(1, (num - 1).clamp(min=0)[:, None]).squeeze(1)
        return emitted, num, new_last, root_pos + num, last

    @staticmethod
    def _load_head(spec: SpecConfig, runner) -> Eagle3Head:
        from specserve.models.loader import resolve_model_path

        target, tcfg, layer = runner.model, runner.model_config, len(runner.attn_layers)
        if spec.draft_model != DUMMY:
            return load_eagle3_head(resolve_model_path(spec.draft_model), target, tcfg, layer,
                                    runner.dtype, runner.device)
        from specserve.models.presets import random_init

        cfg = load_draft_config(spec, tcfg)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(runner.dtype)
        try:
            with torch.device(runner.device):
                head = Eagle3Head(cfg, tcfg.hidden_size, layer, *find_embedding_and_head(target))
        finally:
            torch.set_default_dtype(previous)
        random_init(head, seed=1)
        if hasattr(head, "lm_head"):
            # confident like a trained head, so trees grow to full depth (cost benchmarks)
            head.lm_head.weight.data.mul_(50.0)
        return head.eval()

    def release(self, request_id: str) -> None:
        self.last_out.pop(request_id, None)
        self.draft_len.pop(request_id, None)

    def release_all(self) -> None:
        self.last_out.clear()
        self.draft_len.clear()

    def _can_speculate(self, step: StepInput, i: int) -> bool:
        """A decode whose target and draft KV both cover [0, P) and whose pages hold the
        verify nodes and the draft scratch."""
        start = int(step.starts[i])
        return bool(step.num_new_tokens[i] == 1 and step.samples[i]
                    and self.draft_len.get(step.request_ids[i]) == start
                    and step.page_counts[i] * self.runner.page_size >= start + 1 + self.lookahead)

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        tokens: list[list[int]] = [[] for _ in range(step.bs)]
        computed = step.num_new_tokens.tolist()
        drafted = [0] * step.bs
        for rid in step.finished_ids + step.preempted_ids:
            self.release(rid)  # preempted: their KV is gone; re-prefill rebuilds the draft
        decodes = [i for i in range(step.bs) if self._can_speculate(step, i)]
        prefills = [i for i in range(step.bs) if i not in set(decodes)]
        if prefills:
            self._draft_extend(*self._prefill(step.select(prefills), prefills, tokens))
        if decodes:
            # requests finishing their prefill here speculate next step: no launch ahead
            joining = bool(step.samples[prefills].any()) if prefills else False
            self._speculate(step.select(decodes), decodes, tokens, computed,
                            launch_next=not joining)
            for i in decodes:
                drafted[i] = self.n - 1
        else:
            self._launched = None
        return StepOutput(tokens, computed, drafted)

    def _prefill(self, rows: StepInput, index: list[int], tokens: list[list[int]]
                 ) -> tuple[StepInput, list[list[int]], torch.Tensor]:
        """Plain target forward over prefill chunks; returns what the draft then extends
        over: the rows, each row's next tokens (t_{i+1} for each position i run) and the
        target features [T, 3H]."""
        runner = self.runner
        batch = runner.prepare(rows)
        self.capture.enable()
        hidden = runner.forward(batch.input_ids, batch.positions, batch.md)
        feats = self.capture.pop()  # [T, 3H]
        self.capture.disable()
        sampled: dict[int, int] = {}
        if batch.sample_index:
            logits = runner.compute_logits(hidden[batch.sample_rows])
            st = runner.sampling_tensors(rows, batch.sample_index)
            for j, tok in zip(batch.sample_index, runner.sampler.sample(logits, st).tolist()):
                sampled[j] = tok
                tokens[index[j]] = [tok]
        nxt = [rows.tokens(j)[1:].tolist() + [sampled[j] if j in sampled
                                              else int(rows.next_token_ids[j])]
               for j in range(rows.bs)]
        return rows, nxt, feats

    def _speculate(self, rows: StepInput, index: list[int], tokens: list[list[int]],
                   computed: list[int], launch_next: bool) -> None:
        """One device cycle for every speculating request (a CUDA graph when captured), then
        the step's single device-to-host copy: the emitted tokens.

        With overlap on (and no request joining the decodes next step) the cycle after this
        one is launched before this one's tokens are read: its inputs (the head's new last
        output, root position + tokens emitted, the last emitted token) never leave the
        device. The next step takes that launch when every request it speculates has a row
        there at the same root (a request that finished just drops its row); otherwise the
        launch is forgotten. Its KV writes went to slots past each request's valid KV that the
        request still owned (the scheduler keeps W + lookahead slots ahead), which a fresh
        cycle rewrites before reading and a later owner of freed pages writes after, in
        stream order.
        """
        starts = rows.starts.tolist()
        launched, self._launched = self._launched, None
        match = self._match(launched, rows.request_ids, starts)
        if match is None:
            out = self._run(rows, self._fresh_inputs(rows))
        else:
            out = launched.outputs
            self.cycles_launched_ahead += 1
            if match != list(range(len(launched.request_ids))):
                idx = torch.tensor(match, dtype=torch.long, pin_memory=self.runner.device.type
                                   == "cuda").to(self.runner.device, non_blocking=True)
                out = tuple(t.index_select(0, idx) for t in out)
        emitted, num_emitted, new_last, next_root, next_token = out
        new_last = new_last.clone()  # graph outputs are overwritten by the next replay
        host = torch.cat([num_emitted[:, None], emitted], dim=1).to("cpu", non_blocking=True)
        done = torch.cuda.Event() if self.runner.device.type == "cuda" else None
        if done is not None:
            done.record()
        if launch_next and self.overlap:
            self._launch_next(rows, new_last, next_root, next_token)
        if done is not None:
            done.synchronize()  # this cycle's tokens only; the next cycle keeps running
        for j, (rid, start, row) in enumerate(zip(rows.request_ids, starts, host.tolist())):
            m = row[0]
            tokens[index[j]] = row[1:1 + m]
            computed[index[j]] = m
            self.last_out[rid] = new_last[j]
            self.draft_len[rid] = start + m
            self._count(m - 1, self.n - 1)
            if self._launched is not None:
                self._launched.starts[j] = start + m

    def _fresh_inputs(self, rows: StepInput) -> dict[str, object]:
        return {
            "last_out": torch.stack([self.last_out[rid] for rid in rows.request_ids]),
            "root_pos": rows.starts.copy(),
            "root_tokens": rows.token_ids.copy(),  # a decode row runs its root only
        }

    def _run(self, rows: StepInput, inputs: dict[str, object]) -> tuple[torch.Tensor, ...]:
        """Launch one cycle over the rows (inputs: last_out, root_pos, root_tokens, host or
        device values); returns its device outputs (see _cycle)."""
        runner = self.runner
        mode = ("synthetic" if self.spec.synthetic_accept_len
                else "greedy" if rows.greedy.all() else "sample")
        table, width = runner.page_table(rows)
        inputs.update(page_table=table, valid=np.ones(rows.bs, dtype=bool))
        graphs = self.graphs.get(mode) if self.graphs else None
        if graphs is not None and rows.bs <= graphs.max_bs:
            inputs.update(runner.sampling_fields(rows))
            return graphs.replay(rows.bs, widths={"page_table": width}, **inputs)
        # counters are unused: verification keys its noise by root position
        st = runner.sampling_tensors(rows, counters=np.zeros(rows.bs, dtype=np.int64))
        dev = {k: torch.as_tensor(v).to(runner.device) for k, v in inputs.items()}
        return self._cycle(mode, dev["last_out"], dev["root_pos"], dev["root_tokens"],
                           dev["page_table"], dev["valid"], st)

    @staticmethod
    def _match(launched: LaunchedCycle | None, request_ids: list[str], starts: list[int]
               ) -> list[int] | None:
        """Rows of the launched cycle for these requests (same id, same root), or None unless
        it holds every one of them."""
        if launched is None:
            return None
        row_of = {rid: j for j, rid in enumerate(launched.request_ids)}
        rows = [row_of.get(rid) for rid in request_ids]
        if any(j is None or launched.starts[j] != p for j, p in zip(rows, starts)):
            return None
        return rows

    def _launch_next(self, rows: StepInput, new_last: torch.Tensor,
                     next_root: torch.Tensor, next_token: torch.Tensor) -> None:
        """Launch the next cycle of these requests from this one's device outputs, if every
        request owns the slots it may need (root up to W past this one, plus lookahead)."""
        runner, w = self.runner, self.num_steps + 1
        need = rows.starts + w + self.lookahead + 1
        if (rows.page_counts * runner.page_size < need).any() \
                or (need > runner.max_positions).any():
            return
        if (rows.tokens_left <= 1).all():
            return  # this cycle ends every one of them
        out = self._run(rows, {"last_out": new_last, "root_pos": next_root,
                               "root_tokens": next_token})
        self._launched = LaunchedCycle(list(rows.request_ids), [-1] * rows.bs, out)
        self.cycles_launched += 1

    def discard_launched(self) -> None:
        self._launched = None

    def _count(self, accepted: int, proposed: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        for d in range(accepted):
            c.accepted_per_pos[d] += 1

    def _draft_forward(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor,
                       md) -> torch.Tensor:
        return self.cycle._head(ids, positions, g, md)

    def _draft_extend(self, rows: StepInput, nxt: list[list[int]], feats: torch.Tensor) -> None:
        """Extend the draft KV over new target positions [start, start + m) of each row with
        pairs (feature f_i, token t_{i+1}); remember each request's last output."""
        runner = self.runner
        q_lens = [len(t) for t in nxt]
        starts = rows.starts.tolist()
        md = build_attention_metadata(q_lens, [a + q for a, q in zip(starts, q_lens)],
                                      rows.page_lists(), runner.page_size, runner.device)
        ids = runner.tensor([t for row in nxt for t in row])
        positions = runner.tensor(rows.positions())
        y = self._draft_forward(ids, positions, feats, md)
        ends = runner.tensor(q_lens).cumsum(0) - 1
        last = y.index_select(0, ends)
        for rid, row, a, q in zip(rows.request_ids, last, starts, q_lens):
            self.last_out[rid] = row
            self.draft_len[rid] = a + q
