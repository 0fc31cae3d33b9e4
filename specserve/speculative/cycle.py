"""One speculative decode cycle as a device-only function of batch-major tensors.

    propose (the proposer's draft loop -> a tree) -> verify forward (target, tree mask)
    -> acceptance (greedy walk, lossless sampling, or synthetic) -> KV compaction (tree)
    -> extend_accepted (the proposer folds the emitted tokens into its state)

Every shape is fixed by (bs, DraftShape) and no value goes to the host, so the whole cycle is
captured as one CUDA graph per batch bucket (worker/cuda_graph.py); on the CPU the same
function runs eagerly. Rows with valid == False are graph padding: they write no KV anywhere.
Positions are explained in speculative/worker.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.kernels.kv_compact import compact_kv
from specserve.layers.attention_metadata import AttentionMetadata
from specserve.layers.logits_processor import LogitsProcess, token_logprobs
from specserve.layers.sampler import (
    SYNTHETIC_DRAW_SALT,
    SYNTHETIC_RATE_SALT,
    SamplingTensors,
    probs_from_logits,
    token_uniforms,
    uniform_noise,
)
from specserve.models.capture import AuxHiddenCapture
from specserve.speculative.proposer import DraftShape, Proposer
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import (
    VerifyResult,
    chain_runs,
    synthetic_accept,
    synthetic_accept_lengths,
    verify,
    walk_tree,
)

MODES = ("greedy", "sample", "synthetic")

# (tree, root positions [bs], the nodes' attention metadata) -> the target's final hidden
# states at the tree's nodes [bs * n, H] and, when the proposer reads them, its features there
# [bs, n, F]: a forward the caller runs over the nodes together with other rows (the prefill
# chunks of the cycle's step: one pass over the weights for both)
NodesForward = Callable[[DraftTree, torch.Tensor, AttentionMetadata],
                        tuple[torch.Tensor, torch.Tensor | None]]


def kv_slots(page_table: torch.Tensor, pos: torch.Tensor, page_size: int,
             valid: torch.Tensor | None = None) -> torch.Tensor:
    """[bs, q] positions -> [bs, q] KV slots through the page table; -1 (write nothing) on
    invalid rows when `valid` is given. Padding rows' page tables point at the pool's spare
    page, so even their reads stay off real requests' pages."""
    slots = page_table.long().gather(1, pos // page_size) * page_size + pos % page_size
    return slots if valid is None else torch.where(valid[:, None], slots, -1)


def _rate_params(a: float) -> list[float]:
    return [a, min(a, 1.0 - a)]


class SpecCycle:
    def __init__(self, runner, proposer: Proposer, shape: DraftShape, lookahead: int,
                 capture: AuxHiddenCapture | None, synthetic_accept_len: int = 0,
                 synthetic_accept_rate: float = 0.0) -> None:
        self.runner = runner  # ModelRunner
        self.proposer = proposer
        self.shape = shape
        self.lookahead = lookahead  # slots past the root the cycle may write
        self.capture = capture  # the target's aux hidden states, when the proposer needs them
        self.synthetic_accept_len = synthetic_accept_len
        self.synthetic_accept_rate = synthetic_accept_rate
        # (mean, half-width) of the per-request rates: a device tensor that captured graphs
        # read, so set_synthetic_accept_rate changes them without a recapture
        self.rate_params = (torch.tensor(_rate_params(synthetic_accept_rate),
                                         dtype=torch.float32, device=runner.device)
                            if synthetic_accept_rate else None)  # fmt: skip
        self.k, self.num_steps, self.n = shape.topk, shape.num_steps, shape.num_draft_tokens
        # a chain's nodes are a causal extend (node i at slot and position P + i). Under
        # invariant attention (exact mode or its attention alone) they go through the causal
        # launch, whose rows equal decodes of their tokens: the masked launch takes one query
        # a program there (a tree node reads its own path), 4x a chain's KV reads at bs 16-64.
        # Otherwise the masked launch, tuned for verify widths.
        cfg = runner.config
        self.causal_verify = self.k == 1 and bool(cfg.exact or cfg.exact_attention)

    def set_synthetic_accept_rate(self, rate: float) -> None:
        """A new mean for the random synthetic acceptance (cost benchmarks; the cycle must have
        been built with one)."""
        if self.rate_params is None or not 0.0 < rate < 1.0:
            raise ValueError(f"cannot set synthetic acceptance rate {rate}: built with "
                             f"{self.synthetic_accept_rate} (needs a rate in (0, 1) both)")
        self.synthetic_accept_rate = rate
        self.rate_params.copy_(torch.tensor(_rate_params(rate)))

    def run(self, mode: str, state: torch.Tensor, root_pos: torch.Tensor,
            root_tokens: torch.Tensor, page_table: torch.Tensor, valid: torch.Tensor,
            st: SamplingTensors, proc: LogitsProcess | None = None,
            logprobs_k: int = -1, forward: NodesForward | None = None
            ) -> tuple[torch.Tensor, ...]:
        """state [bs, S] (the proposer's state at P - 1); root_pos [bs] = P; root_tokens
        [bs]; page_table [bs, max_pages]; valid [bs]. Returns emitted [bs, W] (-1 padded),
        num_emitted [bs], the chain runs [bs] (a tree's: verify.chain_runs; a chain's own
        accepted count, 2 m) and the proposer's new state [bs, S]; with logprobs_k >= 0 also the
        emitted tokens' raw log-probs (chosen [bs, W], top values and ids [bs, W, k]), from
        the target's logits at the accepted path's nodes. proc: the rows' logits processing
        (eager cycles only); forward: the target forward over the nodes, when the caller runs
        it with more rows (eager cycles only, see NodesForward)."""
        tree = self.proposer.propose(self.shape, state, root_pos, root_tokens, page_table,
                                     valid)
        # KV slots of positions P .. P + lookahead (every slot the cycle writes past P), once
        span = torch.arange(self.lookahead + 1, device=root_pos.device)
        window = kv_slots(page_table, root_pos[:, None] + span, self.runner.page_size)
        result, feats, logits = self.verify(mode, tree, root_pos, page_table, valid, st,
                                            window, proc, forward)
        if self.k > 1:
            self.compact_kv(result, window, valid)
        new_state = self.proposer.extend_accepted(self.shape, result, feats, root_pos,
                                                  page_table, valid, window)
        chain = result.chain_run if result.chain_run is not None else 2 * result.num_accepted
        if logprobs_k < 0:
            return result.emitted, result.num_emitted, chain, new_state
        nodes = result.accepted_nodes.clamp(min=0)  # [bs, W]: node that decided each token
        at = logits.gather(1, nodes[:, :, None].expand(-1, -1, logits.shape[-1]))
        return (result.emitted, result.num_emitted, chain, new_state,
                *token_logprobs(at, result.emitted, logprobs_k))

    def verify(self, mode: str, tree: DraftTree, root_pos: torch.Tensor,
               page_table: torch.Tensor, valid: torch.Tensor, st: SamplingTensors,
               window: torch.Tensor, proc: LogitsProcess | None = None,
               forward: NodesForward | None = None
               ) -> tuple[VerifyResult, torch.Tensor | None, torch.Tensor]:
        """Target forward over the n tree nodes (node i at slot P + i, RoPE position
        P + depth, the ancestor mask), then acceptance. Returns the result, the aux
        features of every node [bs, n, F] when the proposer needs them, and the raw logits
        [bs, n, V]. With proc, node i's distribution is processed as if the draft tokens on
        its path were already generated (LogitsProcess.for_tree): lossless for penalties,
        min_tokens and logit_bias alike."""
        runner, capture = self.runner, self.capture
        bs, n = tree.tokens.shape
        slots = torch.where(valid[:, None], window[:, :n], -1)
        md = runner.graph_metadata(slots, (root_pos + n).int(), page_table, n,
                                   None if self.causal_verify else tree.mask)
        if forward is not None:
            hidden, feats = forward(tree, root_pos, md)
        else:
            if capture is not None:
                capture.enable()
            hidden = runner.forward(tree.tokens.reshape(-1),
                                    tree.positions(root_pos).reshape(-1), md)
            feats = None
            if capture is not None:
                feats = capture.pop().view(bs, n, -1)
                capture.disable()
        raw = runner.compute_logits(hidden).view(bs, n, -1)  # [bs, n, V]
        v = raw.shape[-1]
        logits = raw
        if proc is not None and mode != "synthetic":
            logits = proc.for_tree(tree.tokens, tree.mask, tree.depth).apply(
                raw.view(bs * n, v)).view(bs, n, v)
        if mode == "synthetic":
            lengths, chain = self._synthetic_lengths(tree, st, root_pos)
            result = synthetic_accept(tree, lengths, logits)
            if chain is None:  # a fixed length: a chain accepts as many, unless deeper
                acc = result.num_accepted
                chain = 2 * acc + (acc >= tree.depth.amax(dim=1)).long()
            result.chain_run = chain
            return result, feats, raw
        if mode == "greedy":
            result = walk_tree(tree, logits.argmax(dim=-1))
        else:
            probs = probs_from_logits(logits.view(bs * n, v),
                                      st.repeat_interleave(n)).view(bs, n, v)
            # node i decides the token at its position + 1: the draw is keyed by that position
            uniforms = token_uniforms(st.seeds, tree.positions(root_pos) + 1)
            result = verify(tree, probs, uniforms)
        if self.shape.topk > 1:
            result.chain_run = chain_runs(tree, result.accepted_nodes)
        return result, feats, raw

    def _synthetic_lengths(self, tree: DraftTree, st: SamplingTensors,
                           root_pos: torch.Tensor
                           ) -> tuple[int | torch.Tensor, torch.Tensor | None]:
        """COST-ONLY accept lengths: the fixed one, or random: request r's acceptance rate
        is uniform on [a - d, a + d] (a the configured mean, d = min(a, 1 - a)), keyed by its
        seed; each cycle's draws are keyed by (seed, root position). Also the random chain
        runs (synthetic_accept_lengths; None for the fixed length)."""
        if self.rate_params is None:
            return self.synthetic_accept_len, None
        u = uniform_noise(st.seeds, torch.zeros_like(st.seeds), 1, SYNTHETIC_RATE_SALT)[:, 0]
        rates = self.rate_params[0] + (2.0 * u - 1.0) * self.rate_params[1]  # [bs]
        draws = uniform_noise(st.seeds, root_pos, tree.max_depth + 1, SYNTHETIC_DRAW_SALT)
        return synthetic_accept_lengths(tree, rates, draws)

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
