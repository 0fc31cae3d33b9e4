"""The drafter ("proposer") protocol: what the speculative worker needs from any drafter.

The worker (speculative/worker.py) owns everything that is the same for every drafter:
target prefill, the verify forward, acceptance, KV compaction, the per-request draft
bookkeeping, overlap and CUDA graphs. A proposer only drafts:

    propose          state + roots -> a DraftTree (a chain is topk 1); device only, so the
                     worker can capture it inside the cycle's graph
    extend_accepted  after acceptance, inside the cycle: fold the emitted tokens (and the
                     target's features of the accepted nodes) into the draft state
    extend           outside the cycle: fold target positions [start, start + m) into the
                     draft state (prefill chunks; catch-up after plain steps)
    release          drop host-side per-request state (the worker's own bookkeeping and the
                     draft KV in the request's pages need nothing from the proposer)

Per-request draft state is a fixed-width row [state_dim] the worker keeps per request id and
hands back batched (EAGLE-3: the head's last output; 0 wide for a proposer with none), plus
whatever the proposer writes into its own KV layers of the pool at the request's positions.
A proposer with `keeps_state` False has nothing to extend: the worker never feeds it
prefills and any decode may speculate. One with `keeps_state` True covers a prefix of the
request's positions; the worker records the tokens a plain step runs past that prefix and,
before the row speculates again, catches the proposer up over them (`extend` with the
target's features recomputed by a forward that writes no KV).

Prefix caching shares KV pages between requests, draft layers included. A proposer with state
names what its layers hold in `prefix_cache_key` (equal keys: equal draft KV for equal
tokens, e.g. the head's checkpoint and aux layers), and must keep all its per-request state in
the pages plus the state row, so a request admitted on a cached prefix is restored by extending
from the prefix's end. Without the attribute (or None) the engine turns prefix caching off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.spec_config import max_tree_nodes, mode_name, parse_mode
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import VerifyResult


@dataclass(frozen=True)
class DraftShape:
    """The fixed shape of one speculative cycle: graphs are captured per shape."""

    topk: int  # branching factor: 1 = chain
    num_steps: int  # draft depth
    num_draft_tokens: int  # nodes verified, the root included

    def __post_init__(self) -> None:
        if self.topk < 1 or self.num_steps < 1:
            raise ValueError("--spec-topk and --spec-num-steps must be >= 1")
        max_nodes = max_tree_nodes(self.num_steps, self.topk)
        if not 2 <= self.num_draft_tokens <= max_nodes:
            raise ValueError(
                f"--spec-num-draft-tokens must be in [2, {max_nodes}] for topk {self.topk} "
                f"and {self.num_steps} steps, got {self.num_draft_tokens}"
            )

    @property
    def width(self) -> int:
        """Most tokens one cycle emits (the accepted path plus the bonus)."""
        return self.num_steps + 1

    @property
    def name(self) -> str:
        return mode_name(self.topk, self.num_steps, self.num_draft_tokens)

    @classmethod
    def parse(cls, name: str) -> DraftShape:
        """The inverse of `name`."""
        return cls(*parse_mode(name))

    @classmethod
    def from_config(cls, spec) -> DraftShape:  # spec: SpecConfig
        return cls(spec.topk, spec.num_steps, spec.verify_tokens)


def draft_shapes(spec) -> list[DraftShape]:  # spec: SpecConfig
    """The configured shape first, then the other modes a policy may choose (spec.modes)."""
    shapes = [DraftShape.from_config(spec)]
    for name in spec.mode_names:
        if DraftShape.parse(name) not in shapes:
            shapes.append(DraftShape.parse(name))
    return shapes


class Proposer(Protocol):
    needs_target_features: bool  # the worker captures aux hidden states in target forwards
    aux_layer_ids: tuple[int, ...]  # where (decoder-layer inputs), when it does
    keeps_state: bool  # covers a prefix of each request's positions (see module docstring)
    state_dim: int  # width of the per-request state row
    state_dtype: torch.dtype
    num_kv_layers: int  # layers of its own in the KV pool (bound after the target's)
    # what its KV layers hold, for prefix-cache keys (optional; see the module docstring)
    prefix_cache_key: str | None

    def scratch_slots(self, shape: DraftShape) -> int:
        """KV slots past the root that `propose` writes (its own layers only)."""
        ...

    def propose(
        self,
        shape: DraftShape,
        state: torch.Tensor,
        root_pos: torch.Tensor,
        root_tokens: torch.Tensor,
        page_table: torch.Tensor,
        valid: torch.Tensor,
    ) -> DraftTree:
        """state [bs, state_dim]; root_pos, root_tokens [bs]; page_table [bs, max_pages];
        valid [bs] (False: graph padding, writes nothing). A tree of shape.num_draft_tokens
        nodes of depth <= shape.num_steps whose root is root_tokens."""
        ...

    def extend_accepted(
        self,
        shape: DraftShape,
        result: VerifyResult,
        feats: torch.Tensor | None,
        root_pos: torch.Tensor,
        page_table: torch.Tensor,
        valid: torch.Tensor,
        window: torch.Tensor,
    ) -> torch.Tensor:
        """The new state [bs, state_dim] once result.emitted[:, :num_emitted] follow the
        root. feats [bs, n, F]: the target's features of every node (None unless
        needs_target_features); window [bs, L]: the KV slots of positions P .. P + L - 1."""
        ...

    def extend(
        self,
        starts: list[int],
        page_tables: list[list[int]],
        next_tokens: list[list[int]],
        feats: torch.Tensor | None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fold positions [starts[r], starts[r] + m_r) into each row's state, with
        next_tokens[r] the m_r tokens that follow them (t_{i+1} for position i), page_tables
        the rows' pages and feats [sum m_r, F] the target's features at those positions
        (None unless needs_target_features); last [bs] (device, optional): each row's final
        next token, which replaces the host's (a token sampled this step, not read yet).
        Returns each row's new state [bs, state_dim] (after its last position)."""
        ...

    def release(self, request_id: str) -> None:
        """Drop host-side state of a finished, aborted or preempted request."""
        ...
