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
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.engine.cuda_graph import BatchGraphs
from specserve.engine.forward_batch import build_attention_metadata
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.layers.rotary import ensure_rope_capacity
from specserve.layers.sampler import SamplingTensors, graph_sampling_inputs, host_fields
from specserve.models.capture import AuxHiddenCapture, default_aux_layer_ids
from specserve.models.eagle3 import Eagle3Head, load_eagle3_head
from specserve.speculative.cycle import MODES, SpecCycle

DUMMY = "dummy"  # --spec-draft-model dummy: a random head (cost benchmarks)


def load_draft_config(spec: SpecConfig, target_cfg: ModelConfig) -> ModelConfig:
    if not spec.draft_model:
        raise ValueError("speculative algorithm eagle3 needs --spec-draft-model PATH")
    from specserve.models.loader import resolve_model_path

    if spec.draft_model == DUMMY:  # the target's shape, a 32k draft vocabulary
        cfg = dataclasses.replace(target_cfg, draft_vocab_size=min(32000, target_cfg.vocab_size))
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

    requests: list  # the rows' Request objects
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
                head = Eagle3Head(cfg, tcfg.hidden_size, layer, target.get_input_embeddings(),
                                  target.lm_head)
        finally:
            torch.set_default_dtype(previous)
        random_init(head, seed=1)
        if hasattr(head, "lm_head"):
            # confident like a trained head, so trees grow to full depth (cost benchmarks)
            head.lm_head.weight.data.mul_(50.0)
        return head.eval()

    def release(self, req) -> None:
        self.last_out.pop(req.request_id, None)
        self.draft_len.pop(req.request_id, None)

    def _can_speculate(self, s: ScheduledRequest) -> bool:
        """A decode whose target and draft KV both cover [0, P) and whose pages hold the
        verify nodes and the draft scratch."""
        req = s.request
        return (s.num_new_tokens == 1 and s.samples
                and self.draft_len.get(req.request_id) == s.start
                and len(req.page_ids) * self.runner.page_size >= s.start + 1 + self.lookahead)

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, out: SchedulerOutput) -> tuple[list[list[int]], list[int]]:
        entries = out.scheduled
        tokens: list[list[int]] = [[] for _ in entries]
        computed = [s.num_new_tokens for s in entries]
        for req in out.preempted:  # their KV is gone; re-prefill rebuilds the draft state
            self.release(req)
        decodes = [i for i, s in enumerate(entries) if self._can_speculate(s)]
        prefills = [i for i in range(len(entries)) if i not in set(decodes)]
        if prefills:
            extend: list[tuple[ScheduledRequest, list[int], torch.Tensor]] = []
            self._prefill([entries[i] for i in prefills], prefills, tokens, extend)
            self._draft_extend(extend)
        if decodes:
            # requests finishing their prefill here speculate next step: no launch ahead
            joining = any(entries[i].samples for i in prefills)
            self._speculate([entries[i] for i in decodes], decodes, tokens, computed,
                            launch_next=not joining)
        else:
            self._launched = None
        return tokens, computed

    def _prefill(self, entries: list[ScheduledRequest], index: list[int],
                 tokens: list[list[int]], extend: list) -> None:
        """Plain target forward over prefill chunks; the draft then extends over them."""
        runner = self.runner
        batch = runner.prepare(entries)
        self.capture.enable()
        hidden = runner.forward(batch.input_ids, batch.positions, batch.md)
        feats = self.capture.pop()  # [T, 3H]
        self.capture.disable()
        sampled: dict[int, int] = {}
        if batch.sample_index:
            logits = runner.compute_logits(hidden[batch.sample_rows])
            st = runner.sampling_tensors(entries, batch.sample_index)
            for j, tok in zip(batch.sample_index, runner.sampler.sample(logits, st).tolist()):
                sampled[j] = tok
                tokens[index[j]] = [tok]
        offset = 0
        for j, s in enumerate(entries):
            req, end = s.request, s.start + s.num_new_tokens
            nxt = req.all_token_ids[s.start + 1:end + 1] + ([sampled[j]] if j in sampled else [])
            extend.append((s, nxt, feats[offset:offset + s.num_new_tokens]))
            offset += s.num_new_tokens

    def _speculate(self, entries: list[ScheduledRequest], index: list[int],
                   tokens: list[list[int]], computed: list[int], launch_next: bool) -> None:
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
        reqs = [s.request for s in entries]
        starts = [s.start for s in entries]
        launched, self._launched = self._launched, None
        rows = self._match(launched, reqs, starts)
        if rows is None:
            out = self._run(reqs, self._fresh_inputs(reqs, starts))
        else:
            out = launched.outputs
            self.cycles_launched_ahead += 1
            if rows != list(range(len(launched.requests))):
                idx = torch.tensor(rows, dtype=torch.long, pin_memory=self.runner.device.type
                                   == "cuda").to(self.runner.device, non_blocking=True)
                out = tuple(t.index_select(0, idx) for t in out)
        emitted, num_emitted, new_last, next_root, next_token = out
        new_last = new_last.clone()  # graph outputs are overwritten by the next replay
        host = torch.cat([num_emitted[:, None], emitted], dim=1).to("cpu", non_blocking=True)
        done = torch.cuda.Event() if self.runner.device.type == "cuda" else None
        if done is not None:
            done.record()
        if launch_next and self.overlap:
            self._launch_next(entries, new_last, next_root, next_token)
        if done is not None:
            done.synchronize()  # this cycle's tokens only; the next cycle keeps running
        for j, (s, row) in enumerate(zip(entries, host.tolist())):
            m = row[0]
            tokens[index[j]] = row[1:1 + m]
            computed[index[j]] = m
            self.last_out[s.request.request_id] = new_last[j]
            self.draft_len[s.request.request_id] = s.start + m
            self._count(s.request, m - 1, self.n - 1)
            if self._launched is not None:
                self._launched.starts[j] = s.start + m

    def _fresh_inputs(self, reqs: list, starts: list[int]) -> dict[str, object]:
        return {
            "last_out": torch.stack([self.last_out[r.request_id] for r in reqs]),
            "root_pos": np.array(starts, dtype=np.int64),
            "root_tokens": np.array([r.all_token_ids[-1] for r in reqs], dtype=np.int64),
        }

    def _run(self, reqs: list, inputs: dict[str, object]) -> tuple[torch.Tensor, ...]:
        """Launch one cycle over reqs (inputs: last_out, root_pos, root_tokens, host or
        device values); returns its device outputs (see _cycle)."""
        runner = self.runner
        params, seeds = [r.params for r in reqs], [r.seed for r in reqs]
        mode = ("synthetic" if self.spec.synthetic_accept_len
                else "greedy" if all(p.greedy for p in params) else "sample")
        table, width = runner.page_table(reqs)
        inputs.update(page_table=table, valid=np.ones(len(reqs), dtype=bool))
        graphs = self.graphs.get(mode) if self.graphs else None
        if graphs is not None and len(reqs) <= graphs.max_bs:
            inputs.update(host_fields(params, seeds, runner.model_config.vocab_size))
            return graphs.replay(len(reqs), widths={"page_table": width}, **inputs)
        # counters are unused: verification keys its noise by root position
        st = SamplingTensors.build(params, seeds, [0] * len(reqs),
                                   runner.model_config.vocab_size, runner.device)
        dev = {k: torch.as_tensor(v).to(runner.device) for k, v in inputs.items()}
        return self._cycle(mode, dev["last_out"], dev["root_pos"], dev["root_tokens"],
                           dev["page_table"], dev["valid"], st)

    @staticmethod
    def _match(launched: LaunchedCycle | None, reqs: list, starts: list[int]) -> list[int] | None:
        """Rows of the launched cycle for reqs, or None unless it holds every one of them."""
        if launched is None:
            return None
        row_of = {id(r): j for j, r in enumerate(launched.requests)}
        rows = [row_of.get(id(r)) for r in reqs]
        if any(j is None or launched.starts[j] != p for j, p in zip(rows, starts)):
            return None
        return rows

    def _launch_next(self, entries: list[ScheduledRequest], new_last: torch.Tensor,
                     next_root: torch.Tensor, next_token: torch.Tensor) -> None:
        """Launch the next cycle of these requests from this one's device outputs, if every
        request owns the slots it may need (root up to W past this one, plus lookahead)."""
        reqs = [s.request for s in entries]
        runner, w = self.runner, self.num_steps + 1
        for s in entries:
            need = s.start + w + self.lookahead + 1
            if len(s.request.page_ids) * runner.page_size < need or need > runner.max_positions:
                return
        if all(r.num_output_tokens + 1 >= r.max_tokens for r in reqs):
            return  # this cycle ends every one of them
        out = self._run(reqs, {"last_out": new_last, "root_pos": next_root,
                               "root_tokens": next_token})
        self._launched = LaunchedCycle(reqs, [-1] * len(reqs), out)
        self.cycles_launched += 1

    def discard_launched(self) -> None:
        self._launched = None

    def _count(self, req, accepted: int, proposed: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        req.record_spec_cycle(proposed, accepted)
        for d in range(accepted):
            c.accepted_per_pos[d] += 1

    def _draft_forward(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor,
                       md) -> torch.Tensor:
        return self.cycle._head(ids, positions, g, md)

    def _draft_extend(self, items: list[tuple[ScheduledRequest, list[int], torch.Tensor]]) -> None:
        """Extend the draft KV over new target positions [start, start + m) with pairs
        (feature f_i, token t_{i+1}); remember each request's last output."""
        runner = self.runner
        q_lens = [len(nxt) for _, nxt, _ in items]
        starts = [s.start for s, _, _ in items]
        md = build_attention_metadata(q_lens, [a + q for a, q in zip(starts, q_lens)],
                                      [s.request.page_ids for s, _, _ in items],
                                      runner.page_size, runner.device)
        ids = runner.tensor([t for _, nxt, _ in items for t in nxt])
        positions = runner.tensor([a + i for a, q in zip(starts, q_lens) for i in range(q)])
        feats = torch.cat([f for _, _, f in items])
        y = self._draft_forward(ids, positions, feats, md)
        ends = runner.tensor(q_lens).cumsum(0) - 1
        last = y.index_select(0, ends)
        for (s, _, _), row, q in zip(items, last, q_lens):
            self.last_out[s.request.request_id] = row
            self.draft_len[s.request.request_id] = s.start + q
