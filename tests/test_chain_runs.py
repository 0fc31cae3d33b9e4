"""What a tree's cycle teaches the same drafter's chains (verify.chain_runs): against a chain
walked over the same Markov draft and target, through the acceptance estimates (censored runs
add no rejection), and through the engine on the bundled pair (a request's first tree cycle
against its first chain cycle, which start from the same state)."""

from __future__ import annotations

import random

import pytest
import torch
from test_verify import draft_tree
from tiny_models import DEVICES

from specserve import defaults
from specserve import llm as llm_module
from specserve.engine.acceptance import AcceptanceEstimates
from specserve.engine.spec_policy import StaticPolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_modes import max_tree_nodes
from specserve.speculative.verify import chain_runs, walk_tree


def _markov(vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft table and a target next-token table that follows the draft's first choice 60%
    of the time, its second 30% (a tree's second child is accepted), else a random token."""
    draft = torch.randn(vocab, vocab, generator=gen) * 2
    ranked = draft.argsort(dim=1, descending=True)
    u = torch.rand(vocab, generator=gen)
    target = torch.where(u < 0.6, ranked[:, 0], torch.where(
        u < 0.9, ranked[:, 1], torch.randint(vocab, (vocab,), generator=gen)))
    return draft, target


def _in_tree(tree, b: int, path: list[int]) -> bool:
    """Some node of row b has exactly these tokens on its root path (root excluded)."""
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    for i in range(1, len(tokens)):
        seq, j = [], i
        while parents[j] >= 0:
            seq.append(tokens[j])
            j = parents[j]
        if seq[::-1] == path:
            return True
    return False


@pytest.mark.parametrize("k,steps,n", [(2, 3, 6), (3, 3, 5), (4, 4, 10), (2, 4, 15)])
def test_chain_runs_equal_a_chain_walked_alone(k: int, steps: int, n: int) -> None:
    gen = torch.Generator().manual_seed(7 * k + n)
    bs, vocab = 512, 12
    draft, target = _markov(vocab, gen)
    roots = torch.randint(vocab, (bs,), generator=gen)
    tree = draft_tree(roots, draft, k, steps, n)
    res = walk_tree(tree, target[tree.tokens])
    got = chain_runs(tree, res.accepted_nodes).tolist()
    chain = draft_tree(roots, draft, 1, steps, steps + 1)  # the chain of the same drafter
    want = walk_tree(chain, target[chain.tokens]).num_accepted.tolist()
    seen = set()
    for b in range(bs):
        r, untested = got[b] >> 1, got[b] & 1
        assert r <= res.num_accepted[b].item()
        if not untested:
            assert r == want[b], (b, r, want[b])
        else:  # the chain's next draft was not in the tree (or the tree ended): a lower bound
            assert r <= want[b]
            path = chain.tokens[b, 1: r + 2].tolist()
            assert r == steps or not _in_tree(tree, b, path), (b, r)
        seen.add((untested, r == res.num_accepted[b].item(), r == steps))
    # runs the tree went past (a second child accepted), pruned ends and whole paths occur
    assert {(0, False, False), (1, True, True)} <= seen, seen
    if n < max_tree_nodes(steps, k):  # pruned: some chain drafts are not in the tree
        assert (1, True, False) in seen or (1, False, False) in seen, seen


def test_estimates_learn_the_chain_from_censored_runs() -> None:
    """A tree-only stream teaches the chain family its true rate (0.4 at every depth); a run
    whose next depth went untested adds no rejection (counting one would read ~0.3)."""
    rng = random.Random(3)
    est = AcceptanceEstimates(max_depth=3)
    ids = [f"r{i}" for i in range(256)]
    read = []
    for step in range(60):
        runs, accepted = {}, {}
        for rid in ids:
            cap = rng.choice([1, 2, 3, 3])  # the tree held the chain's drafts to this depth
            r = 0
            while r < cap and rng.random() < 0.4:
                r += 1
            runs[rid] = 2 * r + (r == cap)
            accepted[rid] = r
        est.observe_step(accepted, 4, 3, chain_runs=runs)
        if step >= 20:
            read.append(est._global(1))
    for d in range(3):
        mean = sum(rates[d] for rates in read) / len(read)
        assert abs(mean - 0.4) < 0.03, (d, mean)
    fresh = AcceptanceEstimates(max_depth=3)  # without chain runs the chains keep the prior
    fresh.observe_step(accepted, 4, 3)
    assert fresh._global(1) == [fresh.prior] * 3


class _Recording(StaticPolicy):
    def __init__(self, mode: str, seen: list) -> None:
        super().__init__(mode)
        self.seen = seen

    def observe(self, mode, accepted, seconds, batch, mixed=False, folded=False,
                chunk_tokens=None, chain_runs=None) -> None:
        if accepted:
            self.seen.append((dict(accepted), chain_runs))


@pytest.mark.skipif(defaults.tiny_code_draft_path() is None,
                    reason="the tiny-code EAGLE-3 head is missing")
@pytest.mark.parametrize("device", DEVICES)
def test_engine_passes_a_trees_chain_runs(device: str) -> None:
    """The bundled pair in fp32, greedy: every tree cycle's runs reach the policy, aligned by
    request; a request's first cycle (after its prefill, the same draft state in both runs)
    gives the chain run its first chain3 cycle accepted (at most that when untested)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, head = defaults.tiny_code_path(), defaults.tiny_code_draft_path()
    src = open(llm_module.__file__).read()
    runs = {}
    for shape in ("tree", "chain"):
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
        if shape == "tree":
            spec.update(topk=3, num_draft_tokens=8)
        llm = LLM(model, device=device, dtype="float32", speculative_config=spec)
        tok = llm.engine.tokenizer
        prompts = [tok.encode(src[300 * i: 300 * i + 120], add_special_tokens=False)
                   for i in range(12)]
        seen: list = []
        (mode,) = llm.engine.drafter.modes
        llm.engine.spec_policy = _Recording(mode, seen)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        runs[shape] = seen
    first_chain = {}
    for accepted, chain in runs["chain"]:
        assert chain is None  # a chain's step carries none
        for rid, m in accepted.items():
            first_chain.setdefault(rid, m)
    first_tree, cycles, past = {}, 0, 0
    for accepted, chain in runs["tree"]:
        assert chain is not None and chain.keys() == accepted.keys()
        for rid, m in accepted.items():
            assert chain[rid] >> 1 <= m
            first_tree.setdefault(rid, chain[rid])
            cycles += 1
            past += chain[rid] >> 1 < m
    assert first_tree.keys() == first_chain.keys() and len(first_tree) == 12
    for rid, c in first_tree.items():
        if c & 1:
            assert c >> 1 <= first_chain[rid], rid
        else:
            assert c >> 1 == first_chain[rid], rid
    assert any(c >> 1 > 0 and not c & 1 for c in first_tree.values()), first_tree
    assert 0 < past < cycles  # the tree's extra children did accept, not always
