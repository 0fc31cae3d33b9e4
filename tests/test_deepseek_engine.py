"""DeepSeek-V3 (MLA + MoE) and the Kimi K2.5 wrapper through the engine, fp32 on the CPU:
greedy continuations under continuous batching with chunked prefill and a forced preemption
equal single-request runs (and transformers' greedy decoding for the plain model); EAGLE-3
chain and tree speculation with a random head equals plain greedy decoding, and an oracle
drafter whose true path hides behind decoys is accepted only if the accepted nodes' latent KV
is moved into place."""

from __future__ import annotations

import random

import pytest
import torch
from engine_drivers import record_preemptions
from tiny_eagle import make_tiny_eagle3_head, oracle_propose
from tiny_models import make_kimi_k25_checkpoint, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from specserve.config import CacheConfig, SchedulerConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SPEC = {
    "chain3": dict(num_steps=3, topk=1),
    "tree2x8": dict(num_steps=3, topk=2, num_draft_tokens=8),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ds")
    return {
        "deepseek_v3": make_tiny_checkpoint(root / "dsv3", "deepseek_v3", tokenizer=True),
        "kimi_k25": make_kimi_k25_checkpoint(root / "k25", nvfp4_names=True),
    }


@pytest.fixture(scope="module")
def head(targets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    # Llama-style EAGLE-3 head on the target's hidden size (both targets share the dims)
    path = str(tmp_path_factory.mktemp("head") / "head")
    return make_tiny_eagle3_head(path, targets["deepseek_v3"], draft_vocab_size=128)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def single_runs(targets: dict[str, str]) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """Each prompt run alone (one request in the engine at a time), per target."""
    out = {}
    for name, path in targets.items():
        llm = LLM(path, device="cpu", dtype="float32")
        out[name] = {tuple(p): llm.generate([p], GREEDY)[0].token_ids for p in _prompts(8, 0)}
    return out


@pytest.fixture(scope="module")
def single(targets: dict[str, str]) -> dict[str, dict[tuple[int, ...], list[int]]]:
    return single_runs(targets)


def _hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(NEW_TOKENS):
                tok = model(ids).logits[0, -1].argmax().view(1, 1)
                ids = torch.cat([ids, tok], dim=1)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def check_batched_greedy(path: str, single: dict, hf_prompts: int = 0) -> None:
    """Continuous batching with chunked prefill and a forced preemption gives each prompt's
    single-request tokens (and, for the first hf_prompts, transformers' greedy ones)."""
    prompts = _prompts(8, 0)
    # a small token budget forces chunked prefill; a small pool forces preemptions
    llm = LLM(path, device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=60),
              scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))  # fmt: skip
    preempted = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(prompts, GREEDY)
    assert preempted, "the pool was sized to force at least one preemption"
    for p, o in zip(prompts, outs):
        assert o.token_ids == single[tuple(p)], f"{path} diverged on prompt {p}"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total
    if hf_prompts:  # an independent reference
        want = _hf_greedy(path, prompts[:hf_prompts])
        assert want == [o.token_ids for o in outs[:hf_prompts]]


def check_eagle3_greedy(path: str, head: str, single: dict, spec: str) -> None:
    """EAGLE-3 speculation (SPEC[spec]) gives plain greedy decoding's tokens; the tree run
    with a pool far smaller than the batch needs, forcing preemptions."""
    prompts = _prompts(8, 0)[:4]
    kw = {}
    if spec == "tree2x8":
        kw = dict(cache=CacheConfig(page_size=4, num_pages=40),
                  scheduler=SchedulerConfig(max_num_batched_tokens=32))  # fmt: skip
    spec_config = dict(algorithm="eagle3", draft_model=head, **SPEC[spec])
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=spec_config, **kw)
    preempted = record_preemptions(llm.engine.scheduler)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == single[tuple(p)], f"{path} {spec} diverged on prompt {p}"
        assert o.spec_cycles > 0
    if kw:
        assert preempted, "the small pool was meant to force a preemption"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


