"""Logits processing (penalties, min_tokens, logit_bias) against a naive Python reference,
per tree node under speculation, and the lossless verification rule with it active."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from test_sampler import biased, chi_square_rejects
from test_verify import draft_tree

from specserve.layers.logits_processor import LogitsProcess, RowHistory, token_logprobs
from specserve.layers.sampler import ACCEPT_SALT, SamplingTensors, probs_from_logits, uniform_noise
from specserve.sampling_params import SamplingParams
from specserve.speculative.verify import verify


def naive(logits: list[float], prompt: list[int], outputs: list[int], presence: float,
          frequency: float, repetition: float, min_tokens: int, stops: list[int],
          bias: dict[int, float]) -> list[float]:
    """The transform as the vLLM/OpenAI/HF docs state it, one token at a time."""
    out = list(logits)
    for t, b in bias.items():
        out[t] += b
    if len(outputs) < min_tokens:
        for t in stops:
            out[t] = -math.inf
    seen = set(prompt) | set(outputs)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        c = outputs.count(t)
        out[t] -= frequency * c + presence * (1.0 if c else 0.0)
    return out


def history(rows: list[dict]) -> RowHistory:
    """RowHistory of rows given as naive()'s keywords (what the step builder sends)."""
    hist, hc, ho, bi, bv, bc, si, sc, ml = [], [], [], [], [], [], [], [], []
    for r in rows:
        tokens = (r["prompt"] if r["repetition"] != 1.0 else []) + r["outputs"]
        hist += tokens
        hc.append(len(tokens))
        ho.append(len(r["outputs"]))
        bi += list(r["bias"])
        bv += list(r["bias"].values())
        bc.append(len(r["bias"]))
        left = max(0, r["min_tokens"] - len(r["outputs"]))
        stops = r["stops"] if left else []
        si += stops
        sc.append(len(stops))
        ml.append(left)
    f32 = np.float32
    return RowHistory(np.array([r["presence"] for r in rows], f32),
                      np.array([r["frequency"] for r in rows], f32),
                      np.array([r["repetition"] for r in rows], f32), np.array(ml),
                      np.array(hist, np.int64), np.array(hc), np.array(ho),
                      np.array(bi, np.int64), np.array(bv, f32), np.array(bc),
                      np.array(si, np.int64), np.array(sc))


def random_row(rng: random.Random, vocab: int) -> dict:
    return dict(
        prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 8))],
        outputs=[rng.randrange(vocab) for _ in range(rng.randint(0, 10))],
        presence=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition=rng.choice([1.0, rng.uniform(0.1, 2)]),
        min_tokens=rng.choice([0, rng.randint(0, 12)]),
        stops=rng.sample(range(vocab), 2),
        bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), rng.randint(0, 3))},
    )


def test_apply_matches_naive_reference() -> None:
    rng, vocab, bs = random.Random(0), 12, 64
    rows = [random_row(rng, vocab) for _ in range(bs)]
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(1)) * 3
    got = LogitsProcess.build(history(rows), vocab, "cpu").apply(logits)
    for b, r in enumerate(rows):
        want = naive(logits[b].tolist(), **r)
        assert got[b].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4), (b, r)
    # the reference is not vacuous: most rows change, some tokens get masked
    assert (got != logits).any(dim=1).float().mean() > 0.8
    assert torch.isinf(got).any()


def test_for_tree_sees_the_draft_path() -> None:
    """Node i's row == the naive transform with the draft tokens of its path (depth >= 1)
    appended to the outputs; min_tokens counts them too."""
    rng, vocab, k, steps, n, bs = random.Random(2), 8, 2, 3, 7, 16
    gen = torch.Generator().manual_seed(3)
    rows = [random_row(rng, vocab) for _ in range(bs)]
    for r in rows:
        r["min_tokens"] = len(r["outputs"]) + rng.randint(0, 3)  # the limit falls on the path
    roots = torch.tensor([r["outputs"][-1] if r["outputs"] else 0 for r in rows])
    tree = draft_tree(roots, torch.randn(vocab, vocab, generator=gen), k, steps, n)
    logits = torch.randn(bs, n, vocab, generator=gen) * 3
    proc = LogitsProcess.build(history(rows), vocab, "cpu")
    got = proc.for_tree(tree.tokens, tree.mask, tree.depth).apply(
        logits.view(bs * n, vocab)).view(bs, n, vocab)
    for b, r in enumerate(rows):
        for i in range(n):
            path = [j for j in range(n) if tree.mask[b, i, j] and tree.depth[b, j] >= 1]
            path.sort(key=lambda j: int(tree.depth[b, j]))
            drafted = [int(tree.tokens[b, j]) for j in path]
            want = naive(logits[b, i].tolist(), **{**r, "outputs": r["outputs"] + drafted})
            assert got[b, i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4), (b, i)


def test_token_logprobs_match_log_softmax() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([0, 3, 29, 7, 7])
    chosen, top_v, top_i = token_logprobs(logits, tokens, 4)
    for b in range(5):
        row = logits[b].tolist()
        z = math.log(sum(math.exp(x) for x in row))
        ref = [x - z for x in row]
        assert chosen[b].item() == pytest.approx(ref[tokens[b]], abs=1e-5)
        order = sorted(range(30), key=lambda t: -ref[t])[:4]
        assert top_i[b].tolist() == order
        assert top_v[b].tolist() == pytest.approx([ref[t] for t in order], abs=1e-5)


