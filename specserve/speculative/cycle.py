"""One speculative decode cycle as a device-only function of batch-major tensors.

    draft loop (num_steps - 1 head forwards) -> tree -> verify forward (target, tree mask)
    -> acceptance (greedy walk, lossless sampling, or synthetic) -> KV compaction (tree)
    -> draft extend over the emitted tokens -> the head's next last output

Every shape is fixed by (bs, topk, num_steps, num_draft_tokens) and no value goes to the host,
so the whole cycle is captured as one CUDA graph per batch bucket (worker/cuda_graph.py); on
the CPU the same function runs eagerly. Rows with valid == False are graph padding: they
write no KV anywhere. Positions are explained in speculative/eagle3.py.
"""

from __future__ import annotations

import torch

from specserve.kernels.kv_compact import compact_kv
from specserve.kernels.topk import top_log_probs
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.sampler import (
    ACCEPT_SALT,
    SamplingTensors,
    probs_from_logits,
    uniform_noise,
)
from specserve.speculative.tree import DraftTree, TreeAccumulator
from specserve.speculative.verify import VerifyResult, synthetic_accept, verify, walk_tree

MODES = ("greedy", "sample", "synthetic")


class SpecCycle:
    def __init__(self, drafter) -> None:  # drafter: Eagle3Drafter
        self.drafter = drafter
        self.runner = drafter.runner
        self.head = drafter.head
        self.k, self.num_steps, self.n = drafter.k, drafter.num_steps, drafter.n

    # -- helpers -------------------------------------------------------------------------------
    def _slots(self, page_table: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """[bs, q] positions -> [bs, q] KV slots through the page table; -1 (write nothing) on
        invalid rows when `valid` is given. Padding rows' page tables point at the pool's
        spare page, so even their reads stay off real requests' pages."""
        ps = self.runner.page_size
        slots = page_table.long().gather(1, pos // ps) * ps + pos % ps
        return slots if valid is None else torch.where(valid[:, None], slots, -1)

    def _head(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor, md) -> torch.Tensor:
        set_forward_context(ForwardContext(md, self.runner.backend))
        try:
            return self.head(ids, positions, g)
        finally:
            set_forward_context(None)

    # -- the cycle -----------------------------------------------------------------------------
    def run(self, mode: str, last_out: torch.Tensor, root_pos: torch.Tensor,
            root_tokens: torch.Tensor, page_table: torch.Tensor, valid: torch.Tensor,
            st: SamplingTensors) -> tuple[torch.Tensor, ...]:
        """last_out [bs, H] (the head's output at P-1); root_pos [bs] = P; root_tokens [bs];
        page_table [bs, max_pages]; valid [bs]. Returns emitted [bs, W] (-1 padded),
        num_emitted [bs] and the head's new last output [bs, H]."""
        tree = self.propose(last_out, root_pos, root_tokens, page_table, valid)
        # KV slots of positions P .. P + lookahead (every slot the cycle writes past P), once
        span = torch.arange(self.drafter.lookahead + 1, device=root_pos.device)
        window = self._slots(page_table, root_pos[:, None] + span)  # [bs, L]
        result, feats = self.verify(mode, tree, root_pos, page_table, valid, st, window)
        if self.k > 1:
            self.compact_kv(result, window, valid)
        new_last = self.extend(result, feats, root_pos, page_table, valid, window)
        return result.emitted, result.num_emitted, new_last

    def propose(self, last_out: torch.Tensor, root_pos: torch.Tensor, root_tokens: torch.Tensor,
                page_table: torch.Tensor, valid: torch.Tensor) -> DraftTree:
        """The EAGLE-2 tree from the head's last output: num_steps - 1 head forwards; step s
        writes its k scratch K/V at positions P + (s-1)k .. P + sk - 1 of the draft layer and
        each query sees the draft prefix plus its ancestors among the scratch."""
        head, k, runner = self.head, self.k, self.runner
        bs, hidden = last_out.shape
        scratch_span = torch.arange(max(self.num_steps - 1, 1) * k, device=last_out.device)
        scratch_slots = self._slots(page_table, root_pos[:, None] + scratch_span, valid)
        logp, draft_ids = top_log_probs(head.compute_logits(last_out), k)
        acc = TreeAccumulator(logp, draft_ids, self.drafter.d2t)
        parent_out = last_out[:, None, :].expand(bs, k, hidden)  # [bs, k, H]
        for s in range(1, self.num_steps):
            cols = torch.arange(s, device=last_out.device) * k + acc.frontier_path  # [bs, k, s]
            mask = torch.zeros(bs, k, s * k, dtype=torch.bool, device=last_out.device)
            mask.scatter_(2, cols, True)
            scratch = scratch_slots[:, (s - 1) * k:s * k]  # slots of P + (s-1)k .. P + sk - 1
            md = runner.graph_metadata(scratch.contiguous(), (root_pos + s * k).int(),
                                       page_table, k, mask)
            positions = (root_pos + s - 1)[:, None].expand(bs, k)
            y = self._head(acc.frontier_tokens.reshape(-1), positions.reshape(-1),
                           parent_out.reshape(bs * k, hidden), md).view(bs, k, hidden)
            child_logp, child_ids = top_log_probs(head.compute_logits(y.flatten(0, 1)), k)
            acc.extend(child_logp.view(bs, k, k), child_ids.view(bs, k, k))
            # each new frontier slot continues from its parent's output
            parent = acc.frontier_path[:, :, -2:-1].expand(-1, -1, hidden)
            parent_out = y.gather(1, parent)
        return acc.build(root_tokens, self.n)

    def verify(self, mode: str, tree: DraftTree, root_pos: torch.Tensor,
               page_table: torch.Tensor, valid: torch.Tensor, st: SamplingTensors,
               window: torch.Tensor) -> tuple[VerifyResult, torch.Tensor]:
        """Target forward over the n tree nodes (node i at slot P + i, RoPE position
        P + depth, the ancestor mask), then acceptance. Returns the result and the aux
        features of every node [bs, n, 3H]."""
        runner, capture = self.runner, self.drafter.capture
        bs, n = tree.tokens.shape
        slots = torch.where(valid[:, None], window[:, :n], -1)
        md = runner.graph_metadata(slots, (root_pos + n).int(), page_table, n, tree.mask)
        capture.enable()
        hidden = runner.forward(tree.tokens.reshape(-1), tree.positions(root_pos).reshape(-1),
                                md)
        feats = capture.pop().view(bs, n, -1)
        capture.disable()
        logits = runner.compute_logits(hidden).view(bs, n, -1)  # [bs, n, V]
        if mode == "synthetic":
            return synthetic_accept(tree, self.drafter.spec.synthetic_accept_len, logits), feats
        if mode == "greedy":
            return walk_tree(tree, logits.argmax(dim=-1)), feats
        v = logits.shape[-1]
        probs = probs_from_logits(logits.view(bs * n, v), st.repeat_interleave(n)).view(bs, n, v)
        uniforms = uniform_noise(st.seeds, root_pos, n, ACCEPT_SALT)
        return verify(tree, probs, uniforms), feats

    def compact_kv(self, result: VerifyResult, window: torch.Tensor, valid: torch.Tensor) -> None:
        """Move the accepted nodes' target K/V from P + node to P + depth (fixed shapes: rows
        and path entries with nothing to move copy a slot onto itself). window [bs, L]: the
        slots of P .. P + L - 1."""
        nodes = result.accepted_nodes  # [bs, w], -1 padded
        w = nodes.shape[1]
        depth = torch.arange(w, device=nodes.device).expand_as(nodes)
        keep = (nodes >= 0) & valid[:, None]
        src = window.gather(1, torch.where(keep, nodes, depth))
        dst = window[:, :w].contiguous()
        pool, layers = self.runner.kv_pool, len(self.runner.attn_layers)
        # every target layer: one launch per pool group (llama: k and v of all target layers;
        # MLA: the latent of all target layers), never the draft layers after them
        for group, num in pool.groups_below(layers):
            compact_kv(list(group.tensors.values()), num, src, dst)

    def extend(self, result: VerifyResult, feats: torch.Tensor, root_pos: torch.Tensor,
               page_table: torch.Tensor, valid: torch.Tensor,
               window: torch.Tensor) -> torch.Tensor:
        """Draft KV over the emitted tokens: pairs (feature of accepted node j, emitted token j)
        at positions P + j, padded to W tokens per request (padding writes nothing)."""
        bs, w = result.emitted.shape
        hidden = self.head.config.hidden_size
        j = torch.arange(w, device=root_pos.device)
        pos = root_pos[:, None] + j  # [bs, W]
        live = valid[:, None] & (j[None, :] < result.num_emitted[:, None])
        slots = torch.where(live, window[:, :w], -1)
        md = self.runner.graph_metadata(slots, (root_pos + w).int(), page_table, w)
        nodes = result.accepted_nodes.clamp(min=0)
        f = feats.gather(1, nodes[:, :, None].expand(-1, -1, feats.shape[-1]))  # [bs, W, 3H]
        y = self._head(result.emitted.clamp(min=0).reshape(-1), pos.reshape(-1),
                       f.reshape(bs * w, -1), md).view(bs, w, hidden)
        last = (result.num_emitted - 1).clamp(min=0)[:, None, None].expand(-1, 1, hidden)
        return y.gather(1, last).squeeze(1)
