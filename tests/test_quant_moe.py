"""Quantized DeepSeek-V3 checkpoints (MLA + MoE) on the CPU path, against transformers running
the same weights dequantized in fp32 (tiny_quant.py): the MLA projections, dense MLP and
shared experts take the format, MLA's kv_b_proj is dequantized at load (read as W_UK / W_UV);
routed experts dense, FP8 block (DeepSeek-V3's format: W8A8, the reference's expert loop
fake-quantizes both GEMMs' inputs), INT4 g32 (Kimi K2.5's: experts only; also under the K2.5
wrapper) or NVFP4 (run W4A16: Kimi K2.5 NVFP4's split in ModelOpt's layout, and every
projection in compressed-tensors'; more in test_quant_moe_nvfp4.py); loading errors, TP=2 over
gloo, random weights in a format and their floor.

Tolerances on |logit difference| per token row, as in test_quantization.py: weight-only
formats 1e-4 for every row; W8A8 median row 1e-4, worst row 0.15 (an fp32-rounding difference
in the residual stream can move one activation across an fp8 rounding boundary).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_quant import logit_errors, make_quantized_checkpoint

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
    reference = make_quantized_checkpoint(path, fmt, family="deepseek_v3", **OVERRIDES.get(fmt, {}))
    return {"fmt": fmt, "path": path, "reference": reference}


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


def _logit_errors(model: torch.nn.Module, reference: torch.nn.Module, seed: int) -> list[float]:
    return logit_errors(model, reference, seed, lengths=(11, 5), vocab=VOCAB)


def test_mla_and_shared_experts_match_dequantized_reference(dense_experts: dict) -> None:
    (median_tol, max_tol), method = FORMATS[dense_experts["fmt"]]
    model = _load(dense_experts["path"])
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (
        attn.q_a_proj,
        attn.q_b_proj,
        attn.kv_a_proj_with_mqa,
        attn.o_proj,
        moe.shared_experts.gate_up_proj,
        model.model.layers[0].mlp.down_proj,
    ):
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


# -- quantized routed experts ------------------------------------------------------------------

EXPERT_CASES = {  # case -> (format, experts split, overrides, tolerances, expert method)
    # DeepSeek-V3's own format: every projection and expert in 128x128-block FP8
    "fp8-block": ("fp8-block", "quantized", {"moe_intermediate_size": 128}, W8A8,
                  "fp8-block128x128-moe"),
    # Kimi K2.5's: only the routed experts, INT4 groups of 32
    "kimi-int4": ("ct-int4-g32", "only", {"n_group": 1, "topk_group": 1}, WEIGHT_ONLY,
                  "int4-w4a16-g32-moe"),
    # Kimi K2.5 NVFP4's (ModelOpt): only the routed experts
    "kimi-nvfp4": ("modelopt-nvfp4", "only", {"n_group": 1, "topk_group": 1}, WEIGHT_ONLY,
                   "nvfp4-w4a16-moe (modelopt)"),
    # compressed-tensors NVFP4 (reciprocal global scales) on every projection and expert
    "ct-nvfp4": ("ct-nvfp4", "quantized", {}, WEIGHT_ONLY, "nvfp4-w4a16-moe (compressed-tensors)"),
}  # fmt: skip


@pytest.fixture(scope="module")
def expert_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """case -> {path, reference}, built on first use."""

    class Built(dict):
        def __missing__(self, case: str) -> dict:
            fmt, split, overrides, _, _ = EXPERT_CASES[case]
            path = str(tmp_path_factory.mktemp(case) / "m")
            reference = make_quantized_checkpoint(path, fmt, family="deepseek_v3",
                                                  experts=split, **overrides)  # fmt: skip
            self[case] = {"case": case, "path": path, "reference": reference}
            return self[case]

    return Built()


@pytest.fixture(params=list(EXPERT_CASES))
def quant_experts(request: pytest.FixtureRequest, expert_ckpts: dict) -> dict:
    return expert_ckpts[request.param]


def test_quantized_experts_match_dequantized_reference(quant_experts: dict) -> None:
    _, split, _, (median_tol, max_tol), method = EXPERT_CASES[quant_experts["case"]]
    model = _load(quant_experts["path"])
    for layer in model.model.layers[1:]:
        assert layer.mlp.experts.quant_method.name == method
    shared = model.model.layers[1].mlp.shared_experts.gate_up_proj.quant_method
    assert (shared is UNQUANTIZED) == (split == "only")
    errors = _logit_errors(model, quant_experts["reference"], seed=3)
    median, worst = errors[len(errors) // 2], errors[-1]
    assert median < median_tol and worst < max_tol, (
        f"{quant_experts['case']}: logit error median {median:.2e}, worst {worst:.2e}"
    )


def test_quantized_experts_greedy_equals_reference(quant_experts: dict) -> None:
    """The engine's greedy tokens (batched, chunked prefill) equal the reference's, up to a
    near-tie under the format's logit tolerance."""
    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    tol = EXPERT_CASES[quant_experts["case"]][3][1]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 9)]
    llm = LLM(quant_experts["path"], device="cpu", dtype="float32",
              cache=CacheConfig(page_size=4, num_pages=64),
              scheduler=SchedulerConfig(max_num_batched_tokens=12))  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    reference, compared = quant_experts["reference"], 0
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for got in out.token_ids:
            with torch.no_grad():
                logits = reference(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2)
            if got != int(top.indices[0]):
                margin = float(top.values[0] - top.values[1])
                assert margin < tol, f"diverged at a top-2 margin of {margin:.3g} (tol {tol})"
                break
            ids.append(got)
            compared += 1
    assert compared >= 16


