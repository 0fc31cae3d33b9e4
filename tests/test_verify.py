"""Verification: greedy against a naive Python walk, sampling checked for losslessness."""

from __future__ import annotations

import pytest
import torch
from test_sampler import biased, chi_square_rejects

from specserve.layers.sampler import (
    ACCEPT_SALT,
    SamplingTensors,
    probs_from_logits,
    uniform_noise,
)
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import DraftTree, TreeAccumulator
from specserve.speculative.verify import sample_per_node, synthetic_accept, verify


def draft_tree(roots: torch.Tensor, draft_logits: torch.Tensor, k: int, steps: int, n: int):
    """Deterministic drafts from a Markov table: each node's children are the top-k of
    draft_logits[node token]."""
    logp, tok = draft_logits[roots].log_softmax(-1).topk(k)  # [bs, k]
    acc = TreeAccumulator(logp, tok, None)
    for _ in range(steps - 1):
        logp, tok = draft_logits[acc.frontier_tokens].log_softmax(-1).topk(k)  # [bs, k, k]
        acc.extend(logp, tok)
    return acc.build(roots, n)


def naive_walk(tree: DraftTree, b: int, target: list[int]) -> tuple[list[int], list[int]]:
    """Accepted node ids (root first) and emitted tokens, by the greedy rule in plain Python."""
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    cur, accepted, emitted = 0, [0], []
    while True:
        x = target[cur]
        emitted.append(x)
        kids = [j for j in range(len(tokens)) if parents[j] == cur and tokens[j] == x]
        if not kids:
            return accepted, emitted
        cur = kids[0]
        accepted.append(cur)


def check_row(res, tree: DraftTree, b: int, target: list[int]) -> None:
    accepted, emitted = naive_walk(tree, b, target)
    width = tree.max_depth + 1
    assert res.accepted_nodes[b].tolist() == accepted + [-1] * (width - len(accepted))
    assert res.emitted[b].tolist() == emitted + [-1] * (width - len(emitted))
    assert res.num_accepted[b].item() == len(accepted) - 1
    assert res.num_emitted[b].item() == len(emitted)


def build_st(params: list[SamplingParams], vocab: int, counter: int = 0) -> SamplingTensors:
    bs = len(params)
    return SamplingTensors.build(params, list(range(bs)), [counter] * bs, vocab, "cpu")


def target_probs(tree: DraftTree, target_logits: torch.Tensor, st: SamplingTensors):
    """Markov target: the distribution after node i is the row of its token, transformed."""
    bs, n = tree.tokens.shape
    logits = target_logits[tree.tokens].reshape(bs * n, -1)
    return probs_from_logits(logits, st.repeat_interleave(n)).view(bs, n, -1)


@pytest.mark.parametrize("k,steps,n", [(1, 4, 5), (2, 3, 8), (3, 4, 12)])
def test_greedy_matches_naive_walk(k: int, steps: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + 10 * steps)
    bs, vocab = 64, 4  # a tiny vocabulary makes long accepted paths common
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    tree = draft_tree(roots, torch.randn(vocab, vocab, generator=gen), k, steps, n)
    logits = torch.randn(bs, n, vocab, generator=gen)  # per-node target logits, any values
    probs = probs_from_logits(logits.view(bs * n, vocab), build_st(
        [SamplingParams(temperature=0.0)] * (bs * n), vocab)).view(bs, n, vocab)  # fmt: skip
    res = verify(tree, probs, torch.rand(bs, n, generator=gen))
    for b in range(bs):
        check_row(res, tree, b, logits[b].argmax(-1).tolist())
    assert res.num_accepted.max().item() >= 2


@pytest.mark.parametrize("k,steps,n", [(1, 5, 6), (2, 3, 7), (4, 3, 16)])
def test_oracle_tree_accepts_everything(k: int, steps: int, n: int) -> None:
    """A draft that ranks the target's argmax first (by a wide margin) is accepted to the end."""
    gen = torch.Generator().manual_seed(11)
    vocab, bs = 20, 8
    target_logits = torch.randn(vocab, vocab, generator=gen)
    draft_logits = torch.randn(vocab, vocab, generator=gen)
    draft_logits[torch.arange(vocab), target_logits.argmax(-1)] += 20.0
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    tree = draft_tree(roots, draft_logits, k, steps, n)
    st = build_st([SamplingParams(temperature=0.0)] * bs, vocab)
    res = verify(tree, target_probs(tree, target_logits, st), torch.rand(bs, n, generator=gen))
    assert res.num_accepted.tolist() == [steps] * bs
    assert res.num_emitted.tolist() == [steps + 1] * bs
    chain = [roots]
    for _ in range(steps + 1):
        chain.append(target_logits[chain[-1]].argmax(-1))
    assert res.emitted.tolist() == torch.stack(chain[1:], 1).tolist()


