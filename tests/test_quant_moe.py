"""Quantized DeepSeek-V3 checkpoints (MLA + MoE) on the CPU path, against transformers running
the same weights dequantized in fp32 (tiny_quant.py): the MLA projections, dense MLP and
shared experts take the format; MLA's kv_b_proj is dequantized at load (read as W_UK / W_UV).

Tolerances on |logit difference| per token row, as in test_quantization.py: weight-only
formats 1e-4 for every row; W8A8 median row 1e-4, worst row 0.15 (an fp32-rounding difference
in the residual stream can move one activation across an fp8 rounding boundary).
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import PagedSession
from tiny_quant import make_quantized_checkpoint

from specserve.config import ModelConfig
from specserve.layers.quantization.unquantized import UNQUANTIZED
from specserve.models.loader import load_model

W8A8 = (1e-4, 0.15)
WEIGHT_ONLY = (1e-4, 1e-4)
FORMATS = {  # format -> (tolerances, method of the quantized projections)
    "fp8-block": (W8A8, "fp8-block128x128"),
    "ct-int4-g32": (WEIGHT_ONLY, "int4-w4a16-g32"),
    "modelopt-nvfp4": (WEIGHT_ONLY, "nvfp4-w4a16 (modelopt)"),
}
VOCAB = 512
# fused gate/up shards must fall on 128-row blocks: FP8 block models get 128-wide experts
OVERRIDES = {"fp8-block": {"moe_intermediate_size": 128}}


@pytest.fixture(scope="module", params=list(FORMATS))
def dense_experts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A DeepSeek-V3 checkpoint whose routed experts stay dense."""
    fmt = request.param
    path = str(tmp_path_factory.mktemp(f"dsv3-{fmt}") / "m")
    reference = make_quantized_checkpoint(
        path, fmt, family="deepseek_v3", **OVERRIDES.get(fmt, {})
    )
    return {"fmt": fmt, "path": path, "reference": reference}


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


def _logit_errors(model: torch.nn.Module, reference: torch.nn.Module, seed: int) -> list[float]:
    """Per-row max |logit difference| over a batched prefill of two requests and 3 decodes."""
    rng = random.Random(seed)
    tokens = {0: [rng.randrange(VOCAB) for _ in range(11)], 1: [rng.randrange(VOCAB) for _ in range(5)]}
    session = PagedSession(model, num_pages=32, page_size=4)
    got = {r: [t] for r, t in zip(tokens, session.step(tokens))}
    for _ in range(3):
        nxt = {r: [rng.randrange(VOCAB)] for r in tokens}
        for r, logits in zip(nxt, session.step(nxt)):
            got[r].append(logits)
            tokens[r] += nxt[r]
    errors = []
    with torch.no_grad():
        for r, ids in tokens.items():
            ref = reference(torch.tensor([ids])).logits[0]
            assert ref.abs().max() > 1.0
            errors += (torch.cat(got[r]) - ref).abs().amax(-1).tolist()
    return sorted(errors)


def test_mla_and_shared_experts_match_dequantized_reference(dense_experts: dict) -> None:
    (median_tol, max_tol), method = FORMATS[dense_experts["fmt"]]
    model = _load(dense_experts["path"])
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj,
                   moe.shared_experts.gate_up_proj, model.model.layers[0].mlp.down_proj):
        assert linear.quant_method.name == method
    # kv_b_proj: loaded in the format, then one dense matrix (the W_UK / W_UV views)
    assert attn.kv_b_proj.quant_method is UNQUANTIZED
    assert attn.kv_b_proj.weight.dtype == torch.float32
    assert set(dict(attn.kv_b_proj.named_parameters())) == {"weight"}
    ref_kv_b = dense_experts["reference"].model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(attn.kv_b_proj.weight, ref_kv_b, rtol=0, atol=1e-6)
    errors = _logit_errors(model, dense_experts["reference"], seed=1)
    median, worst = errors[len(errors) // 2], errors[-1]
    assert median < median_tol and worst < max_tol, (
        f"{dense_experts['fmt']}: logit error median {median:.2e}, worst {worst:.2e}"
    )
