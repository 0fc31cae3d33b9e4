"""Sampled speculation through the whole engine emits tokens with plain sampling's distribution.

One prompt, thousands of seeds: the empirical distribution of the tokens decided by the first
speculative cycle (output positions 2 and 3; position 1 comes from the prefill) is compared
with plain sampling by a two-sample chi-square test. The verification rule itself is tested
at 2%-bias power in test_verify.py; this checks the engine wires it right (the target's
transformed distribution, per-request parameters, emitted-token bookkeeping).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import TreeAccumulator

N = 3000
PROMPT = [17, 230, 41, 99, 5]


def _chi2_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over categories with enough counts, and its dof."""
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= 20]
    na, nb = sum(a[c] for c in cats), sum(b[c] for c in cats)
    stat = 0.0
    for c in cats:
        total = a[c] + b[c]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (a[c] - ea) ** 2 / ea + (b[c] - eb) ** 2 / eb
    return stat, len(cats) - 1


def _critical_999(dof: int) -> float:
    """Chi-square 99.9% quantile (Wilson-Hilferty approximation)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _check_same_law(plain: list, got: list) -> None:
    """Output positions 1 and 2 drawn from the same law in both sample sets (chi-square)."""
    for pos in (1, 2):
        stat, dof = _chi2_two_sample(Counter(s[pos] for s in plain),
                                     Counter(s[pos] for s in got))
        assert dof >= 2
        assert stat < _critical_999(dof), (pos, stat, dof)


def _samples(llm: LLM, **extra) -> list[list[int]]:
    params = [SamplingParams(temperature=0.8, top_k=6, max_tokens=3, seed=s, ignore_eos=True,
                             **extra) for s in range(N)]
    return [o.token_ids for o in llm.generate([PROMPT] * N, params)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("samp")
    target = make_tiny_checkpoint(root / "t", tokenizer=True, num_hidden_layers=4)
    head = make_tiny_eagle3_head(str(root / "h"), target, draft_vocab_size=None)
    kw = dict(device="cpu", dtype="float32", cache=CacheConfig(page_size=8, num_pages=4096),
              scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096,
                                        max_waiting=N))
    plain = _samples(LLM(target, **kw))
    return target, head, kw, plain


def _fixed_proposals(llm: LLM, plain: list[list[int]]) -> None:
    """Deterministic drafts that the target often accepts: at every depth, the tokens plain
    sampling emitted most often at that output position (a random head would almost never be
    accepted, leaving the acceptance paths untested)."""
    def common(depth: int, k: int) -> list[int]:
        return [t for t, _ in Counter(s[min(depth, 2)] for s in plain).most_common(k)]

    def propose(shape, state, root_pos, root_tokens, page_table, valid):
        bs, k = state.shape[0], shape.topk  # the step's mode: its topk, depth and size
        logp = torch.log(torch.linspace(0.6, 0.3, k)).expand(bs, k)
        acc = TreeAccumulator(logp, torch.tensor(common(1, k)).expand(bs, k), None)
        for s in range(1, shape.num_steps):
            ids = torch.tensor(common(s + 1, k)).expand(bs, k, k)
            acc.extend(logp[:, None, :].expand(bs, k, k), ids)
        return acc.build(root_tokens, shape.num_draft_tokens)

    llm.engine.drafter.proposer.propose = propose


SWITCH = ["chain3", None, None, "chain3", "tree2x3x6", None]  # on, off, a tree mode
# the head's chain and tree, the model-free drafters of the same engine, off
HYBRID = ["chain3", "ngram:chain3", "ngram:chain3", "tree2x3x6", "suffix:tree2x3x6", None,
          "chain3", "suffix:tree2x3x6"]


@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1),
                                  dict(num_steps=2, topk=2, num_draft_tokens=5),
                                  pytest.param(dict(num_steps=3, topk=1, modes="tree2x3x6"),
                                               marks=pytest.mark.slow, id="switching"),
                                  pytest.param(dict(num_steps=3, topk=1, prompt_lookup_max=2,
                                                    modes="tree2x3x6,ngram:chain3,"
                                                          "suffix:tree2x3x6"),
                                               marks=pytest.mark.slow, id="drafters")])
def test_sampled_speculation_matches_plain_distribution(setup, spec: dict) -> None:
    """Also with the mode switched per step (chain <-> tree <-> off): the speculating steps
    and the plain ones both sample the target's distribution."""
    target, head, kw, plain = setup
    llm = LLM(target, speculative_config=dict(algorithm="eagle3", draft_model=head, **spec),
              enforce_eager=True, **kw)
    _fixed_proposals(llm, plain)
    if spec.get("modes"):
        from specserve.engine.spec_policy import ScriptedPolicy

        hybrid = "ngram" in spec["modes"]
        llm.engine.spec_policy = ScriptedPolicy(HYBRID if hybrid else SWITCH)
    got = _samples(llm)
    assert llm.engine.drafter.counters.num_accepted_tokens > 0, "drafts were never accepted"
    if spec.get("modes"):
        steps = llm.engine.drafter.counters.mode_steps
        assert all(steps[m] > 2 for m in ("off", *llm.engine.drafter.modes)), steps
    _check_same_law(plain, got)


@pytest.mark.parametrize("spec", [dict(algorithm="ngram", num_steps=3),
                                  dict(algorithm="suffix", num_steps=3, topk=2,
                                       num_draft_tokens=6)], ids=["ngram", "suffix"])
def test_sampled_model_free_drafters_match_plain_distribution(setup, spec: dict) -> None:
    """The real n-gram and suffix proposers (no patched drafts): n-gram drafts its filler (the
    root repeated) or a prompt match; suffix drafts from the outputs of the requests that
    finished before (its output cache), which the target often accepts."""
    target, _, kw, plain = setup
    llm = LLM(target, speculative_config=spec, enforce_eager=True, **kw)
    got = _samples(llm)
    assert llm.engine.drafter.counters.num_accepted_tokens > 50, "drafts were rarely accepted"
    _check_same_law(plain, got)


# strong enough that the token at output position 3 depends on the ones before it
PENALTIES = dict(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.8,
                 min_tokens=2, stop_token_ids=[230], logit_bias={99: 2.0, 41: -3.0})


@pytest.mark.slow  # ~25 s on a CPU core; test_logits_processor.py runs the rule's own test
def test_sampled_speculation_with_penalties_matches_plain(setup) -> None:
    """The same two-sample test with penalties, min_tokens and logit_bias on: each verify
    node's distribution sees its draft ancestors as generated (a tree exercises siblings)."""
    target, head, kw, plain_unpenalized = setup
    plain = _samples(LLM(target, **kw), **PENALTIES)
    assert Counter(s[1] for s in plain) != Counter(s[1] for s in plain_unpenalized)
    llm = LLM(target, speculative_config=dict(algorithm="eagle3", draft_model=head, num_steps=2,
                                              topk=2, num_draft_tokens=5),
              enforce_eager=True, **kw)
    _fixed_proposals(llm, plain)
    got = _samples(llm, **PENALTIES)
    assert llm.engine.drafter.counters.num_accepted_tokens > 0, "drafts were never accepted"
    _check_same_law(plain, got)