def markov_sample_test(params: SamplingParams, k: int, steps: int, n: int, seed: int) -> None:
    """Joint law of the first two emitted tokens of a Markov target, through verification.

    When a cycle emits one token only, the second comes from a new cycle rooted at it.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab, bs, root = 6, 40000, 2
    target_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_logits = torch.randn(vocab, vocab, generator=gen) * 1.5  # a poor, different draft
    st = build_st([params] * bs, vocab, counter=100)
    roots = torch.full((bs,), root)
    tree = draft_tree(roots, draft_logits, k, steps, n)
    u = uniform_noise(st.seeds, st.counters, n, ACCEPT_SALT)
    res = verify(tree, target_probs(tree, target_logits, st), u)
    x1 = res.emitted[:, 0]
    tree2 = draft_tree(x1, draft_logits, k, steps, n)
    u2 = uniform_noise(st.seeds, st.counters + 1, n, ACCEPT_SALT)
    res2 = verify(tree2, target_probs(tree2, target_logits, st), u2)
    x2 = torch.where(res.num_emitted >= 2, res.emitted[:, 1], res2.emitted[:, 0])

    p = probs_from_logits(target_logits, build_st([params] * vocab, vocab)).double()  # [V, V]
    p1 = p[root]  # law of x1
    joint = p1[:, None] * p  # [V, V] law of (x1, x2)
    for counts, expected in (
        (torch.bincount(x1, minlength=vocab), p1),
        (torch.bincount(x2, minlength=vocab), joint.sum(0)),
        (torch.bincount(x1 * vocab + x2, minlength=vocab * vocab), joint.flatten()),
    ):
        assert not chi_square_rejects(counts.tolist(), expected.tolist())
        assert chi_square_rejects(counts.tolist(), biased(expected.tolist()))
    hits = res.num_accepted  # the drafts both hit and miss: both branches are exercised
    assert bool((hits > 0).any()) and bool((hits < tree.max_depth).any())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)],
)
@pytest.mark.parametrize("k,steps,n", [(1, 3, 4), (2, 3, 7), (3, 3, 10)])
def test_lossless_sampling(params: SamplingParams, k: int, steps: int, n: int) -> None:
    markov_sample_test(params, k, steps, n, seed=20 + k)


def test_lossless_with_top_k_and_min_p() -> None:
    markov_sample_test(SamplingParams(temperature=1.3, top_k=4, min_p=0.05), 2, 4, 9, seed=31)


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(40)
    vocab, n, k, steps = 6, 7, 2, 3
    target_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    params = [SamplingParams(temperature=0.0) if b % 4 == 0 else sampled for b in range(20000)]
    st = build_st(params, vocab, counter=7)
    roots = torch.randint(0, vocab, (len(params),), generator=gen)
    tree = draft_tree(roots, draft_logits, k, steps, n)
    probs = target_probs(tree, target_logits, st)
    res = verify(tree, probs, uniform_noise(st.seeds, st.counters, n, ACCEPT_SALT))
    for b in range(0, len(params), 4 * 50):  # greedy rows: the naive walk
        check_row(res, tree, b, target_logits[tree.tokens[b]].argmax(-1).tolist())
    rows = [b for b in range(len(params)) if b % 4 and roots[b].item() == 0]
    p1 = probs_from_logits(target_logits[:1], build_st([sampled], vocab))[0].double()
    counts = torch.bincount(res.emitted[rows, 0], minlength=vocab)
    assert not chi_square_rejects(counts.tolist(), p1.tolist())
    # every row: emitted = tokens along the accepted path, then a token the target allows
    width = tree.max_depth + 1
    for b in range(0, len(params), 97):
        m = res.num_accepted[b].item()
        path = res.accepted_nodes[b, : m + 1].tolist()
        assert res.emitted[b, :m].tolist() == tree.tokens[b, path[1:]].tolist()
        assert probs[b, path[-1], res.emitted[b, m]].item() > 0
        assert res.emitted[b, m + 1 :].tolist() == [-1] * (width - m - 1)


def test_sample_per_node_one_hot_and_support() -> None:
    gen = torch.Generator().manual_seed(50)
    probs = torch.rand(500, 9, generator=gen) * (torch.rand(500, 9, generator=gen) < 0.4)
    probs[:, 3] += 1e-3  # every row has some mass
    u = torch.rand(500, generator=gen)
    tok = sample_per_node(probs, u)
    assert bool((probs.gather(1, tok[:, None]) > 0).all())
    hot = torch.zeros(500, 9).scatter_(1, torch.randint(0, 9, (500, 1), generator=gen), 1.0)
    assert torch.equal(sample_per_node(hot, u), hot.argmax(-1))


def test_synthetic_accept() -> None:
    gen = torch.Generator().manual_seed(60)
    vocab, bs, k, steps, n = 10, 16, 2, 4, 9
    tree = draft_tree(torch.randint(0, vocab, (bs,), generator=gen),
                      torch.randn(vocab, vocab, generator=gen), k, steps, n)  # fmt: skip
    probs = torch.rand(bs, n, vocab, generator=gen)
    for accept_len in (1, 2, 3, 9):
        for p in (probs, None):
            res = synthetic_accept(tree, accept_len, p)
            for b in range(bs):  # naive: the root-to-deepest path, cut to accept_len nodes
                parents, depth = tree.parents[b].tolist(), tree.depth[b].tolist()
                node = depth.index(max(depth))
                path = [node]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                path = path[::-1][:accept_len]
                last = path[-1]
                bonus = (probs[b, last].argmax().item() if p is not None
                         else tree.tokens[b, last].item())  # fmt: skip
                assert res.num_accepted[b].item() == len(path) - 1
                assert res.accepted_nodes[b, : len(path)].tolist() == path
                emitted = tree.tokens[b, path[1:]].tolist() + [bonus]
                assert res.emitted[b, : len(emitted)].tolist() == emitted
    with pytest.raises(ValueError, match="synthetic accept length"):
        synthetic_accept(tree, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_cpu() -> None:
    """Tree building and verification on the GPU, captured in a CUDA graph (so free of host
    syncs), give the CPU's result."""
    gen = torch.Generator().manual_seed(70)
    vocab, bs, k, steps, n = 6, 64, 2, 3, 7
    logits_t = torch.randn(vocab, vocab, generator=gen) * 1.5
    logits_d = torch.randn(vocab, vocab, generator=gen) * 1.5
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    params = [SamplingParams(temperature=0.0 if b % 3 == 0 else 0.9, top_p=0.9) for b in range(bs)]

    def run(device: str) -> tuple[DraftTree, object]:
        st = SamplingTensors.build(params, list(range(bs)), [3] * bs, vocab, device)
        tree = draft_tree(roots.to(device), logits_d.to(device), k, steps, n)
        probs = target_probs(tree, logits_t.to(device), st)
        return tree, verify(tree, probs, uniform_noise(st.seeds, st.counters, n, ACCEPT_SALT))

    tree_cpu, res_cpu = run("cpu")
    roots, logits_t, logits_d = roots.cuda(), logits_t.cuda(), logits_d.cuda()
    st = SamplingTensors.build(params, list(range(bs)), [3] * bs, vocab, "cuda")

    def step() -> tuple[DraftTree, object]:
        tree = draft_tree(roots, logits_d, k, steps, n)
        probs = target_probs(tree, logits_t, st)
        return tree, verify(tree, probs, uniform_noise(st.seeds, st.counters, n, ACCEPT_SALT))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_gpu, res_gpu = step()
    graph.replay()
    torch.cuda.synchronize()
    for name in ("tokens", "parents", "depth", "mask"):
        assert torch.equal(getattr(tree_gpu, name).cpu(), getattr(tree_cpu, name)), name
    for name in ("accepted_nodes", "num_accepted", "emitted", "num_emitted"):
        assert torch.equal(getattr(res_gpu, name).cpu(), getattr(res_cpu, name)), name


def test_walk_takes_the_first_of_twin_children() -> None:
    """Siblings carrying the same token: the walk descends into the first one only, even when
    the second one's subtree would accept more (choosing by depth would bias sampling)."""
    from specserve.speculative.tree import _ancestor_mask
    from specserve.speculative.verify import walk_tree

    parents = torch.tensor([[-1, 0, 0, 2, 1, 3]])
    tokens = torch.tensor([[9, 5, 5, 7, 8, 4]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 3]])
    tree = DraftTree(tokens, parents, depth, _ancestor_mask(parents, 3),
                     torch.zeros(1, 6), max_depth=3)
    # after the root 5; after node 1 -> 8 (node 4); after node 2 -> 7 (node 3) -> 4 (node 5)
    for target in ([5, 8, 7, 4, 1, 2], [5, 3, 7, 4, 1, 2], [6, 8, 7, 4, 1, 2]):
        res = walk_tree(tree, torch.tensor([target]))
        check_row(res, tree, 0, target)
    res = walk_tree(tree, torch.tensor([[5, 8, 7, 4, 1, 2]]), max_accept=1)
    assert res.accepted_nodes.tolist() == [[0, 1, -1, -1]] and res.emitted.tolist() == [[5, 8, -1, -1]]