@pytest.mark.parametrize("k,steps,n", [(1, 3, 4), (2, 3, 7)])
def test_lossless_sampling_with_penalties(k: int, steps: int, n: int) -> None:
    """The verify rule's distribution test with every processing feature on: the joint law
    of the first two emitted tokens of a Markov target == the naive transform applied with
    the history each token sees (x2's includes x1; min_tokens masks token 5 for x1 only)."""
    gen = torch.Generator().manual_seed(40 + k)
    vocab, bs, root = 6, 40000, 2
    row = dict(prompt=[0, 4], outputs=[3, 3, root], presence=0.4, frequency=0.7,
               repetition=1.5, min_tokens=4, stops=[5], bias={0: 1.0, 1: -0.5})
    target_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    st = SamplingTensors.build([params] * bs, list(range(bs)), [100] * bs, vocab, "cpu")
    plain = SamplingTensors.build([params], [0], [0], vocab, "cpu")

    def cycle(roots: torch.Tensor, outputs: list[list[int]], counter_add: int):
        tree = draft_tree(roots, draft_logits, k, steps, n)
        h = history([{**row, "outputs": o} for o in outputs])
        proc = LogitsProcess.build(h, vocab, "cpu").for_tree(tree.tokens, tree.mask, tree.depth)
        logits = proc.apply(target_logits[tree.tokens].reshape(bs * n, vocab))
        probs = probs_from_logits(logits, st.repeat_interleave(n)).view(bs, n, vocab)
        u = uniform_noise(st.seeds, st.counters + counter_add, n, ACCEPT_SALT)
        return tree, verify(tree, probs, u)

    tree, res = cycle(torch.full((bs,), root), [row["outputs"]] * bs, 0)
    x1 = res.emitted[:, 0]
    _, res2 = cycle(x1, [row["outputs"] + [t] for t in x1.tolist()], 1)
    x2 = torch.where(res.num_emitted >= 2, res.emitted[:, 1], res2.emitted[:, 0])

    def law(prev: int, outputs: list[int]) -> list[float]:
        z = naive(target_logits[prev].tolist(), **{**row, "outputs": outputs})
        return probs_from_logits(torch.tensor([z]), plain)[0].double().tolist()

    p1 = law(root, row["outputs"])
    assert p1[5] == 0.0  # min_tokens masks it for x1
    joint = [[p1[a] * q for q in law(a, row["outputs"] + [a])] for a in range(vocab)]
    flat = [v for r in joint for v in r]
    for counts, expected in (
        (torch.bincount(x1, minlength=vocab), p1),
        (torch.bincount(x1 * vocab + x2, minlength=vocab * vocab), flat),
    ):
        assert not chi_square_rejects(counts.tolist(), expected)
        assert chi_square_rejects(counts.tolist(), biased(expected))
    hits = res.num_accepted
    assert bool((hits > 0).any()) and bool((hits < tree.max_depth).any())


def test_sampling_params_validate_the_new_fields() -> None:
    ok = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=2,
                        min_tokens=16, logit_bias={3: -100, 4: 100}, logprobs=0,
                        prompt_logprobs=5)
    assert ok.processed and ok.penalized
    assert not SamplingParams(logprobs=3).processed
    for bad, field in ((dict(presence_penalty=2.01), "presence_penalty"),
                       (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                       (dict(repetition_penalty=0), "repetition_penalty"),
                       (dict(min_tokens=17), "min_tokens"),
                       (dict(min_tokens=1.5), "min_tokens"),
                       (dict(logit_bias={-1: 1}), "logit_bias"),
                       (dict(logit_bias={1: 100.5}), "logit_bias"),
                       (dict(logprobs=-1), "logprobs"),
                       (dict(prompt_logprobs=True), "prompt_logprobs")):
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**bad)


def test_tables_of_a_subset_leave_other_rows_alone() -> None:
    """Built for rows `index` only (the rest of the batch unprocessed): those rows, and their
    tree nodes, get the full-batch result; every other row passes through bit for bit."""
    rng, vocab, bs, n = random.Random(5), 10, 6, 4
    rows = [random_row(rng, vocab) for _ in range(bs)]
    index = [1, 4]
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(bs, vocab, generator=gen)
    full = LogitsProcess.build(history(rows), vocab, "cpu")
    part = LogitsProcess.build(history([rows[i] for i in index]), vocab, "cpu",
                               torch.tensor(index))
    got, want = part.apply(logits), full.apply(logits)
    others = [i for i in range(bs) if i not in index]
    assert torch.equal(got[index], want[index]) and torch.equal(got[others], logits[others])
    tree = draft_tree(torch.randint(0, vocab, (bs,), generator=gen),
                      torch.randn(vocab, vocab, generator=gen), 2, 2, n)
    nodes = torch.randn(bs * n, vocab, generator=gen)
    got = part.for_tree(tree.tokens, tree.mask, tree.depth).apply(nodes).view(bs, n, vocab)
    want = full.for_tree(tree.tokens, tree.mask, tree.depth).apply(nodes).view(bs, n, vocab)
    assert torch.equal(got[index], want[index])
    assert torch.equal(got[others], nodes.view(bs, n, vocab)[others])
