"""DeepSeek-V3 / Kimi checkpoints: config spellings (hub vs transformers-saved), MTP layers
recognised and skipped, the Kimi K2.5 wrapper's names and vision tensors, loader errors."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from engine_drivers import PagedSession
from safetensors.torch import load_file, save_file
from tiny_models import hub_spelling, make_kimi_k25_checkpoint, make_tiny_checkpoint

from specserve.config import ModelConfig
from specserve.models.capture import find_embedding_and_head
from specserve.models.deepseek_v3 import KimiK25ForConditionalGeneration
from specserve.models.loader import load_model
from specserve.models.registry import MODEL_REGISTRY, get_model_class

CPU = torch.device("cpu")
PROMPT = [5, 17, 300, 2, 41, 7, 99]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dsv3"), "deepseek_v3")


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, CPU)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedSession(model, num_pages=8, page_size=4).step({0: PROMPT})[0]


def _rewrite(src: str, dst: Path, edit_tensors=None, edit_config=None) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _hub_spelling(config: dict) -> None:
    """transformers 5 saves rope_parameters; hub configs carry rope_theta + rope_scaling with
    "type" (and sometimes the experts as num_local_experts)."""
    hub_spelling(config)
    config["num_local_experts"] = config.pop("n_routed_experts")
    config.pop("num_nextn_predict_layers")
    config.pop("head_dim")


def test_config_spellings(ckpt: str, tmp_path: Path) -> None:
    saved = ModelConfig.from_hf(ckpt)
    hub = ModelConfig.from_hf(_rewrite(ckpt, tmp_path / "hub", edit_config=_hub_spelling))
    assert saved == hub and saved.rope_scaling == hub.rope_scaling
    assert saved.rope_scaling["rope_type"] == "yarn" and saved.rope_theta == 50000.0
    assert saved.mla is not None and saved.mla.kv_lora_rank == 16 and saved.mla.q_lora_rank == 32
    assert saved.head_dim == 24  # qk_nope + qk_rope, not the saved head_dim (= qk_rope)
    moe = saved.moe
    assert moe is not None and (moe.num_experts, moe.n_group, moe.topk_group) == (8, 4, 2)
    assert moe.routed_scaling_factor == 2.827 and moe.first_k_dense_replace == 1
    assert saved.num_mtp_layers == 0


def test_kimi_k25_config(tmp_path: Path) -> None:
    path = make_kimi_k25_checkpoint(tmp_path / "k25")
    cfg = ModelConfig.from_hf(path)
    assert cfg.architecture == "KimiK25ForConditionalGeneration"
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.n_group == 1
    assert cfg.rope_scaling["rope_type"] == "yarn" and not cfg.tie_word_embeddings
    assert get_model_class(cfg.architecture) is KimiK25ForConditionalGeneration
    with open(os.path.join(path, "config.json")) as fh:
        wrapper = json.load(fh)
    del wrapper["text_config"]
    with pytest.raises(ValueError, match="no text_config"):
        ModelConfig.from_hf(wrapper)


def _with_mtp_layer(tensors: dict[str, torch.Tensor]) -> None:
    """A NextN layer as DeepSeek-V3 stores it: layer 3 of a 3-layer model (a decoder layer
    plus enorm, hnorm, eh_proj, shared_head)."""
    hidden = tensors["model.norm.weight"].shape[0]
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("layers.2.", "layers.3.")] = tensors[name].clone()
    for extra in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.3.{extra}.weight"] = torch.ones(hidden)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()


def test_mtp_layers_skipped(ckpt: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def declare(config: dict) -> None:
        config["num_nextn_predict_layers"] = 1

    path = _rewrite(ckpt, tmp_path / "mtp", _with_mtp_layer, declare)
    assert ModelConfig.from_hf(path).num_mtp_layers == 1
    with caplog.at_level(logging.INFO, logger="specserve.models.decoder"):
        model = _load(path)
    assert sum("MTP/NextN layer 0 (model.layers.3" in r.message for r in caplog.records) == 1
    assert len(model.model.layers) == 3
    assert torch.equal(_logits(model), _logits(_load(ckpt)))
    undeclared = _rewrite(ckpt, tmp_path / "undeclared", _with_mtp_layer)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.3\."):
        _load(undeclared)


def test_loader_errors(ckpt: str, tmp_path: Path) -> None:
    missing = "model.layers.2.mlp.experts.6.up_proj.weight"
    path = _rewrite(ckpt, tmp_path / "missing", lambda t: t.pop(missing))
    with pytest.raises(ValueError, match=f"missing tensors: {missing}"):
        _load(path)
    gate = "model.layers.1.mlp.gate.e_score_correction_bias"
    path = _rewrite(ckpt, tmp_path / "shape", lambda t: t.__setitem__(gate, torch.zeros(7)))
    with pytest.raises(ValueError, match=rf"'{gate}'.*\(7,\).*\(8,\)"):
        _load(path)


def test_bf16_router_stays_fp32(ckpt: str) -> None:
    """A bf16 model keeps the router (weight and correction bias) in fp32; gate weights
    stored in bf16 (DeepSeek's hub checkpoints) load into it."""
    model = load_model(ModelConfig.from_hf(ckpt), ckpt, torch.bfloat16, CPU)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16
    want = load_file(os.path.join(ckpt, "model.safetensors"))["model.layers.1.mlp.gate.weight"]
    assert torch.equal(gate.weight, want)


def test_kimi_k25_loads_text_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = make_kimi_k25_checkpoint(tmp_path / "k25")
    with caplog.at_level(logging.INFO, logger="specserve.models.deepseek_v3"):
        model = _load(path)
    assert any("vision_tower" in r.message and "mm_projector" in r.message
               for r in caplog.records)  # fmt: skip
    embed, head = find_embedding_and_head(model)  # what EAGLE-3 shares, found by structure
    assert embed is model.language_model.model.embed_tokens
    assert head is model.language_model.lm_head
    stray = _rewrite(path, tmp_path / "stray",
                     lambda t: t.__setitem__("audio_tower.w", torch.zeros(2)))  # fmt: skip
    with pytest.raises(ValueError, match="'audio_tower.w'.*language_model"):
        _load(stray)


def test_registry_adapters() -> None:
    for arch, entry in MODEL_REGISTRY.items():
        assert get_model_class(arch) is entry.model_class
    wrapper = MODEL_REGISTRY["KimiK25ForConditionalGeneration"].config_adapter
    inner = wrapper(
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "eos_token_id": 7,
            "text_config": {"hidden_size": 8, "architectures": ["DeepseekV3ForCausalLM"]},
        }
    )
    assert inner == {"hidden_size": 8, "eos_token_id": 7,
                     "architectures": ["KimiK25ForConditionalGeneration"]}  # fmt: skip


