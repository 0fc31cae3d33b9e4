"""MTP / NextN drafting (speculative/mtp.py) on tiny DeepSeek-V3 (MLA + MoE), GLM-4.5 (GQA +
MoE), GLM-4.7-Flash (MLA, per-layer mlp_layer_types) and GLM-5 (MLA + DSA: index_topk past
every length, and 4 with a shared-indexer layer) checkpoints carrying an MTP layer
(tests/tiny_mtp.py), fp32 on the CPU:
  - the proposer's draft logits for a chain of k steps, over the first cycles of a request
    (the prefill extend, then extends over accepted tokens), equal a plain-torch reference of
    the MTP math (transformers' own decoder layer as the block; GLM-5's runs its own indexer:
    dense MLA, or top-4 selection in the extends and the chained steps over scratch slots);
  - greedy output with MTP speculation equals plain decoding for 8 prompts under continuous
    batching with chunked prefill and a forced preemption (and with prefix caching, and under
    TP 2, which drafts what TP 1 drafts); sampled output keeps the plain distribution;
  - on a GPU (marker `gpu`), the speculative cycle captured as CUDA graphs equals the eager
    engine and plain decoding.
Loading the MTP layer (random weights, refusals, the GLM-5 preset, the speculative config, the
CLI) is tested in test_mtp_loading.py.
"""

from __future__ import annotations

import mtp_fixtures
import pytest
import torch
from engine_drivers import record_preemptions
from mtp_fixtures import GREEDY, _mtp, _prompts
from tiny_mtp import reference_chain

from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

FAMILIES = ["deepseek_v3", "glm4_moe"]
ALL = [*FAMILIES, "glm4_moe_lite",  # + GLM-4.7-Flash: MLA, mlp_layer_types, no MTP entry
       "glm_moe_dsa", "glm_moe_dsa_sparse"]  # + GLM-5: index_topk past every length, and 4

# the fixture of mtp_fixtures.py, bound here so that pytest finds it in this module
ckpts = mtp_fixtures.ckpts


@pytest.fixture(scope="module")
def plain(ckpts) -> dict[str, list[list[int]]]:
    """Plain greedy tokens of the 8 prompts, per family (a pool that never preempts)."""
    out = {}
    for name, (path, _) in ckpts.items():
        llm = LLM(path, device="cpu", dtype="float32")
        out[name] = [o.token_ids for o in llm.generate(_prompts(8), GREEDY)]
    return out


@pytest.mark.parametrize("name", ALL)
def test_draft_logits_equal_the_reference(ckpts, name: str) -> None:
    """Every cycle of one request: the real chain's k logits against the reference. The tree
    the cycle verifies is an oracle's (the plain continuation, right for the first
    c % (k + 1) tokens of cycle c): random MTP weights are almost never accepted, and the
    layer's KV and state after accepting 0..k tokens are what later cycles read."""
    from specserve.speculative.tree import TreeAccumulator

    path, hf4 = ckpts[name]
    k = 3
    prompt = [5, 17, 99, 3, 250, 41, 7, 300, 12]
    seq = prompt + LLM(path, device="cpu", dtype="float32").generate([prompt], GREEDY)[0].token_ids
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=_mtp(k),
              enforce_eager=True)
    proposer = llm.engine.drafter.proposer
    head = proposer.head
    if name == "deepseek_v3":  # the equal embedding copy is shared, the own head kept
        assert not hasattr(head, "embed_tokens") and hasattr(head.shared_head, "head")
    else:
        assert not hasattr(head, "embed_tokens") and not hasattr(head.shared_head, "head")
    cycles: list[tuple[int, list[torch.Tensor]]] = []
    propose, logits_of = proposer.propose, head.compute_logits

    def oracle(shape, state, root_pos, root_tokens, *args):
        root = int(root_pos[0])
        cycles.append((root, []))
        propose(shape, state, root_pos, root_tokens, *args)  # the real drafts: logits spied
        right = len(cycles) % (k + 1)
        ids = [seq[root + d] if d <= right else (seq[root + d] + 1) % 512
               for d in range(1, k + 1)]
        acc = TreeAccumulator(torch.zeros(1, 1), torch.tensor([ids[:1]]), None)
        for t in ids[1:]:
            acc.extend(torch.zeros(1, 1, 1), torch.tensor([[[t]]]))
        return acc.build(root_tokens, shape.num_draft_tokens)

    def spy_logits(out):
        logits = logits_of(out)
        cycles[-1][1].append(logits[0].clone())
        return logits

    proposer.propose, head.compute_logits = oracle, spy_logits
    dsa_paths = _dsa_spy(head) if name.startswith("glm_moe_dsa") else None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    assert prompt + out[0].token_ids == seq[:len(prompt) + 13]
    assert llm.engine.drafter.counters.accepted_per_pos[k - 1] > 0  # whole chains accepted
    assert len(cycles) >= 5 and cycles[0][0] == len(prompt)
    for root, logits in cycles:
        want = reference_chain(path, hf4, seq[: root + 1], k)
        got = torch.stack(logits)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if dsa_paths is not None:
        _check_glm5_mtp_layer(llm, name, dsa_paths)
        if name == "glm_moe_dsa_sparse":  # the MTP layer's own top-4 shapes its logits
            indexer = hf4.model.layers[3].self_attn.indexer
            indexer.index_topk = 4096
            try:
                dense = reference_chain(path, hf4, seq[: root + 1], k)
            finally:
                indexer.index_topk = 4
            assert (dense - want).abs().max().item() > 1e-2


