"""A speculative cycle's verify forward that also runs the step's prefill chunks.

A speculative step that carries prefill chunks would otherwise read the target's weights
twice: a forward over the chunks, then the cycle's verify forward over the draft nodes. Here
the chunks' tokens and the nodes go in one forward (chunks first), and its hidden states and
features are split between the cycle (nodes) and the worker (chunks: sampling, prompt
log-probs, feeding the drafters). For a chain (topk 1) a row's nodes are a causal extend
(node i at position P + i, its ancestors the nodes before it, its KV at slot P + i): one
causal attention over everything. For a tree, attention runs per range (SplitMetadata: the
chunks causal, the nodes under their ancestor mask) and every other layer once; only MHA/GQA
attention takes that, so MLA targets keep a tree's own verify forward.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.layers.attention_metadata import AttentionMetadata, SplitMetadata
from specserve.speculative.tree import DraftTree
from specserve.worker.forward_batch import BatchInputs, build_attention_metadata
from specserve.worker.step_input import StepInput
from specserve.worker.token_graphs import SampleRows, page_array


def takes_trees(runner) -> bool:
    """Every attention layer of the target takes a SplitMetadata (MHA/GQA): a tree's verify
    forward can carry chunks (MLA's keep their own forward for trees)."""
    return all(getattr(m, "takes_split", False) for m in runner.attn_layers)


class ChunksInVerify:
    """A NodesForward (speculative/cycle.py) over the chunk rows plus the cycle's nodes; after
    the call, `batch` (their sampling rows), `hidden` [T, H] and `feats` [T, F] (None:
    nothing captured) are the chunk rows' as the worker's own forward over them would give."""

    def __init__(self, runner, chunks: StepInput, decodes: StepInput, capture, view,
                 causal: bool) -> None:
        """chunks: the prefill rows; decodes: the cycle's rows, in its order; causal: one
        causal attention over chunks and nodes (the cycle's draft is a chain), else
        SplitMetadata (takes_trees(runner) must hold); capture: the worker's capture over
        every drafter's aux layers (None: none is needed, neither by the cycle nor to feed
        the chunks); view: the cycle's drafter's FeatureView over it (None: its proposer
        reads no features)."""
        self.runner, self.capture, self.view, self.causal = runner, capture, view, causal
        self.batch: BatchInputs | SampleRows | None = None  # the chunks' (after the call)
        self.chunks = chunks
        self.node_pages = decodes.page_lists()
        self.roots = decodes.starts.tolist()  # the cycle's root positions, on the host
        self.hidden: torch.Tensor | None = None
        self.feats: torch.Tensor | None = None

    def __call__(self, tree: DraftTree, root_pos: torch.Tensor, nodes_md: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        runner, chunks = self.runner, self.chunks
        bs, n = tree.tokens.shape
        if self.causal and (graphed := self._graphed(tree)) is not None:
            return graphed
        self.batch = runner.prepare(chunks)
        t = self.batch.input_ids.numel()
        if self.causal:  # a chain: one causal extend over chunks and nodes
            # (root_pos holds the same positions on the device: reading it here would stall
            # the host until the draft is done, before it launches the verify forward)
            roots = self.roots
            assert len(roots) == bs
            q_lens = chunks.num_new_tokens.tolist() + [n] * bs
            seq_lens = (chunks.starts + chunks.num_new_tokens).tolist() + [p + n for p in roots]
            # each decode row owns the pages of P .. P + n - 1 (the scheduler reserved them)
            assert len(self.node_pages) == bs
            pages = chunks.page_lists() + self.node_pages
            md = build_attention_metadata(q_lens, seq_lens, pages, runner.page_size,
                                          runner.device)
        else:  # attention per range, the nodes under their (ancestor) mask
            md = SplitMetadata([(0, t, self.batch.md), (t, t + bs * n, nodes_md)])
        ids = torch.cat([self.batch.input_ids, tree.tokens.reshape(-1)])
        positions = torch.cat([self.batch.positions, tree.positions(root_pos).reshape(-1)])
        if self.capture is not None:
            self.capture.enable()
        hidden = runner.forward(ids, positions, md)
        self.hidden = hidden[:t]
        feats = None
        if self.capture is not None:
            every = self.capture.pop()
            self.capture.disable()
            self.feats = every[:t]
            if self.view is not None:
                feats = self.view.select(every[t:]).view(bs, n, -1)
        return hidden[t:], feats

    def _graphed(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A chain's chunks + nodes through the runner's token graphs (the nodes' ids straight
        from the device), or None where none holds them. The chunk rows' hidden states and
        features are copied out of the graph's buffers (the worker reads them later)."""
        graphs = getattr(self.runner, "token_graphs", None)
        variant = "plain" if self.capture is None else "features"
        if graphs is None or not graphs.has(variant):
            return None
        chunks = self.chunks
        bs, n = tree.tokens.shape
        t = len(chunks.token_ids)
        roots = np.asarray(self.roots, dtype=np.int64)
        positions = np.concatenate([chunks.positions(), (roots[:, None] + np.arange(n)).ravel()])
        q_lens = np.concatenate([chunks.num_new_tokens, np.full(bs, n, dtype=np.int64)])
        seq_lens = np.concatenate([chunks.seq_lens, roots + n])
        table = page_array(chunks.page_lists() + self.node_pages, self.runner.spare_page)
        ids = np.concatenate([chunks.token_ids, np.zeros(bs * n, dtype=np.int64)])
        outs = graphs.run(ids, positions, q_lens, seq_lens, table, variant,
                          tail_ids=tree.tokens)
        if outs is None:
            return None
        self.batch = SampleRows.of(self.runner, chunks)
        hidden = outs[0]
        self.hidden = hidden[:t].clone()
        feats = None
        if self.capture is not None:
            every = outs[1]
            self.feats = every[:t].clone()
            if self.view is not None:
                feats = self.view.select(every[t:]).view(bs, n, -1)
        return hidden[t:], feats