def _kimi_k25(src: str, dst: Path) -> str:
    """The INT4 checkpoint as a Kimi K2.5 wrapper: tensors under `language_model.`, the text
    config nested, the quantization config at the top level (as the hub's)."""
    tensors = {f"language_model.{n}": t for n, t in load_file(f"{src}/model.safetensors").items()}
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    text = json.loads(Path(src, "config.json").read_text())
    quant = text.pop("quantization_config")
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "tie_word_embeddings": False,
        "text_config": text,
        "quantization_config": quant,
    }
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_kimi_k25_wrapper_int4_experts(expert_ckpts: dict, tmp_path: Path) -> None:
    case = expert_ckpts["kimi-int4"]
    model = _load(_kimi_k25(case["path"], tmp_path / "k25"))
    experts = model.language_model.model.layers[1].mlp.experts
    assert experts.quant_method.name == "int4-w4a16-g32-moe"
    assert experts.prefix == "language_model.model.layers.1.mlp.experts"
    errors = _logit_errors(model, case["reference"], seed=5)
    assert errors[-1] < WEIGHT_ONLY[1], f"worst row {errors[-1]:.2e}"


# -- loading errors ------------------------------------------------------------------------------


def _edited(src: str, dst: Path, edit_tensors=None, edit_config=None) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_corrupted_expert_scale_shape_names_the_tensor(expert_ckpts: dict, tmp_path) -> None:
    src = expert_ckpts["fp8-block"]["path"]
    name = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"  # [1, 1]: H 64, I 128
    path = _edited(src, tmp_path / "m", lambda t: t.__setitem__(name, torch.ones(1, 2)))
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}'.*\(1, 2\).*\(1, 1\)"):
        _load(path)


def test_missing_expert_scale_is_reported(expert_ckpts: dict, tmp_path) -> None:
    src = expert_ckpts["kimi-int4"]["path"]
    name = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    path = _edited(src, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {re.escape(name)}$"):
        _load(path)


def test_expert_weight_shape_and_dtype_are_checked(expert_ckpts: dict, tmp_path) -> None:
    src = expert_ckpts["kimi-int4"]["path"]
    name = "model.layers.2.mlp.experts.6.gate_proj.weight_shape"
    path = _edited(src, tmp_path / "a", lambda t: t.__setitem__(name, torch.tensor([32, 65])))
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: \[32, 65\] differs .*\[32, 64\]"):
        _load(path)
    packed = "model.layers.1.mlp.experts.0.down_proj.weight_packed"
    path = _edited(src, tmp_path / "b", lambda t: t.__setitem__(packed, t[packed].float()))
    with pytest.raises(ValueError, match=rf"'{re.escape(packed)}'.*float32.*int32"):
        _load(path)


def test_unsupported_expert_format_is_refused(expert_ckpts: dict, tmp_path) -> None:
    def fp8_tensor_experts(config: dict) -> None:  # per-tensor FP8 but the ignore list
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                         "ignore": ["lm_head"]}  # fmt: skip

    path = _edited(expert_ckpts["kimi-int4"]["path"], tmp_path / "m",
                   edit_config=fp8_tensor_experts)  # fmt: skip
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj: routed experts in fp8-tensor"
                                         r".*supported expert formats.*nvfp4"):  # fmt: skip
        _load(path)