def _dsa_spy(head) -> list[tuple[bool, bool]]:
    """(sparse, tree-masked) of every forward of the MTP layer's DSA attention."""
    attn, calls = head.self_attn, []
    index = attn._index

    def spy(ops, positions, hidden, q_resid, md, sparse):
        calls.append((sparse, md.custom_mask is not None))
        return index(ops, positions, hidden, q_resid, md, sparse)

    attn._index = spy
    return calls


def _check_glm5_mtp_layer(llm: LLM, name: str, calls: list[tuple[bool, bool]]) -> None:
    """The MTP layer is a full DSA layer: its own indexer, its own pool layer (latent and
    index-key pages, not a target layer's), dense MLA at index_topk 4096 and the indexer's
    selection at 4, in the extends and in the chained steps over scratch slots (masked)."""
    from specserve.layers.dsa import DSAAttention

    proposer = llm.engine.drafter.proposer
    attn, runner = proposer.head.self_attn, proposer.runner
    assert isinstance(attn, DSAAttention) and attn.indexer is not None
    assert attn.selection is not runner.attn_layers[0].selection
    assert runner.kv_pool.specs[-1].names == ("latent", "index_k") == attn.kv_spec.names
    assert len(runner.kv_pool.specs) == len(runner.attn_layers) + 1
    ptrs = {m.index_k_cache.data_ptr() for m in runner.attn_layers if m.indexer is not None}
    assert attn.index_k_cache.numel() > 0 and attn.index_k_cache.data_ptr() not in ptrs
    if name == "glm_moe_dsa_sparse":
        assert [m.indexer is None for m in runner.attn_layers] == [False, True, False]
    sparse = name == "glm_moe_dsa_sparse"
    assert {(sparse, False), (sparse, True)} == set(calls)


@pytest.mark.parametrize("name", ALL)
def test_mtp_greedy_equals_plain_under_batching_and_preemption(ckpts, plain, name) -> None:
    path, _ = ckpts[name]
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=_mtp(3),
              cache=CacheConfig(page_size=4, num_pages=40),
              scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    preempted = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(_prompts(8), GREEDY)
    assert preempted, "the pool was sized to force at least one preemption"
    assert [o.token_ids for o in outs] == plain[name]
    assert all(o.spec_cycles > 0 for o in outs)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


def _drafts_spy(llm: LLM) -> list[list[int]]:
    """Every tree the (rank-0) proposer drafts, as token lists."""
    return spy_trees(llm.engine.drafter.proposer)


