"""FP8 models on the GPU with their linears' activations quantized by the kernels that write
them (RMSNorm, SiLU-and-mul: layers/quantization/base.py InputFeeder): logits bitwise those of
the same model with every linear quantizing its own input, with the quantization launches of
the fed linears gone. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_drivers import PagedSession  # noqa: E402
from test_quant_kernels import HAS_CUDA  # noqa: E402
from tiny_quant import make_quantized_checkpoint  # noqa: E402

from specserve.config import ModelConfig  # noqa: E402
from specserve.kernels import fp8_gemm  # noqa: E402
from specserve.layers.quantization.base import InputFeeder  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402

gpu = pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton"))
# widths that hold whole 128-groups (the tiny DeepSeek's 64 would feed nothing)
DEEPSEEK = dict(hidden_size=256, intermediate_size=256, q_lora_rank=128, moe_intermediate_size=128)


@gpu
@pytest.mark.parametrize("family, fed_per_layer", [("llama", 3), ("deepseek_v3", 3)])
def test_fp8_inputs_fed_by_the_kernels_that_write_them(family: str, fed_per_layer: int,
                                                       tmp_path, monkeypatch) -> None:  # fmt: skip
    """llama: qkv (input norm), gate_up (post-attention norm), down (SiLU-and-mul) a layer;
    DeepSeek-V3 (MLA): q_a and kv_a (input norm), q_b (q_a's norm) a layer at least."""
    path = str(tmp_path / "m")
    make_quantized_checkpoint(path, "fp8-block", family=family,
                              **(DEEPSEEK if family != "llama" else {}))  # fmt: skip
    config = ModelConfig.from_hf(path)
    model = load_model(config, path, torch.bfloat16, "cuda")
    feeders = {m: m._consumers for m in model.modules()
               if isinstance(m, InputFeeder) and m._consumers}  # fmt: skip
    launches, quant = [], fp8_gemm.quant_fp8

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launches.append(args[0].shape)
        return quant(*args, **kwargs)

    monkeypatch.setattr(fp8_gemm, "quant_fp8", counted)

    def prefill_logits() -> tuple[torch.Tensor, int]:
        launches.clear()
        with torch.no_grad():
            out = PagedSession(model).step({0: list(range(1, 14)), 1: list(range(20, 26))})
        return torch.cat(out), len(launches)

    fed, fed_launches = prefill_logits()
    for feeder in feeders:
        feeder.feeds()
    unfed, unfed_launches = prefill_logits()
    layers = config.num_layers
    assert unfed_launches - fed_launches >= fed_per_layer * layers, (fed_launches, unfed_launches)
    if family == "llama":
        assert fed_launches == layers  # o_proj's input (the attention output) alone
    assert torch.equal(fed, unfed)