def test_tp_split_inside_an_expert_block_names_the_tensor(monkeypatch) -> None:
    from quant_formats import quant_config

    from specserve.distributed import parallel_state
    from specserve.layers.moe import FusedMoE
    from specserve.layers.quantization import get_quant_config

    monkeypatch.setattr(parallel_state, "_TP_RANK", 0)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    fp8 = get_quant_config(quant_config("fp8-block"))
    with pytest.raises(
        ValueError,
        match=r"'m\.experts\.0\.gate_proj\.weight_scale_inv'.*"
        r"intermediate features \(384\).*blocks of 128.*: 1, 3",
    ):
        FusedMoE(4, 256, 384, fp8, "m.experts")
    int4 = get_quant_config(quant_config("ct-int4-g32"))
    with pytest.raises(ValueError, match=r"'m\.experts\.0\.down_proj\.weight_scale'.*blocks of 32"):
        FusedMoE(4, 256, 48, int4, "m.experts")
    assert FusedMoE(4, 256, 64, int4, "m.experts").w2_weight_scale.shape == (4, 256, 1)


# -- TP=2 over gloo processes: the logits of TP=1 ------------------------------------------------

TP_CASES = {  # case -> (format, split, overrides giving each rank whole blocks / groups, tol)
    "fp8-block": ("fp8-block", "only", {"moe_intermediate_size": 256}, W8A8[1]),
    "int4-g32": ("ct-int4-g32", "only", {"moe_intermediate_size": 64}, WEIGHT_ONLY[1]),
    "nvfp4": ("modelopt-nvfp4", "only", {"moe_intermediate_size": 64}, WEIGHT_ONLY[1]),
}


@pytest.mark.slow
def test_tp2_gloo_quantized_experts_equal_tp1(tmp_path: Path) -> None:
    """Each rank holds its intermediate slice of every expert's codes and scales (gate/up rows,
    down columns); the W8A8 down GEMM quantizes its slice in the same 128-groups as TP=1."""
    import torch.multiprocessing as mp
    from test_tp_gloo import TP, _free_port, _run, _worker

    paths = []
    for case, (fmt, split, overrides, _) in TP_CASES.items():
        paths.append(str(tmp_path / case))
        make_quantized_checkpoint(paths[-1], fmt, family="deepseek_v3", experts=split,
                                  **overrides)  # fmt: skip
    mp.spawn(_worker, args=(paths, _free_port(), str(tmp_path), "gloo"), nprocs=TP, join=True)
    expected = [_run(p) for p in paths]
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for (case, (*_, tol)), exp, res in zip(TP_CASES.items(), expected, got):
            err = max((g - e).abs().max().item() for e, g in zip(exp, res))
            assert err < tol, f"{case} rank {rank}: max abs logit difference {err:.2e}"


# -- random weights in a format (--load-format dummy --quantization X), the floor ---------------


def test_kimi_preset_w4a16_is_kimi_k25s_format() -> None:
    """kimi-k2-3l --quantization w4a16: INT4 g32 routed experts, everything else dense."""
    from specserve.config import EngineConfig
    from specserve.engine.local_worker import model_config_of
    from specserve.layers.quantization import get_quant_config

    cfg = model_config_of(
        EngineConfig(model="kimi-k2-3l", load_format="dummy", quantization="w4a16"), None
    )
    quant = get_quant_config(cfg.quantization)
    assert quant.linear_method("model.layers.1.mlp.experts.7.down_proj").name == "int4-w4a16-g32"
    for dense in ("model.layers.1.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
                  "model.layers.0.mlp.gate_up_proj", "model.layers.2.self_attn.kv_b_proj"):  # fmt: skip
        assert quant.linear_method(dense) is UNQUANTIZED, dense
    llama = model_config_of(
        EngineConfig(model="llama-3.1-8b", load_format="dummy", quantization="w4a16"), None
    )
    assert get_quant_config(llama.quantization).linear_method("model.layers.0.mlp.down_proj").name == (
        "int4-w4a16-g128")  # fmt: skip


