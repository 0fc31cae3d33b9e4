"""Suffix decoding (method "suffix"): a frequency-scored draft tree built on the host.

Per request a `SequenceIndex` over the tokens the worker has seen of it (prompt chunks, the
tokens it emitted) and one `OutputCache` over the outputs of recently finished requests
(speculative/suffix_index.py has the rule). Where the host work sits, per step:
  - before a cycle, `host_states` brings each speculating row's index up to its root, matches
    its last tokens and builds the tree: O(max_match_len) dict lookups, O(occurrences x depth)
    counting (occurrences capped at 64 per source) and a heap over the candidates;
  - the tree reaches the device as the rows' state (tokens and parents of the non-root nodes,
    [bs, 2 * (N - 1)] int64: the cycle's static input buffer under CUDA graphs), and `propose`
    only unpacks it (ancestor mask, depths) on the device;
  - after the step, `observe` appends every row's tokens (O(max_match_len) per token).
The tree for cycle N + 1 needs cycle N's tokens on the host, so this proposer cannot use
speculative overlap: the worker turns overlap off for it (`host_drafts`).

The history holds every token of the request: a request admitted on a cached prefix gets the
prefix's tokens in its first step (`StepInput.prefix_ids`, sent for host-history drafters
only: the engine builds them when the worker's proposer has `host_drafts`). Nothing lives in the KV pages (`keeps_state` False), so prefix
caching needs no key from it. Under tensor parallelism every rank builds the same trees (the
same inputs, deterministic).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.speculative.proposer import DraftShape, draft_shapes
from specserve.speculative.suffix_index import OutputCache, SequenceIndex, draft_tree, match
from specserve.speculative.tree import DraftTree, _ancestor_mask
from specserve.speculative.verify import VerifyResult
from specserve.worker.forward_batch import to_device
from specserve.worker.step_input import StepInput


class SuffixProposer:
    needs_target_features = False
    aux_layer_ids: tuple[int, ...] = ()
    keeps_state = False
    state_dtype = torch.long
    num_kv_layers = 0
    kv_specs: tuple = ()
    prefix_cache_key = None  # nothing in the pages (keeps_state False)
    host_drafts = True  # the worker fills the state rows from host_states, overlap off

    def __init__(self, spec, runner) -> None:  # spec: SpecConfig
        self.max_match_len, capacity, self.min_prob = spec.suffix_settings
        self.slots = max(s.num_draft_tokens for s in draft_shapes(spec)) - 1
        self.state_dim = 2 * self.slots  # node tokens, then node parents
        self.device = runner.device
        self.cache = OutputCache(self.max_match_len, capacity)
        self.requests: dict[str, SequenceIndex] = {}
        self.base: dict[str, int] = {}  # position of each index's first token
        self.output_start: dict[str, int] = {}  # position of each request's first output

    # -- host ----------------------------------------------------------------------------------
    def _put(self, rid: str, start: int, tokens: list[int]) -> None:
        """Tokens at positions start, start + 1, ...: appended past what the index knows
        (the request's earlier tokens are the same); a gap restarts the index there."""
        index = self.requests.get(rid)
        if index is None or start > self.base[rid] + len(index) or start < self.base[rid]:
            index = self.requests[rid] = SequenceIndex(self.max_match_len)
            self.base[rid] = start
        known = self.base[rid] + len(index) - start
        if len(tokens) > known:
            index.append(tokens[known:])

    def observe(self, step: StepInput, emitted: list[list[int]]) -> None:
        """After a step: row r ran its tokens at starts[r] .. and emitted[r] follow them."""
        starts, seq_lens = step.starts.tolist(), step.seq_lens.tolist()
        for r, rid in enumerate(step.request_ids):
            if step.prefix_counts[r]:  # admitted on a cached prefix: index it first
                self._put(rid, 0, step.prefix(r).tolist())
            self._put(rid, starts[r], step.tokens(r).tolist())
            if emitted[r]:
                self.output_start.setdefault(rid, seq_lens[r])
                self._put(rid, seq_lens[r], emitted[r])

    def tree_nodes(self, rid: str, shape: DraftShape) -> list[tuple[int, int]]:
        """The request's draft tree as (token, parent) nodes, padded to N - 1 nodes: filler
        children of the root repeat its first child (never accepted: an earlier twin takes
        the walk) or, with no match, the root token."""
        index = self.requests[rid]
        nodes = draft_tree(match(index, self.cache), shape.num_steps,
                           shape.num_draft_tokens - 1, shape.topk, self.min_prob)
        filler = (nodes[0][0] if nodes else index.tokens[-1], 0)
        return nodes + [filler] * (shape.num_draft_tokens - 1 - len(nodes))

    def host_states(self, shape: DraftShape, rows: StepInput) -> torch.Tensor:
        """The rows' trees packed as state rows [bs, 2 * slots] (tokens, parents), on the
        device: one host-to-device copy from pinned memory (a pageable one would first wait
        for every launch queued on the device)."""
        out = np.zeros((rows.bs, self.state_dim), dtype=np.int64)
        starts = rows.starts.tolist()
        for r, rid in enumerate(rows.request_ids):
            self._put(rid, starts[r], rows.tokens(r).tolist())  # the root
            nodes = self.tree_nodes(rid, shape)
            out[r, : len(nodes)] = [t for t, _ in nodes]
            out[r, self.slots : self.slots + len(nodes)] = [p for _, p in nodes]
        return to_device(out, torch.int64, self.device)  # pinned, no wait on the device

    def release(self, request_id: str) -> None:
        """A finished (or preempted) request's output joins the output cache (LRU, by id:
        a preempted request that finishes later replaces its entry)."""
        index = self.requests.pop(request_id, None)
        base = self.base.pop(request_id, 0)
        start = self.output_start.pop(request_id, None)
        if index is not None and start is not None and start >= base:
            self.cache.add(request_id, index.tokens[start - base :])

    # -- device (inside the cycle) -------------------------------------------------------------
    def scratch_slots(self, shape: DraftShape) -> int:
        return 0

    def propose(self, shape: DraftShape, state: torch.Tensor, root_pos: torch.Tensor,
                root_tokens: torch.Tensor, page_table: torch.Tensor,
                valid: torch.Tensor) -> DraftTree:
        """Unpack the host's tree: state [bs, 2 * slots] -> N nodes (padding rows' zeros are
        a valid tree: every node a child of the root)."""
        m, bs = shape.num_draft_tokens - 1, state.shape[0]
        tokens = torch.cat([root_tokens.long()[:, None], state[:, :m].long()], dim=1)
        root = torch.full((bs, 1), -1, dtype=torch.long, device=state.device)
        parents = torch.cat([root, state[:, self.slots : self.slots + m].long()], dim=1)
        max_depth = min(shape.num_steps, m)
        mask = _ancestor_mask(parents, max_depth)
        return DraftTree(tokens=tokens, parents=parents, depth=mask.sum(dim=2) - 1, mask=mask,
                         scores=torch.zeros(bs, m + 1, device=state.device),
                         max_depth=max_depth)

    def extend_accepted(self, shape: DraftShape, result: VerifyResult,
                        feats: torch.Tensor | None, root_pos: torch.Tensor,
                        page_table: torch.Tensor, valid: torch.Tensor,
                        window: torch.Tensor) -> torch.Tensor:
        # the next tree comes from the host (host_states); the state row carries nothing on
        return torch.zeros(root_pos.shape[0], self.state_dim, dtype=self.state_dtype,
                           device=root_pos.device)

    def extend(self, starts: list[int], page_tables: list[list[int]],
               next_tokens: list[list[int]], feats: torch.Tensor | None,
               last: torch.Tensor | None = None) -> torch.Tensor:
        raise AssertionError("a proposer without state is never fed")
