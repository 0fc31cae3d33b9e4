"""Token CUDA graphs (worker/token_graphs.py): steps with prefill chunks through a forward
captured per token bucket over padded inputs.

On the CPU the padded forward runs eagerly (TokenGraphs(capture=False)): the padding, the
block table and the routing of a step through a bucket are checked against the plain eager
forward and against an engine without them; the GPU test replays captured graphs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.config import CacheConfig
from specserve.engine.step_builder import build_step_input
from specserve.kernels.paged_attention import PAD_BLOCK
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.worker.token_graphs import TokenGraphs, block_table, token_buckets


def test_token_buckets() -> None:
    assert token_buckets(2048) == [16, 32, 64, 128, 256, *range(512, 2049, 256)]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(2144)[-3:] == [1792, 2048, 2144]


def test_block_table_matches_a_naive_listing() -> None:
    rng = random.Random(0)
    for _ in range(50):
        q_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        block_m = rng.choice([1, 4, 16, 32])
        capacity = -(-sum(q_lens) // block_m) + len(q_lens)
        want = [(r, m) for r, q in enumerate(q_lens) for m in range(-(-q // block_m))]
        want += [(0, PAD_BLOCK)] * (capacity - len(want))
        got = block_table(np.array(q_lens), block_m, capacity)
        assert got.dtype == np.int32 and [tuple(x) for x in got.tolist()] == want
    with pytest.raises(AssertionError, match="exceed"):
        block_table(np.array([5, 5]), 4, 3)


def cpu_llm(**kw) -> LLM:
    return LLM("tiny-llama", load_format="dummy", device="cpu",
               scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64,
                          "max_model_len": 512}, **kw)


def eager_token_graphs(runner, max_tokens: int = 64, max_rows: int = 8) -> TokenGraphs:
    layer = runner.attn_layers[0]
    return TokenGraphs(runner.forward, max_tokens, max_rows, runner.max_pages,
                       runner.max_positions, layer.num_heads // layer.num_kv_heads,
                       layer.num_kv_heads, runner.page_size, runner.spare_page, runner.device,
                       capture=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return cpu_llm()


def test_padded_forward_equals_the_eager_forward(llm: LLM) -> None:
    """Decodes beside a new prompt's chunk: the bucket's padded forward (pad tokens, pad rows,
    slots -1) gives the real tokens' hidden states of the plain forward."""
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for _ in range(3):
        engine.add_request(None, [rng.randrange(3, 500) for _ in range(rng.randint(2, 20))],
                           params)
    engine.step()
    engine.add_request(None, [rng.randrange(3, 500) for _ in range(23)], params)
    step = build_step_input(engine.scheduler.schedule())
    assert step.bs == 4 and sorted(step.num_new_tokens.tolist()) == [1, 1, 1, 23]
    graphs = eager_token_graphs(runner)
    table, _ = step.page_table(runner.spare_page)
    before = kv_slots(runner)
    padded = graphs.run(step.token_ids, step.positions(), step.num_new_tokens, step.seq_lens,
                        table)[0].clone()
    assert graphs.replays == {"plain": 1} and padded.shape[0] == 26  # bucket 32 over 8 rows
    changed = set((kv_slots(runner) != before).any(-1).nonzero().flatten().tolist())
    rows = np.repeat(np.arange(step.bs), step.num_new_tokens)
    pos = step.positions()
    ps = runner.page_size
    own = set((table[rows, pos // ps].astype(np.int64) * ps + pos % ps).tolist())
    assert changed <= own and len(changed) > 20, "padding wrote KV outside the step's slots"
    batch = runner.prepare(step)
    eager = runner.forward(batch.input_ids, batch.positions, batch.md)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)


def kv_slots(runner) -> torch.Tensor:
    """[slots, everything the pool holds for a slot] (all layers)."""
    parts = [t.movedim(0, 2).reshape(t.shape[1] * t.shape[2], -1)  # [L, P, S, ...]
             for g in runner.kv_pool.groups for t in g.tensors.values()]
    return torch.cat(parts, dim=1).clone()


def test_no_bucket_holds_a_step_past_the_largest(llm: LLM) -> None:
    graphs = eager_token_graphs(llm.engine.runner, max_tokens=32, max_rows=4)
    assert graphs.bucket(33, 1) is None and graphs.bucket(32, 4) == 32
    assert graphs.bucket(10, 5) is None  # more rows than any bucket holds
    assert graphs.bucket(3, 3) == 16


def test_engine_through_token_buckets_equals_eager_engine() -> None:
    """Whole generations with chunked prefills beside decodes, every non-decode step routed
    through the buckets, equal an engine without them (greedy and seeded sampling)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 90))] for _ in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)]
    plain = cpu_llm()
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params * 3 + params[:1])]
    routed = cpu_llm()
    runner = routed.engine.runner
    runner.token_graphs = eager_token_graphs(runner)
    got = [o.outputs[0].token_ids for o in routed.generate(prompts, params * 3 + params[:1])]
    assert got == want
    assert runner.token_graphs.replays["plain"] > 5  # the prefill and mixed steps went through them


@pytest.mark.parametrize("accept,off", [("real", False), ("synthetic", False),
                                        ("synthetic", True)])
def test_speculative_chunks_through_token_buckets(tmp_path, accept: str, off: bool) -> None:
    """EAGLE-3 chain: prompt chunks that feed the drafter (the "features" variant: hidden
    states and aux features), chunks riding in the cycle's verify forward (the nodes' ids
    from the device) and, with steps off, the drafter's catch-up forwards (no KV written)
    through the buckets give the same tokens, acceptance and drafter state rows as the eager
    forwards (synthetic acceptance: nodes past the root are accepted, so their features and
    logits count)."""
    from test_spec_fold import OffAt, _llm, _states_after_each_step, _workload
    from tiny_eagle import make_tiny_pair

    from specserve.engine.spec_policy import StaticPolicy

    pair = make_tiny_pair(tmp_path)
    prompts, params = _workload(seed=7)
    extra = dict(synthetic_accept_rate=0.7) if accept == "synthetic" else {}
    runs = {}
    for graphed in (False, True):
        llm = _llm(pair, "cpu", 512, **extra)
        llm.engine.spec_policy = OffAt([4, 5, 6, 11, 12]) if off else StaticPolicy("chain3")
        if graphed:
            runner = llm.engine.runner
            runner.token_graphs = eager_token_graphs(runner, max_tokens=64, max_rows=8)
            runner.token_graphs.add_variant("features", llm.engine.drafter._features_forward)
            assert llm.engine.drafter.proposer.graph_extends(64, 8, capture=False)
        states = _states_after_each_step(llm)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        runs[graphed] = outs, states, llm.engine.drafter.counters
    extends = llm.engine.drafter.proposer.extend_graphs
    (outs, states, c), (outs2, states2, c2) = runs[False], runs[True]
    assert outs2 == outs and c2.accepted_per_pos == c.accepted_per_pos
    if off:
        assert c.num_catch_ups > 3 and c2.num_catch_up_tokens == c.num_catch_up_tokens
    assert c2.num_chunks_in_verify == c.num_chunks_in_verify > 5
    assert llm.engine.runner.token_graphs.replays["features"] > c.num_chunks_in_verify
    # the drafter's extends over chunks (and catch-ups) went through its own buckets
    assert extends.replays > 10 + (c.num_catch_ups if off else 0), extends.replays
    assert states.keys() == states2.keys() and len(states) > 50
    for key, row in states.items():
        torch.testing.assert_close(states2[key], row, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_token_graphs_equal_eager(dtype: str) -> None:
    """Captured token graphs (mixed steps replayed) vs --cuda-graph-max-tokens 0: the same
    greedy tokens (fp32), and in bf16 the same tokens for most requests (GEMMs over a padded
    row count may take other cuBLAS plans)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, replays = {}, {}
    for tokens in (0, 256):
        with LLM("tiny-llama", load_format="dummy", device="cuda", dtype=dtype,
                 cuda_graph_max_tokens=tokens, cache=CacheConfig(page_size=16, num_pages=512),
                 scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256}) as llm:
            outs[tokens] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            graphs = llm.engine.runner.token_graphs
            replays[tokens] = 0 if graphs is None else graphs.replays["plain"]
    same = sum(a == b for a, b in zip(outs[0], outs[256]))
    assert same == len(prompts) if dtype == "float32" else same >= len(prompts) - 2
    assert replays[0] == 0 and replays[256] >= 6  # every step with a chunk (~1800 tokens / 256)


