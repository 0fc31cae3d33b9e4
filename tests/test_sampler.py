"""Sampler: seeded noise against a plain-Python splitmix64, transforms against naive Python."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from specserve.layers.sampler import (
    ACCEPT_SALT,
    SAMPLE_SALT,
    Sampler,
    SamplingTensors,
    probs_from_logits,
    uniform_noise,
)
from specserve.sampling_params import SamplingParams

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def chi_square_critical(df: int, alpha: float) -> float:
    """Upper alpha quantile of chi-square(df): scipy when present, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1.0 - alpha, df))
    except ImportError:
        z = NormalDist().inv_cdf(1.0 - alpha)
        h = 2.0 / (9.0 * df)
        return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square_rejects(counts: list[int], probs: list[float], alpha: float = 1e-4) -> bool:
    """Pearson test of counts against probs; cells with expected < 5 are pooled into one.

    A count on a zero-probability cell rejects outright.
    """
    total = sum(counts)
    if any(c > 0 and p == 0.0 for c, p in zip(counts, probs)):
        return True
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, p in zip(counts, probs):
        if p == 0.0:
            continue
        if total * p < 5.0:
            pooled_obs, pooled_exp = pooled_obs + c, pooled_exp + total * p
        else:
            cells.append((c, total * p))
    if pooled_exp > 0.0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat > chi_square_critical(max(len(cells) - 1, 1), alpha)


def biased(probs: list[float], shift: float = 0.02) -> list[float]:
    """Move `shift` of mass from the most to the least likely supported token."""
    support = [i for i, p in enumerate(probs) if p > 0]
    hi = max(support, key=lambda i: probs[i])
    lo = min(support, key=lambda i: probs[i])
    out = list(probs)
    out[hi] -= shift
    out[lo] += shift
    return out


def splitmix_ref(seed: int, counter: int, index: int, salt: int) -> float:
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    key = mix(mix((seed + (salt + 1) * G) & M64) ^ counter)
    bits = mix((key + (index + 1) * G) & M64) >> 41
    return (bits + 0.5) / 2**23


def test_uniform_noise_matches_plain_python() -> None:
    seeds = [0, 1, 12345, 2**63 - 1, 2**62 + 7]
    counters = [0, 5, 2**40, 3, 999]
    for salt in (SAMPLE_SALT, ACCEPT_SALT, 17):
        u = uniform_noise(torch.tensor(seeds), torch.tensor(counters), 7, salt)
        ref = [[splitmix_ref(s, c, i, salt) for i in range(7)] for s, c in zip(seeds, counters)]
        assert torch.equal(u, torch.tensor(ref, dtype=torch.float32))


def test_uniform_noise_statistics() -> None:
    n, num = 32, 4096
    seeds = torch.randint(0, 2**62, (n,))
    counters = torch.randint(0, 10**6, (n,))
    u = uniform_noise(seeds, counters, num)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    sd_mean = math.sqrt(1 / 12 / u.numel())
    assert abs(u.mean().item() - 0.5) < 5 * sd_mean
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / u.numel())
    # neighbouring counters and another salt give uncorrelated streams
    for other in (
        uniform_noise(seeds, counters + 1, num),
        uniform_noise(seeds, counters, num, ACCEPT_SALT),
    ):
        corr = torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1]
        assert abs(corr.item()) < 5 / math.sqrt(u.numel())
        assert not torch.equal(u, other)


def naive_probs(row: list[float], p: SamplingParams) -> list[float]:
    """Temperature, top-k, top-p, min-p, renormalise: one row in plain Python."""
    vocab = len(row)
    if p.greedy:
        best = max(range(vocab), key=lambda i: row[i])
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    z = [x / p.temperature for x in row]
    order = sorted(range(vocab), key=lambda i: -z[i])
    kept = order[: p.top_k] if p.top_k > 0 else order
    w = {i: math.exp(z[i] - z[order[0]]) for i in kept}
    total = sum(w.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        nucleus.append(i)
        mass += w[i] / total
    final = [i for i in nucleus if w[i] >= p.min_p * w[order[0]]]
    norm = sum(w[i] for i in final)
    return [w[i] / norm if i in final else 0.0 for i in range(vocab)]


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=12, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=1),
]


def build(params: list[SamplingParams], vocab: int, seeds: list[int] | None = None):
    seeds = seeds if seeds is not None else list(range(100, 100 + len(params)))
    return SamplingTensors.build(params, seeds, list(range(len(params))), vocab, "cpu")


