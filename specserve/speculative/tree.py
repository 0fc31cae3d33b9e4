"""EAGLE-2 dynamic draft tree: frontier expansion per draft step, then the final top-scored tree.

Rule (batched over bs requests, k = topk; a chain is k = 1):
    step 0   the root's top-k draft tokens form the frontier; score = log p
    step s   each of the k frontier nodes gets its top-c children; child score = parent score +
             log p(child); the next frontier is the global top-k of the k * c children
    build    keep the best num_draft_tokens - 1 candidates of all steps plus the root

Candidates are numbered in the order they were produced (step, then frontier slot, then child).
Ranking sorts by score, descending, with ties going to the lower number. Because log p <= 0, a
child never outscores its parent, and the parent always has the lower number, so a kept child
always has its parent kept: the tree is connected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """The draft tokens of one cycle; node 0 is the root, parents come before children."""

    tokens: torch.Tensor  # [bs, n] int64 target-vocab ids
    parents: torch.Tensor  # [bs, n] int64 node index of the parent, -1 for the root
    depth: torch.Tensor  # [bs, n] int64, root 0; target position = root position + depth
    mask: torch.Tensor  # [bs, n, n] bool, mask[b, i, j] iff j is i or an ancestor of i
    scores: torch.Tensor  # [bs, n] float32 cumulative draft log-prob, root 0
    max_depth: int  # host bound on depth (verification loops this many times plus one)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def positions(self, root_positions: torch.Tensor) -> torch.Tensor:
        """[bs] position of each root -> [bs, n] positions of every node."""
        return root_positions[:, None] + self.depth


def map_draft_tokens(tokens: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocab ids -> target ids through the d2t offsets: target_id = i + d2t[i]."""
    return tokens if d2t is None else tokens + d2t[tokens]


def cumulative_scores(scores: torch.Tensor, child_logp: torch.Tensor) -> torch.Tensor:
    """[bs, k] parent scores + [bs, k, c] child log-probs -> [bs, k * c] child scores.

    log-probs are clamped to <= 0 so no child outscores its parent (connectivity rule).
    """
    return (scores[:, :, None] + child_logp.float().clamp(max=0.0)).flatten(1)