@pytest.mark.gpu
def test_captured_token_graphs_with_speculation(tmp_path) -> None:
    """EAGLE-3 chain on CUDA (fp32, tiny pair): captured plain and feature variants (prompt
    chunks feeding the drafter, chunks in the verify forward: "always"; chunks in a forward
    of their own beside the captured cycle: "auto") and the drafter's captured extends give
    plain decoding's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from test_spec_fold import _workload
    from tiny_eagle import make_tiny_pair

    from specserve.config import SchedulerConfig
    from specserve.engine.spec_policy import StaticPolicy

    pair = make_tiny_pair(tmp_path)
    prompts, params = _workload(seed=8)
    kw = dict(device="cuda", dtype="float32", cache=CacheConfig(page_size=4, num_pages=512),
              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24))
    with LLM(pair[0], cuda_graph_max_tokens=0, **kw) as plain:  # eager prefill steps
        ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3)
    for along in ("always", "auto"):
        with LLM(pair[0], speculative_config=spec, cuda_graph_max_tokens=64, **kw) as llm:
            llm.engine.spec_policy = StaticPolicy("chain3")
            llm.engine.drafter.chunks_in_verify = along
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            replays = dict(llm.engine.runner.token_graphs.replays)
            chunks = llm.engine.drafter.counters.num_chunks_in_verify
            extends = llm.engine.drafter.proposer.extend_graphs.replays
        assert got == ref, along
        assert extends > 3, extends  # the prompts' chunks fed the drafter through its graphs
        if along == "always":
            assert chunks > 3 and replays["features"] > chunks, (replays, chunks)
        else:  # the cycles replay their graphs: the chunks went through token graphs alone
            assert chunks == 0 and replays["features"] > 3, replays


def test_chunks_ride_along_unless_both_forwards_replay_graphs(tmp_path) -> None:
    """The speculative worker's "auto" choice for a step's prefill chunks: a forward of their
    own where a token graph holds them and the cycle replays its captured graph, else along
    in the cycle's verify forward; "always" / "never" force either (both give plain
    decoding's tokens: test_spec_fold)."""
    from types import SimpleNamespace

    from test_spec_fold import _llm
    from tiny_eagle import make_tiny_pair

    llm = _llm(make_tiny_pair(tmp_path), "cpu", 64)
    worker, runner = llm.engine.drafter, llm.engine.runner
    chunks = SimpleNamespace(token_ids=np.zeros(20, dtype=np.int64), bs=2)
    long = SimpleNamespace(token_ids=np.zeros(70, dtype=np.int64), bs=2)

    def mode(graphed: bool) -> SimpleNamespace:
        return SimpleNamespace(cycles=SimpleNamespace(graphed=lambda rows: graphed))

    try:
        assert worker.chunks_in_verify == "auto"
        assert worker.chunks_ride_along(mode(True), None, chunks)  # no token graphs (CPU)
        runner.token_graphs = eager_token_graphs(runner, max_tokens=64, max_rows=8)
        assert not worker.chunks_ride_along(mode(True), None, chunks)
        assert worker.chunks_ride_along(mode(False), None, chunks)  # the cycle runs eagerly
        assert worker.chunks_ride_along(mode(True), None, long)  # no bucket holds 70 tokens
        worker.chunks_in_verify = "always"
        assert worker.chunks_ride_along(mode(True), None, chunks)
        worker.chunks_in_verify = "never"
        assert not worker.chunks_ride_along(mode(False), None, chunks)
    finally:
        llm.close()


def test_extend_graphs_cover_the_budget_or_the_eager_extends_warm(tmp_path) -> None:
    """A drafter whose extend graphs hold the scheduler's budget skips the eager warm-up of its
    extends; graphs smaller than the budget (--cuda-graph-max-tokens below it) leave the
    eager path for the rest, so it warms."""
    from test_spec_fold import _llm
    from tiny_eagle import make_tiny_pair

    from specserve.speculative.extend_graphs import covers, graph_extends

    llm = _llm(make_tiny_pair(tmp_path), "cpu", 64)
    try:
        runner, proposer = llm.engine.runner, llm.engine.drafter.proposer
        assert proposer.extend_graphs is None and not covers(proposer, 1)  # CPU: none
        runner.token_graphs = eager_token_graphs(runner, max_tokens=48, max_rows=8)
        graph_extends(runner, [proposer], 64, capture=False)  # capped at the target's 48
        assert covers(proposer, 48) and not covers(proposer, 49)
        assert proposer.graph_extends(64, 8, capture=False)
        assert covers(proposer, 64) and not covers(proposer, 65)
    finally:
        llm.close()
