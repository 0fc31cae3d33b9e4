"""Speculative decoding is lossless: greedy output == plain greedy output, token for token.

Also checks the accounting with an oracle drafter (proposes the target's own greedy tokens) and
exercises tree KV compaction with an oracle that hides the true token among decoy siblings.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint, record_preemptions

from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import TreeAccumulator

MAX_TOKENS = 24
CONFIGS = {
    "chain1": dict(num_steps=1, topk=1),
    "chain3": dict(num_steps=3, topk=1),
    "chain5": dict(num_steps=5, topk=1),
    "tree2x4": dict(num_steps=3, topk=2, num_draft_tokens=4),
    "tree2x8": dict(num_steps=3, topk=2, num_draft_tokens=8),
    "tree4x8": dict(num_steps=3, topk=4, num_draft_tokens=8),
    "tree4x16": dict(num_steps=3, topk=4, num_draft_tokens=16),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_checkpoint(root / "target", family="llama", tokenizer=True,
                                  num_hidden_layers=4)
    head = make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)
    return target, head


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(n)]


DEVICE = "cpu"


@pytest.fixture(scope="module", autouse=True,
                params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Every test runs on the CPU and (marked gpu) on CUDA, in fp32 on both."""
    global DEVICE
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    DEVICE = request.param
    return request.param


def _llm(target: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("cache", CacheConfig(page_size=4, kv_cache_bytes=16 << 20, num_pages=1024))
    return LLM(target, device=DEVICE, dtype="float32", speculative=spec, **kw)


@pytest.fixture(scope="module")
def reference(pair: tuple[str, str], device: str) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy outputs for every prompt the tests use."""
    llm = _llm(pair[0])
    prompts = _prompts(16, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_greedy_speculation_equals_plain(pair, reference, name: str, bs: int) -> None:
    if bs == 16 and name not in ("chain3", "tree4x16"):
        pytest.skip("batch 16 runs for one chain and one tree config to keep the suite fast")
    prompts = [list(p) for p in reference][:bs]
    kw = {}
    if name == "tree2x8" and bs == 4:  # force preemptions: a pool far smaller than the batch
        kw["cache"] = CacheConfig(page_size=4, num_pages=40)
        kw["scheduler"] = SchedulerConfig(max_num_batched_tokens=32)
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], **CONFIGS[name]), **kw)
    preemptions = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)], f"{name} bs={bs} diverged on prompt {p}"
        assert o.spec_cycles > 0
    if kw:
        assert preemptions, "the small pool was meant to force a preemption"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


def _oracle_propose(llm: LLM, reference: dict, decoys: bool):
    """A drafter that knows the target's greedy continuation. With decoys, the true depth-1
    token gets a sibling scored above it (whose subtree is kept too), so the accepted path's
    nodes are not at slots 1, 2, ... and its KV must be compacted into place."""
    drafter = llm.engine.drafter
    k, steps = drafter.k, drafter.num_steps
    device = drafter.runner.device

    def truth(req, root: int, depth: int) -> int:
        full = list(req.prompt_token_ids) + reference[tuple(req.prompt_token_ids)]
        pos = root + depth
        return full[pos] if pos < len(full) else 0

    def logp_and_ids(true_ids: list[int], decoy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # [bs, k]: the true token first, or second behind a better-scored decoy
        rows_lp, rows_id = [], []
        for t in true_ids:
            ids = [t] + [(t + 7 * (j + 1)) % 500 for j in range(k - 1)]
            lp = [0.0] + [-2.0 - j for j in range(k - 1)]
            if decoy and k > 1:
                ids[0], ids[1] = ids[1], ids[0]
                lp[0], lp[1] = -0.1, -0.2
            rows_id.append(ids)
            rows_lp.append(lp)
        return torch.tensor(rows_lp, device=device), torch.tensor(rows_id, device=device)

    stash: list = []
    speculate = drafter._speculate

    def spy(rows, *args, **kw):
        stash[:] = [rows]
        return speculate(rows, *args, **kw)

    drafter._speculate = spy

    def propose(last_out, root_pos, root_tokens, page_table, valid):
        reqs = [llm.engine.get_request(rid) for rid in stash[0].request_ids]
        roots = stash[0].starts.tolist()
        lp, ids = logp_and_ids([truth(r, p, 1) for r, p in zip(reqs, roots)], decoys)
        acc = TreeAccumulator(lp, ids, None)
        for s in range(1, steps):
            # children of every frontier slot: the true next token only matters on the true path
            child_lp, child_ids = [], []
            for r, p in zip(reqs, roots):
                lp_b, id_b = logp_and_ids([truth(r, p, s + 1)] * k, False)
                child_lp.append(lp_b)
                child_ids.append(id_b)
            acc.extend(torch.stack(child_lp), torch.stack(child_ids))
        return acc.build(root_tokens, drafter.n)

    return propose


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_oracle_chain_accept_length_is_exact(pair, reference, steps: int) -> None:
    # eager: the oracle replaces a Python method, which a captured graph would not call
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], num_steps=steps, topk=1),
               enforce_eager=True)
    llm.engine.drafter.cycle.propose = _oracle_propose(llm, reference, decoys=False)
    prompts = [list(p) for p in reference][:4]
    cycles = 3
    # one token from the prefill, then `cycles` full cycles of steps + 1 tokens
    max_tokens = 1 + cycles * (steps + 1)
    assert max_tokens <= MAX_TOKENS
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)][:max_tokens]
        assert o.spec_cycles == cycles
        assert o.accept_length == steps + 1
        assert o.spec_accepted_per_pos[:steps] == [cycles] * steps
    c = llm.engine.drafter.counters
    assert c.num_drafts == cycles * len(prompts)
    assert c.num_accepted_tokens == cycles * steps * len(prompts)


@pytest.mark.parametrize("topk,n", [(2, 6), (4, 10)])
def test_oracle_tree_with_decoys_compacts_kv(pair, reference, topk: int, n: int) -> None:
    """The true path is never the first child: output stays exact only if the accepted
    nodes' KV is moved into place."""
    llm = _llm(pair[0], dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=topk,
                             num_draft_tokens=n), enforce_eager=True)
    llm.engine.drafter.cycle.propose = _oracle_propose(llm, reference, decoys=True)
    prompts = [list(p) for p in reference][:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference[tuple(p)]
        assert o.accept_length > 2.0  # the oracle path is (mostly) accepted