@pytest.mark.parametrize("flag, method", [("w4a16", "int4-w4a16-g128-moe"),
                                          ("fp8", "fp8-block128x128-moe"),
                                          ("nvfp4", "nvfp4-w4a16-moe (modelopt)")])  # fmt: skip
def test_dummy_quantized_experts_and_their_floor(flag: str, method: str, tmp_path) -> None:
    """Random codes in the format whose values are ~N(0, 0.02); decode runs; the floor streams
    each read expert's codes and scales (top_k per MoE layer at bs 1)."""
    from tiny_models import make_hf_model

    from specserve.bench.floor import floor_weights, measure_floor, token_weight_params
    from specserve.config import EngineConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    config = make_hf_model("deepseek_v3", 0, moe_intermediate_size=128).config.to_dict()
    config["torch_dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(EngineConfig(model=str(tmp_path), load_format="dummy", quantization=flag,
                           device="cpu", dtype="float32"))  # fmt: skip
    model = llm.engine.runner.model
    experts = model.model.layers[1].mlp.experts
    assert experts.quant_method.name == method
    w13, w2 = experts.quant_method.expert_weights(experts)
    for w in (w13, w2):
        values = torch.stack([w.dequantize(e) for e in range(4)])
        assert 0.01 < values.std().item() < 0.04
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # the floor: every linear's stored bytes, router, top_k experts per MoE layer, LM head
    blocks = [layer.mlp for layer in model.model.layers[1:]]
    top_k = blocks[0].gate.rule.top_k
    linears = [
        m for m in model.modules() if hasattr(m, "quant_method") and hasattr(m, "out_shards")
    ]
    per_expert = sum(  # codes, scales (and NVFP4's two or one global scales)
        t.numel() * t.element_size() for w in (w13, w2)
        for t in (w.weight[0], w.scale[0], *([] if w.global_scale is None else [w.global_scale[0]]))
    )  # fmt: skip
    router = sum(b.gate.weight.numel() * 4 for b in blocks)
    head = model.lm_head.weight.numel() * 4
    streamed = (sum(m.quant_method.stream_bytes(m) for m in linears) + router + head
                + len(blocks) * top_k * per_expert)  # fmt: skip
    weights = floor_weights(model)
    total = sum(w.numel() * w.element_size() for w in weights)
    assert streamed <= total < streamed + config["hidden_size"] * 4  # scales' matrix: whole rows
    assert any(w.data_ptr() == w13.weight[0].data_ptr() for w in weights)  # codes as views
    assert measure_floor(model, [1], replays=2, warmup=1)[0].weight_bytes == total
    # the flops count the weights a token multiplies, as in the dense model of that shape
    dense_llm = LLM(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu",
                                 dtype="float32"))  # fmt: skip
    dense = dense_llm.engine.runner.model
    per_token = sum(w.numel() for w in floor_weights(dense))
    assert token_weight_params(model) == token_weight_params(dense) == per_token


def test_memory_check_counts_the_stored_format(expert_ckpts: dict) -> None:
    """The fit check before loading counts a quantized model's codes and scales: exactly the
    bytes of the FP8 checkpoint's tensors (the dense count would be 4 bytes per weight)."""
    from specserve.config import CacheConfig, ModelConfig
    from specserve.engine.memory import required_bytes

    path = expert_ckpts["fp8-block"]["path"]
    config = ModelConfig.from_hf(path)
    weights, _ = required_bytes(config, None, torch.float32, torch.device("cpu"), CacheConfig())
    stored = sum(
        t.numel() * t.element_size() for t in load_file(f"{path}/model.safetensors").values()
    )
    assert weights == stored
    assert weights < 0.5 * config.num_parameters() * 4