def spy_trees(proposer) -> list[list[int]]:
    """Every tree `proposer` drafts from now on, as token lists."""
    trees: list[list[int]] = []
    propose = proposer.propose

    def spy(*args):
        tree = propose(*args)
        trees.extend(tree.tokens.tolist())
        return tree

    proposer.propose = spy
    return trees


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa_sparse"])
def test_mtp_tree_and_prefix_caching_equal_plain(ckpts, plain, name: str) -> None:
    """A tree (topk 2) over the MLA target (and GLM-5's, whose MTP layer scores the tree's
    scratch slots through the tree mask), every prompt run twice, prefix caching off and
    on: the second wave's requests start on cached pages holding the MTP layer's KV (and
    index keys), and draft exactly the trees they draft without caching (one request at a
    time)."""
    path, _ = ckpts[name]
    drafts, cached = {}, {}
    for caching in (False, True):
        llm = LLM(path, device="cpu", dtype="float32",
                  speculative_config=_mtp(3, topk=2, num_draft_tokens=6),
                  cache=CacheConfig(page_size=4, num_pages=200, enable_prefix_caching=caching),
                  scheduler=SchedulerConfig(max_num_seqs=1))
        assert (llm.engine.prefix_cache is not None) == caching
        drafts[caching] = _drafts_spy(llm)
        for _ in range(2):
            outs = llm.generate(_prompts(8)[:4], GREEDY)
            assert [o.token_ids for o in outs] == plain[name][:4]
        cached[caching] = sum(o.num_cached_tokens for o in outs)
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_total
    assert cached[False] == 0 and cached[True] > 30
    assert llm.engine.drafter.proposer.prefix_cache_key == f"mtp layer 3 of {path}"
    assert len(drafts[True]) > 50 and drafts[True] == drafts[False]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*FAMILIES, "glm_moe_dsa_sparse"])
def test_tp2_mtp_equals_tp1(ckpts, plain, name: str) -> None:
    """The gloo TP runtime: the MTP layer's attention and experts split over 2 ranks like
    the target's layers draft what TP 1 drafts, and the tokens are plain decoding's."""
    from specserve.config import ParallelConfig

    drafts = {}
    for tp in (1, 2):
        llm = LLM(ckpts[name][0], device="cpu", dtype="float32", speculative_config=_mtp(3),
                  parallel=ParallelConfig(tp_size=tp), enforce_eager=True,
                  scheduler=SchedulerConfig(max_num_seqs=1))
        drafts[tp] = _drafts_spy(llm)
        try:
            outs = llm.generate(_prompts(8)[:3], GREEDY)
        finally:
            llm.close()
        assert [o.token_ids for o in outs] == plain[name][:3]
    assert len(drafts[1]) > 20 and drafts[1] == drafts[2]


@pytest.fixture(scope="module")
def sampling(ckpts):
    """The DeepSeek-V3 checkpoint, the engine settings of test_spec_sampling and its plain
    samples."""
    from test_spec_sampling import N, _samples

    kw = dict(device="cpu", dtype="float32", cache=CacheConfig(page_size=8, num_pages=4096),
              scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096,
                                        max_waiting=N))
    path = ckpts["deepseek_v3"][0]
    return path, kw, _samples(LLM(path, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["mtp", "fixed"])
def test_sampled_mtp_matches_plain_distribution(sampling, drafts: str) -> None:
    """test_spec_sampling's chi-square test with the MTP drafter: its own drafts (random
    weights: never in the target's top-6 here, so every cycle takes the rejection path), and
    fixed drafts the target often accepts (the MTP layer still extends over every emitted
    token)."""
    from collections import Counter

    from test_spec_sampling import _chi2_two_sample, _critical_999, _fixed_proposals, _samples

    path, kw, plain = sampling
    llm = LLM(path, speculative_config=_mtp(3), enforce_eager=True, **kw)
    if drafts == "fixed":
        _fixed_proposals(llm, plain)
    got = _samples(llm)
    counters = llm.engine.drafter.counters
    assert counters.num_drafts >= len(got)
    if drafts == "fixed":
        assert counters.num_accepted_tokens > 0, "drafts were never accepted"
    for pos in (1, 2):
        stat, dof = _chi2_two_sample(Counter(s[pos] for s in plain),
                                     Counter(s[pos] for s in got))
        assert dof >= 2
        assert stat < _critical_999(dof), (pos, stat, dof)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [dict(), dict(topk=2, num_draft_tokens=6)])
@pytest.mark.parametrize("name", [*FAMILIES, "glm_moe_dsa_sparse"])
def test_cuda_graphs_equal_eager_and_plain(ckpts, name: str, spec: dict) -> None:
    """fp32 on the GPU (Triton backend): the speculative cycle captured as CUDA graphs with
    the MTP layer inside gives the eager engine's tokens, and plain decoding's."""
    path = ckpts[name][0]
    outs = {}
    for eager in (True, False, None):  # None: plain decoding (graphs)
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=bool(eager),
                  cache=CacheConfig(page_size=16, num_pages=256),
                  speculative_config=None if eager is None else _mtp(3, **spec))
        outs[eager] = [o.token_ids for o in llm.generate(_prompts(8)[:6], GREEDY)]
        if eager is False:
            assert llm.engine.drafter.num_graphs > 0
        llm.close()
    assert outs[True] == outs[False] == outs[None]
