"""NVFP4 routed experts (run W4A16) beyond the per-format cases of test_quant_moe.py (whose
EXPERT_CASES run Kimi K2.5 NVFP4's split in ModelOpt's layout and compressed-tensors NVFP4 on
every projection against transformers with the dequantized weights, logits and greedy tokens,
and TP=2 over gloo): the Kimi K2.5 wrapper in NVIDIA's NVFP4 spelling, what a TP rank loads
(its intermediate slice of codes, scales and per-part global scales, for both conventions and
without activation scales), shape, dtype and group-split errors naming the tensor.

Tolerance on |logit difference| per token row: 1e-4 (both sides dequantize the same codes and
compute in fp32; the rows differ by ~5e-6).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from quant_formats import _tensors, quant_config
from safetensors.torch import load_file, save_file
from tiny_quant import logit_errors, make_quantized_checkpoint

from specserve.config import ModelConfig
from specserve.models.loader import load_model

FP8 = torch.float8_e4m3fn
TOL = 1e-4
VOCAB = 512
KIMI = {"n_group": 1, "topk_group": 1}


def _load(path: str | Path) -> torch.nn.Module:
    path = str(path)
    return load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


@pytest.fixture(scope="module")
def kimi_nvfp4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Kimi K2.5 NVFP4's split (routed experts NVFP4, ModelOpt's hf_quant_config.json)."""
    path = tmp_path_factory.mktemp("kimi-nvfp4") / "m"
    reference = make_quantized_checkpoint(path, "modelopt-nvfp4", family="deepseek_v3",
                                          experts="only", **KIMI)  # fmt: skip
    return {"path": path, "reference": reference}


def _nvidia_wrapper(src: Path, dst: Path) -> Path:
    """The checkpoint as NVIDIA's Kimi K2.5 NVFP4 export names it: `language_model.layers.*`
    (no `.model.`), `language_model.lm_head`, vision tensors to skip, the text config nested
    and hf_quant_config.json beside it."""
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        tensors["language_model." + name.removeprefix("model.")] = t
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    shutil.copy(src / "hf_quant_config.json", dst)
    text = json.loads((src / "config.json").read_text())
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "tie_word_embeddings": False, "text_config": text}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_kimi_k25_nvidia_spelling_nvfp4_experts(kimi_nvfp4: dict, tmp_path: Path) -> None:
    model = _load(_nvidia_wrapper(kimi_nvfp4["path"], tmp_path / "k25"))
    layers = model.language_model.model.layers
    experts = layers[1].mlp.experts
    assert experts.quant_method.name == "nvfp4-w4a16-moe (modelopt)"
    assert experts.prefix == "language_model.model.layers.1.mlp.experts"
    assert layers[1].self_attn.q_a_proj.quant_method.family is None  # the wildcards still match
    assert layers[2].mlp.shared_experts.gate_up_proj.quant_method.family is None
    errors = logit_errors(model, kimi_nvfp4["reference"], 5, lengths=(11, 5), vocab=VOCAB)
    assert errors[-1] < TOL, f"worst row {errors[-1]:.2e}"


# -- what a TP rank loads -----------------------------------------------------------------------

