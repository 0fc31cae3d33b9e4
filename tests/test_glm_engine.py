"""GLM targets through the engine, fp32 on the CPU: GLM-4.5 (GQA, partial rotary, MoE),
GLM-4.7-Flash (MLA) and GLM-5 with sparse attention engaged (index_topk 4, below every prompt;
a shared indexer layer). Greedy continuations under continuous batching with chunked prefill
and a forced preemption equal single-request runs and transformers' greedy decoding; EAGLE-3
chain and tree speculation equal plain greedy decoding; an oracle drafter whose true path
hides behind decoys is accepted only if the accepted nodes' KV (GLM-5: latent and index keys)
is moved into place. On a GPU: CUDA graphs (plain and speculative) equal the eager engine."""

from __future__ import annotations

import pytest
import torch
from test_deepseek_engine import (
    GREEDY,
    SPEC,
    _prompts,
    check_batched_greedy,
    check_eagle3_greedy,
    check_oracle_tree,
    single_runs,
)
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.config import CacheConfig
from specserve.llm import LLM

TARGETS = {
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "glm5_dsa": ("glm_moe_dsa", {"index_topk": 4, "indexer_types": ["full", "shared", "full"]}),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("glm")
    return {name: make_tiny_checkpoint(root / name, family, tokenizer=True, **kw)
            for name, (family, kw) in TARGETS.items()}  # fmt: skip


@pytest.fixture(scope="module")
def heads(targets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    return {name: make_tiny_eagle3_head(str(root / name), path, draft_vocab_size=128)
            for name, path in targets.items()}  # fmt: skip


@pytest.fixture(scope="module")
def single(targets: dict[str, str]) -> dict[str, dict[tuple[int, ...], list[int]]]:
    return single_runs(targets)


@pytest.mark.parametrize("name", list(TARGETS))
def test_batched_greedy_equals_single_requests(targets, single, name: str) -> None:
    check_batched_greedy(targets[name], single[name], hf_prompts=2)


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("name", list(TARGETS))
def test_eagle3_greedy_equals_plain(targets, heads, single, name: str, spec: str) -> None:
    check_eagle3_greedy(targets[name], heads[name], single[name], spec)


@pytest.mark.parametrize("name", ["glm4_moe", "glm5_dsa"])
def test_oracle_tree_compacts_kv(targets, heads, single, name: str) -> None:
    check_oracle_tree(targets[name], heads[name], single[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm4_moe", "glm5_dsa"])
def test_tp2_engine_equals_single_requests(targets, heads, single, name: str) -> None:
    """The multi-process TP runtime (gloo), with EAGLE-3 chain 3: GQA heads with their biases
    and partial rotary (GLM-4.5), MLA heads with the replicated indexer (GLM-5), routed and
    shared experts split over 2 ranks give the tokens of TP 1."""
    from specserve.config import ParallelConfig

    prompts = _prompts(8, 0)[:4]
    llm = LLM(targets[name], device="cpu", dtype="float32", parallel=ParallelConfig(tp_size=2),
              speculative_config=dict(algorithm="eagle3", draft_model=heads[name],
                                      **SPEC["chain3"]))  # fmt: skip
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.close()
    for p, o in zip(prompts, outs):
        assert o.token_ids == single[name][tuple(p)], f"{name} TP 2 diverged on {p}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, "chain3", "tree2x8"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_cuda_graphs_equal_eager(targets, heads, name: str, spec: str | None) -> None:
    """fp32 on the GPU (Triton backend): decode and speculative-cycle CUDA graphs (GLM-5's
    holding the sparse path: the graphs' position bound exceeds index_topk) give the eager
    engine's tokens, and speculation gives plain decoding's."""
    prompts = _prompts(8, 0)[:6]  # graphs up to batch 8: the 6 prompts need no larger
    spec_config = spec and dict(algorithm="eagle3", draft_model=heads[name], **SPEC[spec])
    outs = {}
    for eager in (True, False):
        llm = LLM(targets[name], device="cuda", dtype="float32", enforce_eager=eager,
                  cache=CacheConfig(page_size=16, num_pages=256), cuda_graph_max_bs=8,
                  speculative_config=spec_config)  # fmt: skip
        assert (llm.engine.runner.decode_graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        llm.close()
    assert outs[True] == outs[False]
    if spec is not None:
        plain = LLM(targets[name], device="cuda", dtype="float32", cuda_graph_max_bs=8,
                    cache=CacheConfig(page_size=16, num_pages=256))  # fmt: skip
        assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == outs[False]
        plain.close()