def test_embedding_and_head_must_be_unambiguous(ckpt: str) -> None:
    model = _load(ckpt)
    model.extra_head = model.lm_head.__class__(16, 64)
    with pytest.raises(ValueError, match="one LM head, found 1 and 2"):
        find_embedding_and_head(model)


@pytest.mark.parametrize("name,layers,experts,heads", [
    ("kimi-k2-3l", ["dense", "moe", "moe"], 384, 64),
    ("kimi-k2-61l-e16", ["dense"] + ["moe"] * 60, 16, 64),
    ("deepseek-v3-4l", ["dense", "moe", "moe", "moe"], 256, 128),
])  # fmt: skip
def test_cost_presets(name: str, layers: list[str], experts: int, heads: int) -> None:
    """Real per-layer dims, few layers; built on the meta device (no memory)."""
    from specserve.layers.moe import DeepseekMoE
    from specserve.models.loader import build_model
    from specserve.models.presets import PRESETS

    cfg = ModelConfig.from_hf(PRESETS[name])
    assert cfg.mla is not None and cfg.mla.kv_lora_rank == 512 and cfg.num_heads == heads
    model = build_model(cfg, torch.bfloat16, "meta")
    kinds = ["moe" if isinstance(layer.mlp, DeepseekMoE) else "dense"
             for layer in model.model.layers]  # fmt: skip
    assert kinds == layers
    moe = model.model.layers[1].mlp
    assert moe.experts.w13_weight.shape == (experts, 2 * 2048, 7168)
    assert moe.gate.weight.dtype == torch.float32
    if len(layers) == 61:  # full depth: a token multiplies Kimi K2's ~32B activated parameters
        from specserve.bench.floor import token_weight_params

        assert 31e9 < token_weight_params(model) < 33.5e9
