"""Lossless verification of a draft tree, greedy and sampled requests by one rule.

Rule at a node with target distribution p and children c_1..c_m (deterministic draft picks):
try c_1, accept with probability p(c_1); on rejection set p(c_1) = 0, renormalise, try c_2;
...; if all are rejected, emit a token from the residual p; at a leaf, emit a bonus from p.
Child c_i ends up accepted with probability exactly p(c_i), and the residual token x (not a
child) is emitted with probability p(x). So the walk is the same as: draw x ~ p at the node;
if x is a child, accept it and descend, else emit x and stop. Every emitted token therefore has
the target's distribution. Each node is visited at most once, so one independent draw per node,
made up front for all nodes, serves the whole walk. Greedy rows have one-hot p: x = argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the draw (inverse CDF at a uniform keyed by seed and position) is the sampler's, so a token
# is the same whichever path decides it: plain sampling, a prefill, or a verify node
from specserve.layers.sampler import sample_per_node
from specserve.speculative.tree import DraftTree


@dataclass
class VerifyResult:
    """Small per-request outcome; the caller copies it to the host once."""

    accepted_nodes: torch.Tensor  # [bs, max_depth + 1] node ids of the accepted path, root first
    num_accepted: torch.Tensor  # [bs] draft tokens accepted (root excluded)
    emitted: torch.Tensor  # [bs, max_depth + 1] accepted draft tokens then the bonus, -1 padded
    num_emitted: torch.Tensor  # [bs] = num_accepted + 1
    # [bs] what a chain of the same drafter would have accepted, for the adaptive policy: see
    # chain_runs (None until the cycle computes it)
    chain_run: torch.Tensor | None = None


def walk_tree(
    tree: DraftTree, target_tokens: torch.Tensor, max_accept: int | torch.Tensor | None = None
) -> VerifyResult:
    """Accept the path of children that match the target's token at each node.

    target_tokens [bs, n]: the token the target emits after node i (its draw or argmax).
    Stops after max_accept accepted nodes when given. The walk descends from each node to
    its first child carrying the target's token; that is computed for all nodes at once (a
    node is on the walk iff every node of its root path is such a child), in a few dozen
    fixed-shape kernels with no loop and no host sync.
    """
    bs, n = tree.tokens.shape
    width = tree.max_depth + 1
    if max_accept is None:
        limit = tree.max_depth
    elif isinstance(max_accept, torch.Tensor):  # [bs] per row
        limit = max_accept.clamp(max=tree.max_depth)[:, None]
    else:
        limit = min(max_accept, tree.max_depth)
    x = target_tokens.long()
    parents, tokens = tree.parents, tree.tokens
    idx = torch.arange(n, device=tokens.device)
    hit = tokens == x.gather(1, parents.clamp(min=0))  # [bs, n] the token after its parent
    # an earlier sibling with the same token takes the walk instead
    earlier_twin = ((parents[:, :, None] == parents[:, None, :])
                    & (tokens[:, :, None] == tokens[:, None, :])
                    & (idx[None, None, :] < idx[None, :, None])).any(dim=2)  # [bs, n]
    step_ok = ((hit & ~earlier_twin) | (parents < 0)) & (tree.depth <= limit)
    on_walk = ~(tree.mask & ~step_ok[:, None, :]).any(dim=2)  # [bs, n] whole root path ok
    last = torch.where(on_walk, tree.depth, -1).argmax(dim=1)  # [bs] deepest node walked
    num_accepted = tree.depth.gather(1, last[:, None]).squeeze(1)
    path = tree.mask.gather(1, last[:, None, None].expand(-1, 1, n)).squeeze(1)  # [bs, n]
    column = torch.where(path, tree.depth, width)  # path node -> its depth, others dumped
    accepted = torch.full((bs, width + 1), -1, dtype=torch.int64, device=tokens.device)
    accepted = accepted.scatter(1, column, idx.expand(bs, n))[:, :width]
    emitted = torch.where(accepted >= 0, x.gather(1, accepted.clamp(min=0)), -1)
    return VerifyResult(accepted, num_accepted, emitted, num_accepted + 1)


def verify(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor) -> VerifyResult:
    """Verify a batch of trees: probs [bs, n, V], uniforms [bs, n] in (0, 1).

    probs[b, i] is the target's distribution after node i under request b's sampling transform
    (probs_from_logits on the [bs * n, V] logits with SamplingTensors.repeat_interleave(n): a
    one-hot argmax for greedy rows). uniforms[b, i] drives the draw at node i: the engine
    passes token_uniforms(seeds, tree.positions(root) + 1), one draw per decided position.
    """
    assert probs.shape[:2] == tree.tokens.shape and uniforms.shape == tree.tokens.shape
    return walk_tree(tree, sample_per_node(probs, uniforms))


def chain_runs(tree: DraftTree, accepted_nodes: torch.Tensor) -> torch.Tensor:
    """[bs] what a chain of the same drafter would have accepted in this tree's cycle, 2 r + o.

    The chain drafts each depth's top-scored child of the node before (the tree's greedy
    path, same tokens); verification draws one target token per node, keyed by its position,
    so a chain accepts exactly the accepted path's leading greedy-path nodes: r of them. o is
    1 when the chain's next depth went untested (its greedy child was pruned from the tree, or
    the tree ended), so r is a lower bound; else the chain rejects depth r + 1."""
    bs, n = tree.tokens.shape
    idx = torch.arange(n, device=tree.tokens.device)
    is_child = tree.parents[:, None, :] == idx[None, :, None]  # [bs, i, j]: j a child of i
    best = torch.where(is_child, tree.scores[:, None, :], float("-inf")).argmax(dim=2)
    top = torch.where(is_child.any(dim=2), best, -1)  # [bs, n] greedy child of each node
    node = torch.zeros(bs, dtype=torch.long, device=idx.device)
    run = torch.zeros_like(node)
    alive = torch.ones(bs, dtype=torch.bool, device=idx.device)
    untested = torch.zeros_like(alive)
    for d in range(1, min(tree.max_depth, accepted_nodes.shape[1] - 1) + 1):
        child = top.gather(1, node[:, None]).squeeze(1)
        untested |= alive & (child < 0)
        alive = alive & (child >= 0) & (accepted_nodes[:, d] == child)
        run += alive.long()
        node = torch.where(alive, child, node)
    return 2 * run + (untested | alive).long()


def _deepest_path(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """The path from the root to the first node of maximal depth: is_child [bs, n, n]
    (is_child[b, i, j]: j is the path child of i) and has_child [bs, n]."""
    n = tree.num_nodes
    node_ids = torch.arange(n, device=tree.tokens.device)
    deepest = (tree.depth * (n + 1) - node_ids).argmax(dim=1)  # [bs] first node of max depth
    on_path = tree.mask.gather(1, deepest[:, None, None].expand(-1, 1, n)).squeeze(1)  # [bs, n]
    is_child = (tree.parents[:, None, :] == node_ids[None, :, None]) & on_path[:, None, :]
    return is_child, is_child.any(dim=2)


def synthetic_accept(
    tree: DraftTree, accept_len: int | torch.Tensor, probs: torch.Tensor | None = None
) -> VerifyResult:
    """COST-ONLY benchmarking: accept accept_len - 1 nodes along the path to the deepest node
    (accept_len: one for all rows, or [bs]).

    The path leads from the root to the first node of maximal depth, so the forced accept
    length is reached whenever the tree is deep enough. The bonus is the target argmax at the
    last accepted node when probs [bs, n, V] are given, else that node's own token. Output is
    not the target's: never use it for real text.
    """
    if isinstance(accept_len, int) and accept_len < 1:
        raise ValueError(f"synthetic accept length must be >= 1, got {accept_len}")
    is_child, has_child = _deepest_path(tree)
    child_token = tree.tokens.gather(1, is_child.to(torch.int8).argmax(dim=2))
    bonus = tree.tokens if probs is None else probs.argmax(dim=-1)  # [bs, n]
    limit = accept_len[:, None] if isinstance(accept_len, torch.Tensor) else accept_len
    follow = has_child & (tree.depth < limit - 1)
    return walk_tree(tree, torch.where(follow, child_token, bonus), max_accept=accept_len - 1)


def synthetic_accept_lengths(tree: DraftTree, rates: torch.Tensor,
                             uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """COST-ONLY: random accept lengths [bs] along the deepest path. A path node with c
    children (candidates) passes to the next depth with probability 1 - (1 - rate)^c (each
    candidate accepted with the row's rate); uniforms [bs, >= max_depth] decide, one per depth;
    the walk stops at the first failure. rates [bs] in [0, 1]. Also the chain runs [bs]
    (2 r + o as chain_runs): a chain of the path's tokens passes a depth where its uniform is
    below the rate itself (one candidate), the same draws, so a chain never passes where the
    tree fails; o when it passed the whole path."""
    is_child, has_child = _deepest_path(tree)
    num_children = (tree.parents[:, None, :] == torch.arange(
        tree.num_nodes, device=tree.tokens.device)[None, :, None]).sum(dim=2)  # [bs, n]
    p_pass = 1.0 - (1.0 - rates[:, None].float()) ** num_children.float()  # [bs, n]
    depth = tree.depth.clamp(max=uniforms.shape[1] - 1)
    ok = uniforms.gather(1, depth) < p_pass  # [bs, n] the node's path child is accepted
    # a path node at depth d counts iff it has a path child and it and every path ancestor pass
    step = torch.where(has_child, ok, False)
    on_path = has_child | is_child.any(dim=1)
    blocked = (tree.mask & (on_path & ~step)[:, None, :]).any(dim=2)  # [bs, n] a failed ancestor
    passed = on_path & has_child & ~blocked
    chain_step = torch.where(has_child, uniforms.gather(1, depth) < rates[:, None].float(), False)
    chain_blocked = (tree.mask & (on_path & ~chain_step)[:, None, :]).any(dim=2)
    run = (on_path & has_child & ~chain_blocked).sum(dim=1)
    whole = run == (on_path & has_child).sum(dim=1)
    return 1 + passed.sum(dim=1), 2 * run + whole.long()
