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
overwrites the scratch. One device-to-host copy per step: the verification result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.engine.forward_batch import build_attention_metadata
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.sampler import (
    ACCEPT_SALT,
    SamplingTensors,
    probs_from_logits,
    uniform_noise,
)
from specserve.models.capture import AuxHiddenCapture, default_aux_layer_ids
from specserve.models.eagle3 import Eagle3Head, load_eagle3_head
from specserve.speculative.tree import DraftTree, TreeAccumulator
from specserve.speculative.verify import VerifyResult, synthetic_accept, verify, walk_tree

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
        runner.kv_pool.bind([self.head.midlayer.attn], first_layer=len(runner.attn_layers))
        layer_ids = self.head.config.aux_layer_ids or default_aux_layer_ids(tcfg.num_layers)
        self.capture = AuxHiddenCapture(target, list(layer_ids))
        self.d2t = self.head.d2t if self.head.config.draft_vocab_size else None
        # slots past the root a decode must own: the verify nodes and the draft scratch
        self.lookahead = max(self.n, self.k * (self.num_steps - 1)) - 1
        self.counters = SpecCounters(accepted_per_pos=[0] * self.num_steps)
        self.last_out: dict[str, torch.Tensor] = {}  # request id -> [H] draft output at P-1
        self.draft_len: dict[str, int] = {}  # request id -> positions the draft KV covers

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
        extend: list[tuple[ScheduledRequest, list[int], torch.Tensor]] = []
        if prefills:
            self._prefill([entries[i] for i in prefills], prefills, tokens, extend)
        if decodes:
            self._speculate([entries[i] for i in decodes], decodes, tokens, computed, extend)
        if extend:
            self._draft_extend(extend)
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
                   tokens: list[list[int]], computed: list[int], extend: list) -> None:
        runner = self.runner
        roots = [s.start for s in entries]  # P per request
        tree = self.propose(entries, roots)
        n = tree.num_nodes
        # verify: node i at slot P + i, RoPE position P + depth, tree mask among the nodes
        md = build_attention_metadata([n] * len(entries), [p + n for p in roots],
                                      [s.request.page_ids for s in entries], runner.page_size,
                                      runner.device, custom_mask=tree.mask)
        root_pos = torch.tensor(roots, device=runner.device)
        self.capture.enable()
        hidden = runner.forward(tree.tokens.flatten(), tree.positions(root_pos).flatten(), md)
        feats = self.capture.pop().view(len(entries), n, -1)  # [bs, n, 3H]
        self.capture.disable()
        logits = runner.compute_logits(hidden).view(len(entries), n, -1)  # [bs, n, V]
        st = runner.sampling_tensors(entries, list(range(len(entries))))
        result = self._verify(tree, logits, st, root_pos)
        if self.k > 1:
            self._compact_kv(result, md.page_table, root_pos)
        host = torch.cat([result.num_emitted[:, None], result.emitted, result.accepted_nodes],
                         dim=1).tolist()  # the one device-to-host copy of the step
        width = result.emitted.shape[1]
        for j, (s, row) in enumerate(zip(entries, host)):
            m = row[0]
            emitted = row[1:1 + m]
            nodes = torch.tensor(row[1 + width:1 + width + m], device=runner.device)
            tokens[index[j]] = emitted
            computed[index[j]] = m
            extend.append((s, emitted, feats[j].index_select(0, nodes)))
            self._count(s.request, m - 1, n - 1)

    def _verify(self, tree: DraftTree, logits: torch.Tensor, st: SamplingTensors,
                root_pos: torch.Tensor) -> VerifyResult:
        if self.spec.synthetic_accept_len:
            return synthetic_accept(tree, self.spec.synthetic_accept_len, logits)
        if st.all_greedy:
            return walk_tree(tree, logits.argmax(dim=-1))
        bs, n, v = logits.shape
        probs = probs_from_logits(logits.view(bs * n, v), st.repeat_interleave(n)).view(bs, n, v)
        uniforms = uniform_noise(st.seeds, root_pos, n, ACCEPT_SALT)
        return verify(tree, probs, uniforms)

    def _compact_kv(self, result: VerifyResult, page_table: torch.Tensor,
                    root_pos: torch.Tensor) -> None:
        """Move the accepted nodes' target K/V from P + node to P + depth (no host sync)."""
        nodes = result.accepted_nodes  # [bs, w], -1 padded
        depth = torch.arange(nodes.shape[1], device=nodes.device).expand_as(nodes)
        src_pos = root_pos[:, None] + torch.where(nodes >= 0, nodes, depth)
        dst_pos = root_pos[:, None] + depth
        ps = self.runner.page_size

        def slots(pos: torch.Tensor) -> torch.Tensor:
            return (page_table.long().gather(1, pos // ps) * ps + pos % ps).flatten()

        src, dst = slots(src_pos), slots(dst_pos)
        for layer in self.runner.attn_layers:
            for cache in (layer.k_cache, layer.v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]

    def _count(self, req, accepted: int, proposed: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        req.record_spec_cycle(proposed, accepted)
        for d in range(accepted):
            c.accepted_per_pos[d] += 1

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, entries: list[ScheduledRequest], roots: list[int]) -> DraftTree:
        """Draft a tree per request from its stored draft output (num_steps - 1 forwards)."""
        head, k, runner = self.head, self.k, self.runner
        bs = len(entries)
        out = torch.stack([self.last_out[s.request.request_id] for s in entries])  # [bs, H]
        logp, draft_ids = head.compute_logits(out).log_softmax(-1).topk(k, dim=-1)
        acc = TreeAccumulator(logp, draft_ids, self.d2t)
        parent_out = out[:, None, :].expand(bs, k, out.shape[-1])  # [bs, k, H]
        pages = [s.request.page_ids for s in entries]
        for s in range(1, self.num_steps):
            path = acc.frontier_path  # [bs, k, s]: ancestor slot per generation, own slot last
            mask = torch.zeros(bs, k, s * k, dtype=torch.bool, device=runner.device)
            cols = torch.arange(s, device=runner.device) * k + path  # [bs, k, s]
            mask.scatter_(2, cols, True)
            md = build_attention_metadata([k] * bs, [p + s * k for p in roots], pages,
                                          runner.page_size, runner.device, custom_mask=mask)
            positions = torch.tensor(roots, device=runner.device)[:, None] + (s - 1)
            ids = acc.frontier_tokens  # [bs, k] target ids
            y = self._draft_forward(ids.flatten(), positions.expand(bs, k).flatten(),
                                    parent_out.reshape(bs * k, -1), md).view(bs, k, -1)
            child_logp, child_ids = head.compute_logits(y.flatten(0, 1)).log_softmax(-1).topk(
                k, dim=-1)
            acc.extend(child_logp.view(bs, k, k), child_ids.view(bs, k, k))
            # each new frontier slot continues from its parent's output
            parent_out = y.gather(1, acc.frontier_path[:, :, -2:-1].expand(-1, -1, y.shape[-1]))
        root_tokens = torch.tensor([s.request.all_token_ids[-1] for s in entries],
                                   device=runner.device)
        return acc.build(root_tokens, self.n)

    def _draft_forward(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor,
                       md) -> torch.Tensor:
        set_forward_context(ForwardContext(md, self.runner.backend))
        try:
            return self.head(ids, positions, g)
        finally:
            set_forward_context(None)

    def _draft_extend(self, items: list[tuple[ScheduledRequest, list[int], torch.Tensor]]) -> None:
        """Extend the draft KV over new target positions [start, start + m) with pairs
        (feature f_i, token t_{i+1}); remember each request's last output."""
        runner = self.runner
        q_lens = [len(nxt) for _, nxt, _ in items]
        starts = [s.start for s, _, _ in items]
        md = build_attention_metadata(q_lens, [a + q for a, q in zip(starts, q_lens)],
                                      [s.request.page_ids for s, _, _ in items],
                                      runner.page_size, runner.device)
        ids = torch.tensor([t for _, nxt, _ in items for t in nxt], device=runner.device)
        positions = torch.tensor([a + i for a, q in zip(starts, q_lens) for i in range(q)],
                                 device=runner.device)
        feats = torch.cat([f for _, _, f in items])
        y = self._draft_forward(ids, positions, feats, md)
        ends = torch.tensor(q_lens, device=runner.device).cumsum(0) - 1
        last = y.index_select(0, ends)
        for (s, _, _), row, q in zip(items, last, q_lens):
            self.last_out[s.request.request_id] = row
            self.draft_len[s.request.request_id] = s.start + q
