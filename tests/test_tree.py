"""EAGLE-2 tree construction against an explicit enumeration of every candidate in Python."""

from __future__ import annotations

import struct

import pytest
import torch

from specserve.speculative.tree import TreeAccumulator, expand_frontier


def f32(x: float) -> float:
    """Round to float32 (a float32 sum rounds the exact float64 sum of two float32 values)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def naive_tree(root: int, steps: list[tuple[list, list]], n: int, d2t: list[int] | None):
    """One request. steps[0] = (logp[k], tokens[k]) of the root; steps[s] = ([k][c], [k][c]).

    Returns (tokens, parents, depth, scores, frontier paths) of the kept tree.
    """

    def to_target(t: int) -> int:
        return t if d2t is None else t + d2t[t]

    cands = []  # dicts with score, order, parent (candidate order or -1), token, depth
    logp, toks = steps[0]
    for j in range(len(toks)):
        cands.append(dict(score=f32(min(logp[j], 0.0)), order=len(cands), parent=-1,
                          token=to_target(toks[j]), depth=1))  # fmt: skip
    frontier = list(cands)
    paths = [[j] for j in range(len(frontier))]
    for s, (logp, toks) in enumerate(steps[1:], start=2):
        children = []
        for slot, node in enumerate(frontier):
            for j in range(len(toks[slot])):
                score = f32(node["score"] + min(logp[slot][j], 0.0))
                children.append(dict(score=score, order=len(cands) + len(children),
                                     parent=node["order"], token=to_target(toks[slot][j]),
                                     depth=s, slot=slot))  # fmt: skip
        cands += children
        best = sorted(children, key=lambda c: (-c["score"], c["order"]))[: len(frontier)]
        paths = [paths[c["slot"]] + [i] for i, c in enumerate(best)]
        frontier = best
    kept = sorted(cands, key=lambda c: (-c["score"], c["order"]))[: n - 1]
    kept.sort(key=lambda c: c["order"])
    node_of = {c["order"]: i + 1 for i, c in enumerate(kept)}
    tokens = [root] + [c["token"] for c in kept]
    parents = [-1] + [0 if c["parent"] < 0 else node_of[c["parent"]] for c in kept]
    depth = [0] + [c["depth"] for c in kept]
    scores = [0.0] + [c["score"] for c in kept]
    return tokens, parents, depth, scores, paths


def random_steps(bs: int, k: int, num_steps: int, vocab: int, gen: torch.Generator):
    """Draft outputs as a drafter makes them: top-k of random log-softmax rows."""
    root_logp, root_tok = torch.randn(bs, vocab, generator=gen).log_softmax(-1).topk(k)
    steps = [(root_logp, root_tok)]
    for _ in range(num_steps - 1):
        steps.append(torch.randn(bs, k, vocab, generator=gen).log_softmax(-1).topk(k))
    return steps


def run_tree(steps: list, roots: torch.Tensor, n: int, d2t: torch.Tensor | None = None):
    acc = TreeAccumulator(steps[0][0], steps[0][1], d2t)
    for logp, tok in steps[1:]:
        acc.extend(logp, tok)
    return acc.build(roots, n), acc.frontier_path


def check_against_naive(steps: list, roots: torch.Tensor, n: int, d2t: torch.Tensor | None):
    tree, paths = run_tree(steps, roots, n, d2t)
    d2t_list = None if d2t is None else d2t.tolist()
    for b in range(roots.shape[0]):
        per_step = [(lp[b].tolist(), tk[b].tolist()) for lp, tk in steps]
        tokens, parents, depth, scores, ref_paths = naive_tree(int(roots[b]), per_step, n, d2t_list)
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depth[b].tolist() == depth
        assert tree.scores[b].tolist() == scores
        assert paths[b].tolist() == ref_paths
    check_structure(tree)
    return tree


def check_structure(tree) -> None:
    """Connected, parents first, depth = parent depth + 1, mask = ancestor-or-self."""
    bs, n = tree.tokens.shape
    for b in range(bs):
        parents = tree.parents[b].tolist()
        depth = tree.depth[b].tolist()
        assert parents[0] == -1 and depth[0] == 0
        for i in range(1, n):
            assert 0 <= parents[i] < i and depth[i] == depth[parents[i]] + 1
        assert max(depth) <= tree.max_depth
        for i in range(n):
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = parents[j]
            assert tree.mask[b, i].tolist() == [j in ancestors for j in range(n)]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
@pytest.mark.parametrize("n", [4, 8, 16])
def test_matches_naive_enumeration(k: int, num_steps: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 100 + num_steps * 10 + n)
    bs, vocab = 3, 12
    steps = random_steps(bs, k, num_steps, vocab, gen)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    if n - 1 > k + (num_steps - 1) * k * k:
        with pytest.raises(ValueError, match="num_draft_tokens"):
            run_tree(steps, roots, n)
        return
    d2t = torch.randint(0, 50, (vocab,), generator=gen) if k == 2 else None
    tree = check_against_naive(steps, roots, n, d2t)
    if k == 1:  # a chain: root -> d1 -> ... along the top-1 tokens
        assert tree.parents[0].tolist() == list(range(-1, n - 1))
        assert (
            tree.tokens[:, 1:].tolist()
            == torch.cat([s[1].reshape(bs, 1) for s in steps], 1)[:, : n - 1].tolist()
        )


@pytest.mark.parametrize("logp", [0.0, -0.6931471805599453, 0.3])
def test_ties_stay_connected(logp: float) -> None:
    """Equal log-probs everywhere (and positive ones, which are clamped) tie every candidate."""
    bs, k, num_steps, n = 2, 3, 4, 12
    gen = torch.Generator().manual_seed(5)
    steps = [(torch.full((bs, k), logp), torch.randint(0, 9, (bs, k), generator=gen))]
    for _ in range(num_steps - 1):
        steps.append((torch.full((bs, k, k), logp), torch.randint(0, 9, (bs, k, k), generator=gen)))
    tree = check_against_naive(steps, torch.tensor([1, 2]), n, None)
    assert tree.depth.max().item() >= 2


def test_partial_ties_match_naive() -> None:
    """Log-probs drawn from a few values: many score ties across steps and slots."""
    gen = torch.Generator().manual_seed(6)
    bs, k, num_steps = 4, 3, 4
    choices = torch.tensor([0.0, -0.5, -1.0])
    steps = [(choices[torch.randint(0, 3, (bs, k), generator=gen)],
              torch.randint(0, 20, (bs, k), generator=gen))]  # fmt: skip
    for _ in range(num_steps - 1):
        steps.append((choices[torch.randint(0, 3, (bs, k, k), generator=gen)],
                      torch.randint(0, 20, (bs, k, k), generator=gen)))  # fmt: skip
    for n in (5, 10, 20):
        check_against_naive(steps, torch.arange(bs), n, None)


def test_expand_frontier_is_global_top_k() -> None:
    gen = torch.Generator().manual_seed(7)
    scores = -torch.rand(2, 3, generator=gen)
    child_logp = torch.randn(2, 3, 5, generator=gen).log_softmax(-1)
    child_tokens = torch.randint(0, 100, (2, 3, 5), generator=gen)
    new_scores, new_tokens, parent_slot = expand_frontier(scores, child_logp, child_tokens)
    for b in range(2):
        allc = [(f32(scores[b, i].item() + child_logp[b, i, j].item()), i, j)
                for i in range(3) for j in range(5)]  # fmt: skip
        best = sorted(allc, key=lambda t: -t[0])[:3]
        assert new_scores[b].tolist() == [t[0] for t in best]
        assert parent_slot[b].tolist() == [t[1] for t in best]
        assert new_tokens[b].tolist() == [child_tokens[b, i, j].item() for _, i, j in best]


def test_positions_and_root_only_tree() -> None:
    gen = torch.Generator().manual_seed(8)
    steps = random_steps(2, 2, 2, 10, gen)
    tree, _ = run_tree(steps, torch.tensor([3, 4]), 5)
    pos = tree.positions(torch.tensor([10, 20]))
    assert pos.tolist() == (tree.depth + torch.tensor([[10], [20]])).tolist()
    root_only, _ = run_tree(steps, torch.tensor([3, 4]), 1)
    assert root_only.tokens.tolist() == [[3], [4]] and root_only.max_depth == 0

