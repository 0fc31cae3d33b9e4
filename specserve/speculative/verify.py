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

from specserve.speculative.tree import DraftTree


@dataclass
class VerifyResult:
    """Small per-request outcome; the caller copies it to the host once."""

    accepted_nodes: torch.Tensor  # [bs, max_depth + 1] node ids of the accepted path, root first
    num_accepted: torch.Tensor  # [bs] draft tokens accepted (root excluded)
    emitted: torch.Tensor  # [bs, max_depth + 1] accepted draft tokens then the bonus, -1 padded
    num_emitted: torch.Tensor  # [bs] = num_accepted + 1


def sample_per_node(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: [..., V] probs and [...] uniforms in (0, 1) -> [...] int64 tokens.

    Picks the first token whose cumulative mass exceeds u * total; that token has p > 0, and a
    one-hot row always gives its hot index.
    """
    cdf = probs.float().cumsum(dim=-1)  # [..., V]
    target = (uniforms.float() * cdf[..., -1])[..., None]  # [..., 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def walk_tree(
    tree: DraftTree, target_tokens: torch.Tensor, max_accept: int | None = None
) -> VerifyResult:
    """Accept the path of children that match the target's token at each node.

    target_tokens [bs, n]: the token the target emits after node i (its draw or argmax).
    Stops after max_accept accepted nodes when given. Loops at most max_depth + 1 times on the
    device, with no host sync.
    """
    bs, device = tree.batch_size, tree.tokens.device
    width = tree.max_depth + 1
    accepted = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    accepted[:, 0] = 0
    emitted = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(bs, dtype=torch.int64, device=device)
    cur = torch.zeros(bs, dtype=torch.int64, device=device)  # current node
    alive = torch.ones(bs, dtype=torch.bool, device=device)  # still walking
    target_tokens = target_tokens.long()
    steps = tree.max_depth if max_accept is None else min(max_accept, tree.max_depth)
    for d in range(steps + 1):
        x = target_tokens.gather(1, cur[:, None])  # [bs, 1] token emitted after cur
        emitted[:, d] = torch.where(alive, x[:, 0], -1)
        if d == steps:
            break
        match = (tree.parents == cur[:, None]) & (tree.tokens == x)  # [bs, n] child == x
        found = alive & match.any(dim=1)
        child = match.to(torch.int8).argmax(dim=1)  # first matching child
        accepted[:, d + 1] = torch.where(found, child, -1)
        num_accepted += found.long()
        cur = torch.where(found, child, cur)
        alive = found
    return VerifyResult(accepted, num_accepted, emitted, num_accepted + 1)


def verify(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor) -> VerifyResult:
    """Verify a batch of trees: probs [bs, n, V], uniforms [bs, n] in (0, 1).

    probs[b, i] is the target's distribution after node i under request b's sampling transform
    (probs_from_logits on the [bs * n, V] logits with SamplingTensors.repeat_interleave(n): a
    one-hot argmax for greedy rows). uniforms[b, i] drives the draw at node i, e.g.
    uniform_noise(seeds, root_positions, n, ACCEPT_SALT).
    """
    assert probs.shape[:2] == tree.tokens.shape and uniforms.shape == tree.tokens.shape
    return walk_tree(tree, sample_per_node(probs, uniforms))


def synthetic_accept(
    tree: DraftTree, accept_len: int, probs: torch.Tensor | None = None
) -> VerifyResult:
    """COST-ONLY benchmarking: accept accept_len - 1 nodes along the path to the deepest node.

    The path leads from the root to the first node of maximal depth, so the forced accept
    length is reached whenever the tree is deep enough. The bonus is the target argmax at the
    last accepted node when probs [bs, n, V] are given, else that node's own token. Output is
    not the target's: never use it for real text.
    """
    if accept_len < 1:
        raise ValueError(f"synthetic accept length must be >= 1, got {accept_len}")
    bs, n = tree.tokens.shape
    node_ids = torch.arange(n, device=tree.tokens.device)
    deepest = (tree.depth * (n + 1) - node_ids).argmax(dim=1)  # [bs] first node of max depth
    on_path = tree.mask.gather(1, deepest[:, None, None].expand(-1, 1, n)).squeeze(1)  # [bs, n]
    # the path child of each node: the on-path node whose parent it is
    is_child = (tree.parents[:, None, :] == node_ids[None, :, None]) & on_path[:, None, :]
    has_child = is_child.any(dim=2)  # [bs, n]
    child_token = tree.tokens.gather(1, is_child.to(torch.int8).argmax(dim=2))
    bonus = tree.tokens if probs is None else probs.argmax(dim=-1)  # [bs, n]
    follow = has_child & (tree.depth < accept_len - 1)
    return walk_tree(tree, torch.where(follow, child_token, bonus), max_accept=accept_len - 1)
