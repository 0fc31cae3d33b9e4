"""Random synthetic acceptance (cost-only benchmarks): accept lengths against a naive Python
walk, and through the engine each request draws its own rate while the mean accept length
follows the configured mean."""

from __future__ import annotations

import random

import pytest
import torch
from test_verify import draft_tree
from tiny_eagle import make_tiny_pair

from specserve.config import CacheConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import synthetic_accept, synthetic_accept_lengths


def naive_length(tree: DraftTree, b: int, rate: float, u: list[float]) -> tuple[int, int]:
    """Walk root -> first deepest node; at a node with c children pass on u[depth] <
    1 - (1 - rate)^c; the accept length is 1 + the passes before the first failure. Also the
    chain's run on the same path and draws (pass on u[depth] < rate), 2 r + (whole path)."""
    parents, depth = tree.parents[b].tolist(), tree.depth[b].tolist()
    deepest = max(range(len(depth)), key=lambda i: (depth[i], -i))
    path = [deepest]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path.reverse()  # root first
    length = 1
    for node in path[:-1]:
        c = sum(p == node for p in parents)
        if not u[depth[node]] < 1 - (1 - rate) ** c:
            break
        length += 1
    run = 0
    for node in path[:-1]:
        if not u[depth[node]] < rate:
            return length, 2 * run
        run += 1
    return length, 2 * run + 1


@pytest.mark.parametrize("k,steps,n", [(1, 4, 5), (3, 3, 8), (4, 3, 16)])
def test_random_lengths_match_a_naive_walk(k: int, steps: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 100 + n)
    bs, vocab = 64, 40
    tree = draft_tree(
        torch.randint(vocab, (bs,), generator=gen),
        torch.randn(vocab, vocab, generator=gen) * 3,
        k,
        steps,
        n,
    )
    rates = torch.rand(bs, generator=gen)
    draws = torch.rand(bs, steps + 1, generator=gen)
    got, chain = synthetic_accept_lengths(tree, rates, draws)
    naive = [naive_length(tree, b, rates[b].item(), draws[b].tolist()) for b in range(bs)]
    want = [w for w, _ in naive]
    assert got.tolist() == want
    assert chain.tolist() == [c for _, c in naive]
    assert len(set(want)) > 2, "the draws should give several lengths"
    assert {c & 1 for c in chain.tolist()} == {0, 1} and len(set(chain.tolist())) > 2
    assert all(c >> 1 <= w - 1 for c, w in zip(chain.tolist(), want))  # never past the tree
    res = synthetic_accept(tree, got)
    assert res.num_emitted.tolist() == want


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("syn"), max_position_embeddings=512)


def _synthetic_llm(pair: tuple[str, str], mean: float, steps: int) -> LLM:
    return LLM(
        pair[0],
        device="cpu",
        dtype="float32",
        cache=CacheConfig(page_size=8, num_pages=1024),
        speculative_config=dict(
            algorithm="eagle3", draft_model=pair[1], num_steps=steps, synthetic_accept_rate=mean
        ),
    )


def test_each_request_draws_its_own_rate(pair) -> None:
    mean, steps = 0.6, 3
    llm = _synthetic_llm(pair, mean, steps)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(24)]
    params = [
        SamplingParams(temperature=0, max_tokens=61, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    lengths = [o.accept_length for o in outs]
    assert max(lengths) - min(lengths) > 1.0, lengths  # rates differ between requests
    # rate a ~ U[0.2, 1.0]: E[1 + a + a^2 + a^3] = 1 + E[a] + E[a^2] + E[a^3]
    expect = 1 + sum((1.0 ** (p + 1) - 0.2 ** (p + 1)) / ((p + 1) * 0.8) for p in (1, 2, 3))
    assert abs(sum(lengths) / len(lengths) - expect) < 0.3, (lengths, expect)
    again = _synthetic_llm(pair, mean, steps)
    assert [o.accept_length for o in again.generate(prompts[:4], params[:4])] == lengths[:4]
    # a new mean in the same engine (what bench_spec_policy sweeps): a ~ U[0, 0.4]
    (cycle,) = [m.cycle for m in again.engine.drafter.modes.values()]
    cycle.set_synthetic_accept_rate(0.2)
    low = [o.accept_length for o in again.generate(prompts, params)]
    assert abs(sum(low) / len(low) - (1 + 0.2 + 0.16 / 3 + 0.064 / 4)) < 0.2, low
    cycle.set_synthetic_accept_rate(mean)  # and back: the same draws as before
    assert [o.accept_length for o in again.generate(prompts[:4], params[:4])] == lengths[:4]
    with pytest.raises(ValueError, match="cannot set synthetic acceptance rate 1.0"):
        cycle.set_synthetic_accept_rate(1.0)


def test_fixed_and_random_together_are_refused(pair) -> None:
    with pytest.raises(ValueError, match="give one"):
        LLM(pair[0], device="cpu", speculative_config=dict(
            algorithm="eagle3", draft_model=pair[1], synthetic_accept_len=2,
            synthetic_accept_rate=0.5))
