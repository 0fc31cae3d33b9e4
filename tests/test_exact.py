"""Exact mode: a row's result does not depend on the rows computed with it.

Per kernel's torch path (the CPU's): the same row alone and inside a batch of random others,
bitwise (the Triton kernels: test_exact_kernels.py). Per engine: with exact on, greedy
speculative output == plain greedy == the same request alone, under batching, chunked prefill
and preemption, in bf16.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from test_exact_kernels import (  # noqa: E402
    _row_alone_vs_batched,
    check_mla_decode_equals_extend_and_verify,
)

from specserve.kernels import exact_gemm as eg  # noqa: E402
from specserve.kernels import mla_attention as mla  # noqa: E402
from specserve.kernels import paged_attention as pa  # noqa: E402
from specserve.kernels.dispatch import EXACT, set_exact  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.fixture
def exact_on():
    set_exact(True, max_positions=1024)
    yield
    set_exact(False)


@pytest.fixture(params=["exact", "attention only"])
def exact_attention(request):
    """Exact mode, or its attention part alone (EngineConfig.exact_attention): the attention
    kernels' invariance holds in both."""
    set_exact(request.param == "exact", max_positions=1024, attention=True)
    yield
    set_exact(False)


# --------------------------------------------------------------------------------------------
# torch paths (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 7, 64])
def test_rowwise_linear_is_row_invariant(dtype: torch.dtype, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(dtype)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    _row_alone_vs_batched(lambda t: eg.rowwise_linear(t, w, b), x, m // 2)
    # and it computes x W^T + b
    torch.testing.assert_close(
        eg.rowwise_linear(x, w, b).float(),
        (x.float() @ w.float().T + b.float()),
        atol=0.1,
        rtol=0.02,
    )


def test_exact_gemm_ref_is_row_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 200, generator=g)
    w = torch.randn(48, 200, generator=g)
    torch.testing.assert_close(eg.exact_gemm_ref(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_linear_layer_uses_the_exact_path(exact_on) -> None:
    from specserve.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 40, bias=True)
    g = torch.Generator().manual_seed(1)
    layer.weight.data.normal_(generator=g)
    layer.bias.data.normal_(generator=g)
    x = torch.randn(9, 64, generator=g)
    with torch.no_grad():
        _row_alone_vs_batched(layer, x, 4)
        assert torch.equal(layer(x), eg.rowwise_linear(x, layer.weight, layer.bias))


def test_quantized_and_moe_torch_paths_are_row_invariant(exact_on) -> None:
    from specserve.kernels.fp8_gemm import fp8_mm_torch, quant_fp8_torch
    from specserve.kernels.fused_moe import fused_moe_ref

    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(128, 256, generator=g).to(torch.float8_e4m3fn)
    ws = torch.rand(1, 2, generator=g) + 0.5

    def fp8(t: torch.Tensor) -> torch.Tensor:
        xq, xs = quant_fp8_torch(t, 128)
        return fp8_mm_torch(xq, xs, 128, w, ws, 128, 128, torch.bfloat16)

    _row_alone_vs_batched(fp8, x, 6)
    experts, top_k, inter = 4, 2, 32
    w13 = torch.randn(experts, 2 * inter, 256, generator=g).to(torch.bfloat16)
    w2 = torch.randn(experts, 256, inter, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts, (11, top_k), generator=g)
    weights = torch.rand(11, top_k, generator=g)
    r = 6
    alone = fused_moe_ref(x[r : r + 1].clone(), w13, w2, weights[r : r + 1], ids[r : r + 1])
    assert torch.equal(alone[0], fused_moe_ref(x, w13, w2, weights, ids)[r])


def _attend_case(dtype: torch.dtype, seed: int):
    from specserve.layers.backends.torch_ref import attention_mask

    g = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, d = 37, 4, 2, 16
    k = torch.randn(seq_len, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(seq_len, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(6, heads, d, generator=g).to(dtype)
    return q, k, v, attention_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_decode_equals_extend_and_verify(exact_attention, dtype: torch.dtype) -> None:
    from specserve.layers.backends.torch_ref import attend

    q, k, v, attention_mask = _attend_case(dtype, 3)
    seq_len, scale = k.shape[0], 0.25
    # extend: the 6 queries are the last 6 positions; query 2 sits at position seq_len - 4
    pos = seq_len - 4
    extend = attend(q, k, v, attention_mask(6, seq_len, None, q.device), scale)[2]
    # decode of the same query at the same position, its context only
    decode = attend(
        q[2:3], k[: pos + 1], v[: pos + 1], attention_mask(1, pos + 1, None, q.device), scale
    )[0]
    assert torch.equal(extend, decode)
    # tree verify: query 2's ancestors are queries 0 and 1 (a chain), its siblings 3..5 are not
    tree = torch.zeros(6, 6, dtype=torch.bool)
    tree[torch.arange(6), torch.arange(6)] = True
    tree[1, 0] = tree[2, :2] = True
    tree[3, 0] = tree[4, 3] = tree[5, 0] = True
    verify = attend(q, k, v, attention_mask(6, seq_len, tree, q.device), scale)[2]
    assert torch.equal(verify, decode)


def test_sampler_argmax_is_per_row() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 300, generator=g).to(torch.bfloat16)
    _row_alone_vs_batched(lambda t: t.float().argmax(-1), logits, 7)


def test_rms_norm_is_row_invariant() -> None:
    from specserve.layers.norm import RMSNorm

    norm = RMSNorm(96)
    g = torch.Generator().manual_seed(6)
    norm.weight.data.normal_(generator=g)
    x = torch.randn(17, 96, generator=g).to(torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    with torch.no_grad():
        _row_alone_vs_batched(lambda t: norm(t), x, 11)


def test_exact_attention_plan_is_fixed(exact_attention) -> None:
    plans = {
        pa.launch_plan(bs, q, 4, 2, masked, torch.device("cpu"))[2:]
        for bs in (1, 16, 64)
        for q in (1, 4, 300)
        for masked in (False, True)
    }
    assert plans == {(EXACT.kv_splits, pa.EXACT_BLOCK_N, 4, 2)}
    assert EXACT.kv_splits * EXACT.kv_split_tokens >= 1024
    block_ms = {
        pa.launch_plan(bs, q, 4, 2, False, torch.device("cpu"))[0]
        for bs in (1, 64)
        for q in (1, 4, 300)
    }
    assert len(block_ms) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_torch_path_decode_equals_extend_and_verify(exact_attention, dtype: torch.dtype) -> None:
    check_mla_decode_equals_extend_and_verify(mla.mla_attention_ref, "cpu", dtype)


def test_mla_absorption_and_router_are_row_invariant(exact_on) -> None:
    """W_UK / W_UV per head (exact_bmm: one row at a time on the CPU) and the MoE router."""
    from specserve.config import MoEConfig
    from specserve.layers.moe import MoEGate

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 4, 48, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 64, 48, generator=g).to(torch.bfloat16)
    _row_alone_vs_batched(lambda t: eg.exact_bmm(t, w), x, 5)
    ref = torch.bmm(x.float().transpose(0, 1), w.float().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(eg.exact_bmm(x, w).float(), ref, atol=0.1, rtol=0.02)
    gate = MoEGate(48, MoEConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8,
                                 n_group=4, topk_group=2))
    gate.weight.data.normal_(generator=g)
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.data.normal_(generator=g)
    h = torch.randn(11, 48, generator=g)
    with torch.no_grad():
        for part in (0, 1):
            _row_alone_vs_batched(lambda t, part=part: gate(t)[part], h, 6)


def test_attention_only_leaves_the_gemms_default(monkeypatch) -> None:
    """exact_attention alone: attention plans fixed, dense linears on their default path."""
    from specserve.layers.linear import ReplicatedLinear
    from specserve.layers.quantization import unquantized

    def no_exact_gemm(*a, **k):
        raise AssertionError("exact GEMM under attention-only exactness")

    monkeypatch.setattr(unquantized, "exact_linear", no_exact_gemm)
    set_exact(False, max_positions=1024, attention=True)
    try:
        assert EXACT.attention and not EXACT.on
        layer = ReplicatedLinear(8, 4, bias=False)
        with torch.no_grad():
            layer(torch.randn(3, 8))  # F.linear: no exact GEMM
        plan = pa.launch_plan(64, 4, 4, 2, True, torch.device("cpu"))[2:]
        assert plan == (EXACT.kv_splits, pa.EXACT_BLOCK_N, 4, 2)
    finally:
        set_exact(False)
    assert not EXACT.attention
    assert pa.launch_plan(64, 4, 4, 2, True, torch.device("cpu"))[2:] != plan


def test_exact_mla_takes_the_absorbed_form(exact_attention) -> None:
    from specserve.config import MLAConfig
    from specserve.layers.attention_metadata import AttentionMetadata
    from specserve.layers.mla import choose_form

    mla_cfg = MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128)
    md = AttentionMetadata.__new__(AttentionMetadata)
    md.custom_mask, md.query_lens_cpu, md.seq_lens_cpu = None, [2048], [2048]
    assert choose_form(md, 16, mla_cfg) == "absorbed"  # a long prefill: compute when not exact
    set_exact(False)
    assert choose_form(md, 16, mla_cfg) == "compute"


# --------------------------------------------------------------------------------------------
# engine


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "deepseek_v3", "glm_moe_dsa"])
def pair(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny target of each attention kind (GQA; MLA + MoE; GLM-5's MLA + DSA selecting 4
    tokens, so the index scores' top-k picks in every decode and verify past 4 tokens) with
    a random EAGLE-3 head."""
    from tiny_eagle import make_tiny_eagle3_head
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("exact")
    extra = {"llama": {"num_hidden_layers": 4}, "deepseek_v3": {},
             "glm_moe_dsa": {"index_topk": 4}}[request.param]
    target = make_tiny_checkpoint(root / "target", family=request.param, tokenizer=True, **extra)
    return target, make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_exact_engine_greedy_identical(pair, device: str) -> None:
    from engine_drivers import record_preemptions

    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA and triton")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(6, seed=2)

    def run(spec: dict | None, batched: bool, **kw) -> list[list[int]]:
        kw.setdefault("cache", CacheConfig(page_size=4, num_pages=512))
        llm = LLM(
            pair[0], device=device, dtype="bfloat16", exact=True, speculative_config=spec, **kw
        )
        try:
            if batched:
                return [o.token_ids for o in llm.generate(prompts, params)]
            return [llm.generate([p], params)[0].token_ids for p in prompts]
        finally:
            llm.close()
            set_exact(False)  # the mode is per process: leave it off for other tests

    alone = run(None, batched=False)
    assert run(None, batched=True, scheduler=SchedulerConfig(max_num_batched_tokens=16)) == alone
    chain = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=1)
    assert run(chain, batched=True) == alone
    tree = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=2, num_draft_tokens=6)
    # a pool far smaller than the batch: preemption and recompute
    small = dict(
        cache=CacheConfig(page_size=4, num_pages=24),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    llm_check = LLM(
        pair[0], device=device, dtype="bfloat16", exact=True, speculative_config=tree, **small
    )
    try:
        preempted = record_preemptions(llm_check.engine.scheduler)
        out = [o.token_ids for o in llm_check.generate(prompts, params)]
        assert preempted, "the small pool was meant to force a preemption"
    finally:
        llm_check.close()
        set_exact(False)
    assert out == alone


@pytest.mark.parametrize("topk", [1, 2])
def test_exact_attention_chain_verifies_causally(tmp_path, topk: int) -> None:
    """Under exact attention a chain's verify forward goes through the causal launch (no
    mask: its rows equal decodes of their tokens, one program a query block), a tree's through
    the masked one; greedy output stays plain decoding's."""
    from tiny_eagle import make_tiny_pair

    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    target, head = make_tiny_pair(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(6, seed=5)
    # two rows at a time: prompts arrive beside decoding rows, their chunks riding in the
    # cycle's verify forward (one causal attention for a chain, SplitMetadata for a tree)
    kw = dict(device="cpu", dtype="float32", exact_attention=True,
              cache=CacheConfig(page_size=4, num_pages=256),
              scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    try:
        with LLM(target, **kw) as llm:
            want = [o.token_ids for o in llm.generate(prompts, params)]
        spec = dict(algorithm="eagle3", draft_model=head, num_steps=3, topk=topk,
                    num_draft_tokens=4 if topk == 1 else 6)
        with LLM(target, speculative_config=spec, **kw) as llm:
            runner, masks = llm.engine.runner, []
            metadata = runner.graph_metadata

            def spy(slots, seq_lens, page_table, q_len, custom_mask=None):
                masks.append((q_len, custom_mask))
                return metadata(slots, seq_lens, page_table, q_len, custom_mask)

            runner.graph_metadata = spy
            got = [o.token_ids for o in llm.generate(prompts, params)]
            chunks = llm.engine.drafter.counters.num_chunks_in_verify
    finally:
        set_exact(False)
    assert chunks > 0
    width = spec["num_draft_tokens"]  # the verify forwards' (the drafter's have other widths)
    verify = [m for q, m in masks if q == width]
    assert got == want and len(verify) > 3
    assert all((m is None) == (topk == 1) for m in verify)


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_exact_seeded_sampling_is_batch_invariant(pair) -> None:
    """Seeded sampling under --exact: every request's tokens are the same run alone as in a
    batch of six, for plain decoding and for an EAGLE-3 chain (its rejection sampling draws
    from the request's seed); one prompt under two seeds shows the draws are real."""
    from specserve.config import CacheConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    prompts = _prompts(5, seed=3)
    prompts.append(prompts[0])
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=20 + i, max_tokens=12,
                             ignore_eos=True) for i in range(6)]
    chain = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=1)
    for spec in (None, chain):
        llm = LLM(pair[0], device="cpu", dtype="bfloat16", exact=True, speculative_config=spec,
                  cache=CacheConfig(page_size=4, num_pages=512))
        try:
            batched = [o.token_ids for o in llm.generate(prompts, params)]
            alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        finally:
            llm.close()
            set_exact(False)
        assert batched == alone, spec
        assert batched[0] != batched[5], "two seeds drew the same tokens"