CONFIGS = {  # case -> (quant_formats format, quantization config)
    "modelopt": ("modelopt-nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                    "ignore": ["lm_head"]}),
    "modelopt-w4a16": ("modelopt-nvfp4", {"quant_method": "modelopt",
                                          "quant_algo": "W4A16_NVFP4", "ignore": ["lm_head"]}),
    "compressed-tensors": ("ct-nvfp4", quant_config("ct-nvfp4")),
}  # fmt: skip


def _tp(monkeypatch: pytest.MonkeyPatch, size: int, rank: int) -> None:
    from specserve.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", size)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_tp_rank_loads_its_intermediate_slice(case: str, rank: int, monkeypatch) -> None:
    """Rank r of 2 holds gate and up rows and down columns [r*I/2, (r+1)*I/2) of each expert,
    codes and group scales alike, with each matrix's own global scale (the reciprocal of
    compressed-tensors' weight_global_scale); the activation scales are read and dropped."""
    from specserve.layers.moe import FusedMoE
    from specserve.layers.quantization import get_quant_config

    fmt, raw = CONFIGS[case]
    _tp(monkeypatch, 2, rank)
    e, h, i = 3, 64, 64
    torch.set_default_dtype(torch.bfloat16)  # a bf16 model: the global scales stay fp32
    try:
        layer = FusedMoE(e, h, i, get_quant_config(raw), "m.experts")
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(rank)
    full = {}  # (expert, kind) -> dequantized [out, in]
    for expert in range(e):
        for kind, (n, k) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            scale = 1.0 + expert + (kind == "up")  # every matrix its own global scale
            tensors, full[expert, kind] = _tensors(fmt, torch.randn(n, k, generator=gen) * scale, 0)
            for suffix, t in tensors.items():
                if case == "modelopt-w4a16" and suffix == "input_scale":
                    continue  # weight-only exports carry none
                which = "w2" if kind == "down" else "w13"
                layer.weight_loader(getattr(layer, f"{which}_{suffix}"), t, (expert, kind))
    layer.process_weights_after_loading()
    names = {n for n, _ in layer.named_parameters()}
    assert names == {f"{w}_{s}" for w in ("w13", "w2")
                     for s in ("packed", "weight_scale", "global_scale")}  # fmt: skip
    w13, w2 = layer.quant_method.expert_weights(layer)
    assert w13.weight.shape == (e, i, h // 8) and w2.scale.shape == (e, h, i // 2 // 16)
    cut = slice(rank * i // 2, (rank + 1) * i // 2)
    for expert in range(e):
        want13 = torch.cat([full[expert, "gate"][cut], full[expert, "up"][cut]])
        torch.testing.assert_close(w13.dequantize(expert), want13, rtol=1e-6, atol=0)
        torch.testing.assert_close(w2.dequantize(expert), full[expert, "down"][:, cut],
                                   rtol=1e-6, atol=0)  # fmt: skip
    assert (w13.global_scale[:, 1] > w13.global_scale[:, 0]).all()
    assert w13.global_scale.dtype == w2.global_scale.dtype == torch.float32


def test_group_splits_and_sizes_are_refused(monkeypatch) -> None:
    from specserve.layers.moe import FusedMoE
    from specserve.layers.quantization import get_quant_config

    nvfp4 = get_quant_config(CONFIGS["modelopt"][1])
    _tp(monkeypatch, 2, 0)
    with pytest.raises(ValueError, match=r"'m\.experts\.0\.down_proj\.weight_scale'.*intermediate"
                                         r" features \(48\).*blocks of 16.*each rank 24.*: 1, 3$"):
        FusedMoE(4, 64, 48, nvfp4, "m.experts")  # fmt: skip
    assert FusedMoE(4, 64, 64, nvfp4, "m.experts").w2_weight_scale.shape == (4, 64, 2)
    _tp(monkeypatch, 1, 0)
    with pytest.raises(ValueError, match=r"m\.experts: NVFP4 experts need "
                                         r"moe_intermediate_size in multiples of 16.*got 40"):
        FusedMoE(4, 64, 40, nvfp4, "m.experts")  # fmt: skip
    with pytest.raises(ValueError, match=r"hidden_size in multiples of 16.*got 72"):
        FusedMoE(4, 72, 32, nvfp4, "m.experts")


# -- checkpoint errors ---------------------------------------------------------------------------


def _edited(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


EXPERT = "model.layers.2.mlp.experts.3"
BAD = {  # what is wrong -> (tensor, replacement, message after the tensor's name)
    "scale shape": (f"{EXPERT}.down_proj.weight_scale", torch.ones(64, 3).to(FP8),
                    r"shape \(64, 3\).*expects \(64, 2\)"),
    "scale dtype": (f"{EXPERT}.up_proj.weight_scale", torch.ones(32, 4),
                    r"dtype float32 .* float8_e4m3fn"),
    "codes shape": (f"{EXPERT}.gate_proj.weight", torch.zeros(32, 16, dtype=torch.uint8),
                    r"shape \(32, 16\).*expects \(32, 32\)"),
    "global scale per row": (f"{EXPERT}.gate_proj.weight_scale_2", torch.ones(32),
                             r"shape \(32,\).*expects \(\)"),
}  # fmt: skip


@pytest.mark.parametrize("what", list(BAD))
def test_corrupted_expert_tensor_names_it(what: str, kimi_nvfp4: dict, tmp_path: Path) -> None:
    name, bad, message = BAD[what]
    path = _edited(kimi_nvfp4["path"], tmp_path / "m", lambda t: t.__setitem__(name, bad))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}': .*{message}"):
        _load(path)


def test_missing_expert_global_scale_is_reported(kimi_nvfp4: dict, tmp_path: Path) -> None:
    name = f"{EXPERT}.up_proj.weight_scale_2"
    path = _edited(kimi_nvfp4["path"], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {re.escape(name)}$"):
        _load(path)


def test_kimi_preset_nvfp4_is_kimi_k25_nvfp4s_format() -> None:
    """kimi-k2-3l --quantization nvfp4: NVFP4 routed experts, everything else dense."""
    from specserve.config import EngineConfig
    from specserve.engine.local_worker import model_config_of
    from specserve.layers.quantization import get_quant_config
    from specserve.layers.quantization.moe import moe_method

    cfg = model_config_of(
        EngineConfig(model="kimi-k2-3l", load_format="dummy", quantization="nvfp4"), None
    )
    quant = get_quant_config(cfg.quantization)
    assert moe_method(quant, "model.layers.1.mlp.experts").name == "nvfp4-w4a16-moe (modelopt)"
    for dense in ("model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.kv_b_proj",
                  "model.layers.1.mlp.shared_experts.gate_up_proj",
                  "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head"):
        assert quant.linear_method(dense).family is None, dense  # fmt: skip