def check_oracle_tree(path: str, head: str, single: dict) -> None:
    """An oracle drafter whose true path hides behind decoys: accepted (and the tokens right)
    only if the accepted nodes' KV is moved into place."""
    spec = dict(algorithm="eagle3", draft_model=head, num_steps=3, topk=2, num_draft_tokens=6)
    # eager: the oracle replaces a Python method, which a captured graph would not call
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=spec, enforce_eager=True)
    llm.engine.drafter.proposer.propose = oracle_propose(llm, single, decoys=True)
    prompts = _prompts(8, 0)[:4]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == single[tuple(p)], f"{path} diverged on prompt {p}"
        assert o.accept_length > 2.0  # the oracle path is (mostly) accepted


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k25"])
def test_batched_greedy_equals_single_requests(targets, single, name: str) -> None:
    check_batched_greedy(targets[name], single[name], hf_prompts=3 if name == "deepseek_v3" else 0)


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k25"])
def test_eagle3_greedy_equals_plain(targets, head, single, name: str, spec: str) -> None:
    check_eagle3_greedy(targets[name], head, single[name], spec)


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k25"])
def test_oracle_tree_compacts_latent_kv(targets, head, single, name: str) -> None:
    check_oracle_tree(targets[name], head, single[name])


def _routed(blocks, probe) -> tuple[list[int], list[torch.Tensor]]:
    """probe()'s result and the expert ids each MoE block's router chose while it ran."""
    ids: list[torch.Tensor] = []
    hooks = [b.gate.register_forward_hook(lambda _m, _in, out: ids.append(out[1].clone()))
             for b in blocks]
    try:
        return probe(), ids
    finally:
        for h in hooks:
            h.remove()


def test_floor_counts_the_experts_a_step_reads(targets, single) -> None:
    """The MoE floor: router + shared experts + the routed experts read; the probe that counts
    them on live requests leaves their outputs unchanged."""
    from specserve.bench.floor import floor_weights, moe_blocks, touched_experts

    llm = LLM(targets["deepseek_v3"], device="cpu", dtype="float32")
    engine = llm.engine
    model = engine.runner.model
    blocks = moe_blocks(model)
    assert len(blocks) == 2
    dense = [p for layer in model.model.layers for p in layer.parameters() if p.dim() == 2]
    per_expert = sum(w[0].numel() for w in (blocks[0].experts.w13_weight,
                                            blocks[0].experts.w2_weight))  # fmt: skip
    for experts in ([2, 2], [5, 8]):
        got = sum(w.numel() for w in floor_weights(model, experts))
        want = sum(p.numel() for p in dense) + model.lm_head.weight.numel()
        assert got == want + sum(experts) * per_expert
    prompts = _prompts(8, 0)[:4]
    ids = [engine.add_request(None, p, GREEDY) for p in prompts]
    outs = {i: [] for i in ids}
    for step in range(12):
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
        if step == 6:
            one, routed = _routed(blocks, lambda: touched_experts(engine, ids[:1]))
            four = touched_experts(engine, ids)
            assert one == [2, 2]  # top_k distinct experts per token
            assert all(2 <= n <= 8 for n in four) and four != one
            # a verify-shaped pass: the request's newest 4 tokens, its newest one routed as
            # in the one-token probe
            nodes, routed4 = _routed(blocks, lambda: touched_experts(engine, ids[:1], 4))
            assert [r.shape[0] for r in routed4] == [4, 4]
            assert nodes == [int(r.unique().numel()) for r in routed4] and nodes != one
            assert all(torch.equal(a[-1].sort().values, b[0].sort().values)
                       for a, b in zip(routed4, routed))
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    for i, p in zip(ids, prompts):
        assert outs[i] == single["deepseek_v3"][tuple(p)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "chain3"])
def test_tp2_engine_equals_single_requests(targets, head, single, spec: str | None) -> None:
    """The multi-process TP runtime (gloo): MLA heads, routed and shared experts and the dense
    MLP split over 2 ranks give the tokens of TP 1."""
    from specserve.config import ParallelConfig

    prompts = _prompts(8, 0)[:4]
    llm = LLM(
        targets["deepseek_v3"],
        device="cpu",
        dtype="float32",
        parallel=ParallelConfig(tp_size=2),
        speculative_config=spec and dict(algorithm="eagle3", draft_model=head, **SPEC[spec]),
    )
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.close()
    for p, o in zip(prompts, outs):
        assert o.token_ids == single["deepseek_v3"][tuple(p)], f"TP 2 {spec} diverged on {p}"