def test_build_and_repeat() -> None:
    st = build(PARAMS, 20)
    assert st.top_ks.tolist() == [20, 20, 5, 20, 20, 12, 3, 1]
    assert st.temperatures.tolist() == pytest.approx([p.temperature for p in PARAMS])
    assert st.seeds.tolist() == list(range(100, 108)) and st.counters.tolist() == list(range(8))
    assert (st.all_greedy, st.any_greedy, st.any_top_k, st.any_top_p, st.any_min_p) == (
        False, True, True, True, True,
    )  # fmt: skip
    rep = st.repeat_interleave(3)
    assert rep.min_ps.tolist() == [m for m in st.min_ps.tolist() for _ in range(3)]
    assert rep.seeds.tolist() == [s for s in st.seeds.tolist() for _ in range(3)]
    assert build([SamplingParams(temperature=0.0)], 20).all_greedy


def test_probs_match_naive_support_and_values() -> None:
    torch.manual_seed(0)
    vocab = 40
    params = PARAMS * 6
    logits = torch.randn(len(params), vocab) * 2.0
    probs = probs_from_logits(logits, build(params, vocab))
    for b, p in enumerate(params):
        ref = naive_probs(logits[b].tolist(), p)
        assert [x > 0 for x in probs[b].tolist()] == [x > 0 for x in ref], (b, p)
        assert probs[b].tolist() == pytest.approx(ref, abs=1e-5)


def test_sample_greedy_mixed_and_support() -> None:
    torch.manual_seed(1)
    vocab, sampler = 30, Sampler()
    logits = torch.randn(64, vocab)
    greedy = build([SamplingParams(temperature=0.0)] * 64, vocab)
    assert torch.equal(sampler.sample(logits, greedy), logits.argmax(-1))
    params = PARAMS * 8
    logits = torch.randn(len(params), vocab) * 2.0
    supports = [naive_probs(logits[b].tolist(), p) for b, p in enumerate(params)]
    for seed in range(25):  # many draws per row, each within the naive support
        seeds = [seed * 1000 + b for b in range(len(params))]
        tokens = sampler.sample(logits, build(params, vocab, seeds)).tolist()
        for b, p in enumerate(params):
            assert supports[b][tokens[b]] > 0
            if p.greedy:
                assert tokens[b] == logits[b].argmax().item()


def test_seed_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(2)
    vocab, sampler = 50, Sampler()
    params = PARAMS * 3
    logits = torch.randn(len(params), vocab)
    seeds = [7 * b + 3 for b in range(len(params))]
    together = sampler.sample(logits, build(params, vocab, seeds))
    perm = torch.randperm(len(params)).tolist()
    shuffled = sampler.sample(
        logits[perm],
        SamplingTensors.build(
            [params[i] for i in perm], [seeds[i] for i in perm], perm, vocab, "cpu"
        ),
    )
    assert torch.equal(shuffled, together[perm])
    for b in range(0, len(params), 5):
        alone = SamplingTensors.build([params[b]], [seeds[b]], [b], vocab, "cpu")
        assert sampler.sample(logits[b : b + 1], alone).item() == together[b].item()


@pytest.mark.parametrize(
    "param",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.1),
    ],
)
def test_sampling_distribution_chi_square(param: SamplingParams) -> None:
    torch.manual_seed(3)
    vocab, n = 8, 40000
    logits = torch.randn(1, vocab).expand(n, vocab)
    st = SamplingTensors.build([param] * n, list(range(n)), [5] * n, vocab, "cpu")
    probs = probs_from_logits(logits[:1], build([param], vocab)).squeeze(0)
    tokens = Sampler().sample(logits, st)
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    expected = probs.double().tolist()
    assert not chi_square_rejects(counts, expected)
    assert chi_square_rejects(counts, biased(expected))  # the sample size detects a 2% bias


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_gpu_agree() -> None:
    torch.manual_seed(4)
    vocab = 1000
    params = PARAMS * 4
    logits = torch.randn(len(params), vocab)
    seeds = list(range(len(params)))
    cpu = build(params, vocab, seeds)
    gpu = SamplingTensors.build(params, seeds, list(range(len(params))), vocab, "cuda")
    u_cpu = uniform_noise(cpu.seeds, cpu.counters, vocab, ACCEPT_SALT)
    assert torch.equal(u_cpu, uniform_noise(gpu.seeds, gpu.counters, vocab, ACCEPT_SALT).cpu())
    probs = probs_from_logits(logits.cuda(), gpu).cpu()
    torch.testing.assert_close(probs, probs_from_logits(logits, cpu), atol=1e-5, rtol=1e-4)
    sampler, logits_gpu = Sampler(), logits.cuda()
    eager = sampler.sample(logits_gpu, gpu)
    same = eager.cpu() == sampler.sample(logits, cpu)
    assert same.float().mean().item() > 0.95  # float rounding may flip a rare near-tie
    graph = torch.cuda.CUDAGraph()  # no host sync inside: the sampler captures
    with torch.cuda.graph(graph):
        captured = sampler.sample(logits_gpu, gpu)
    graph.replay()
    assert torch.equal(captured, eager)