def top_stable(scores: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best m of [bs, C] scores, descending, ties to the lower index -> ([bs, m], [bs, m])."""
    values, index = scores.sort(dim=-1, descending=True, stable=True)
    return values[:, :m], index[:, :m]


def expand_frontier(
    scores: torch.Tensor, child_logp: torch.Tensor, child_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step: [bs, k] scores, [bs, k, c] children -> the next frontier of k nodes.

    Returns new_scores [bs, k], new_tokens [bs, k] and parent_slot [bs, k] (which frontier slot
    of the previous step each new node hangs from).
    """
    k, c = child_logp.shape[1], child_logp.shape[2]
    new_scores, flat = top_stable(cumulative_scores(scores, child_logp), k)  # [bs, k]
    return new_scores, child_tokens.flatten(1).gather(1, flat), flat // c


def _ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[bs, n] parents -> [bs, n, n] bool: j is i or an ancestor of i (walk up max_depth times)."""
    bs, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(bs, n, n).clone()
    anc = parents  # [bs, n] current ancestor of each node, -1 past the root
    for _ in range(max_depth):
        valid = anc >= 0
        idx = anc.clamp(min=0)[:, :, None]  # [bs, n, 1]
        mask.scatter_(2, idx, mask.gather(2, idx) | valid[:, :, None])
        anc = torch.where(valid, parents.gather(1, idx[:, :, 0]), anc)
    return mask


def build_tree(
    root_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_depth: torch.Tensor,
    num_draft_tokens: int,
    max_depth: int,
) -> DraftTree:
    """Keep the root plus the best num_draft_tokens - 1 candidates as a DraftTree.

    root_tokens [bs]; cand_scores / cand_tokens [bs, C]; cand_parents [bs, C] candidate index of
    the parent (-1 = root); cand_depth [C] (1 for the root's children). Kept nodes are laid out
    in candidate order, so parents precede children.
    """
    bs, num_cand = cand_scores.shape
    m = num_draft_tokens - 1
    if not 0 <= m <= num_cand:
        raise ValueError(
            f"num_draft_tokens must be between 1 and {num_cand + 1} for this tree "
            f"(1 + topk + (num_steps - 1) * topk**2), got {num_draft_tokens}"
        )
    device = cand_scores.device
    _, best = top_stable(cand_scores, m)
    sel = best.sort(dim=-1).values  # [bs, m] candidate index of node 1..m
    node_ids = torch.arange(1, m + 1, device=device).expand(bs, m)
    cand_to_node = torch.full((bs, num_cand), -1, dtype=torch.int64, device=device)
    cand_to_node.scatter_(1, sel, node_ids)  # [bs, C], -1 where not kept
    parent_cand = cand_parents.gather(1, sel)  # [bs, m]
    parent_node = torch.where(
        parent_cand < 0, 0, cand_to_node.gather(1, parent_cand.clamp(min=0))
    )  # [bs, m], never -1 by the connectivity rule

    minus_one = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    zeros = torch.zeros((bs, 1), dtype=torch.int64, device=device)
    parents = torch.cat([minus_one, parent_node], dim=1)  # [bs, n]
    depth = torch.cat([zeros, cand_depth[sel]], dim=1)  # [bs, n]
    max_depth = min(max_depth, m)
    return DraftTree(
        tokens=torch.cat([root_tokens.long()[:, None], cand_tokens.gather(1, sel)], dim=1),
        parents=parents,
        depth=depth,
        mask=_ancestor_mask(parents, max_depth),
        scores=torch.cat([zeros.float(), cand_scores.float().gather(1, sel)], dim=1),
        max_depth=max_depth,
    )


class TreeAccumulator:
    """Collects every draft step's candidates; the drafter feeds it and reads the frontier.

    frontier_tokens [bs, k] (target ids) are the inputs of the next draft forward.
    frontier_path [bs, k, g] gives, for each frontier slot, the slot of its ancestor in each of
    the g frontiers so far (its own slot last): the query of slot j at generation g - 1 sees the
    draft KV written for (t, frontier_path[:, j, t]) for every t < g.
    """

    def __init__(
        self, root_logp: torch.Tensor, root_draft_tokens: torch.Tensor, d2t: torch.Tensor | None
    ) -> None:
        bs, k = root_logp.shape
        device = root_logp.device
        self.width = k
        self.frontier_scores = root_logp.float().clamp(max=0.0)  # [bs, k]
        self.frontier_tokens = map_draft_tokens(root_draft_tokens, d2t).long()  # [bs, k]
        self._slots = torch.arange(k, device=device).expand(bs, k)
        self.frontier_index = self._slots  # [bs, k] candidate index of each frontier slot
        self.frontier_path = self._slots[:, :, None]  # [bs, k, 1]
        self.d2t = d2t
        self._scores = [self.frontier_scores]
        self._tokens = [self.frontier_tokens]
        self._parents = [torch.full((bs, k), -1, dtype=torch.int64, device=device)]
        self._depth = [torch.full((k,), 1, dtype=torch.int64, device=device)]
        self._num_cand = k
        self.num_steps = 1

    def extend(self, child_logp: torch.Tensor, child_tokens: torch.Tensor) -> None:
        """Record the [bs, k, c] children of the frontier and move to the next frontier."""
        k, c = child_logp.shape[1], child_logp.shape[2]
        assert k == self.width, "children must come for every frontier slot"
        tokens = map_draft_tokens(child_tokens, self.d2t).long().flatten(1)  # [bs, k * c]
        flat_scores = cumulative_scores(self.frontier_scores, child_logp)  # [bs, k * c]
        base = self._num_cand
        self._scores.append(flat_scores)
        self._tokens.append(tokens)
        self._parents.append(self.frontier_index.repeat_interleave(c, dim=1))
        self.num_steps += 1
        self._depth.append(torch.full((k * c,), self.num_steps, device=tokens.device))
        self._num_cand += k * c

        self.frontier_scores, flat = top_stable(flat_scores, k)  # [bs, k]
        parent_slot = flat // c  # [bs, k]
        self.frontier_tokens = tokens.gather(1, flat)
        self.frontier_index = base + flat
        path = self.frontier_path  # [bs, k, g]
        inherited = path.gather(1, parent_slot[:, :, None].expand(-1, -1, path.shape[2]))
        self.frontier_path = torch.cat([inherited, self._slots[:, :, None]], dim=2)

    def build(self, root_tokens: torch.Tensor, num_draft_tokens: int) -> DraftTree:
        """The final tree over [bs] root tokens with num_draft_tokens nodes, the root included."""
        return build_tree(
            root_tokens,
            torch.cat(self._scores, dim=1),
            torch.cat(self._tokens, dim=1),
            torch.cat(self._parents, dim=1),
            torch.cat(self._depth),
            num_draft_tokens,
            self.num_steps,
        )
