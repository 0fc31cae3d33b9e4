"""GLM checkpoints: config spellings (hub vs transformers-saved), MTP / NextN layers
recognised and skipped (GLM-4.5's GQA layer, GLM-5's MLA + indexer layer), the cost presets'
per-layer dims, and configs that cannot work, refused with what to change."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_deepseek_loader import _load, _logits, _rewrite, _with_mtp_layer
from tiny_models import edit_config, make_tiny_checkpoint

from specserve.config import ModelConfig
from specserve.layers.dsa import DSAAttention
from specserve.layers.moe import DeepseekMoE
from specserve.models.glm4_moe import Glm4MoeForCausalLM
from specserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from specserve.models.loader import build_model
from specserve.models.mtp import is_nextn_part, mtp_layer
from specserve.models.presets import PRESETS
from specserve.models.registry import get_model_class


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("glm")
    return {
        "glm4_moe": make_tiny_checkpoint(root / "glm4", "glm4_moe"),
        "glm5": make_tiny_checkpoint(root / "glm5", "glm_moe_dsa", index_topk=4),
    }


def test_config_spellings(ckpts: dict[str, str], tmp_path: Path) -> None:
    saved = ModelConfig.from_hf(ckpts["glm4_moe"])
    hub = ModelConfig.from_hf(make_tiny_checkpoint(tmp_path / "hub", "glm4_moe", hub_config=True))
    assert saved == hub
    assert (saved.head_dim, saved.rotary_dim, saved.rope_theta) == (32, 16, 1e6)
    assert saved.qk_norm and saved.attention_bias and saved.rope_scaling is None
    assert saved.moe is not None and saved.moe.routed_scaling_factor == 2.5
    assert get_model_class(saved.architecture) is Glm4MoeForCausalLM
    glm5 = ModelConfig.from_hf(ckpts["glm5"])
    assert glm5.dsa is not None and (glm5.dsa.index_topk, glm5.dsa.index_n_heads) == (4, 8)
    assert glm5.dsa.rope_interleave and glm5.mla is not None and glm5.mla.rope_interleave
    assert glm5.moe is not None and glm5.moe.mlp_layer_types == ("dense", "sparse", "sparse")
    assert get_model_class(glm5.architecture) is GlmMoeDsaForCausalLM


@pytest.mark.parametrize("name", ["glm4_moe", "glm5"])
def test_mtp_layer_recognised_and_skipped(ckpts: dict[str, str], tmp_path: Path, name: str,
                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The NextN layer as GLM stores it (a decoder layer of the model's own kind, GQA or MLA +
    indexer, plus enorm / hnorm / eh_proj / shared_head) at model.layers.3 of 3 layers."""
    path = _rewrite(ckpts[name], tmp_path / "mtp", _with_mtp_layer,
                    lambda c: c.__setitem__("num_nextn_predict_layers", 1))  # fmt: skip
    assert mtp_layer("model.layers.3.self_attn.q_b_proj.weight", 3, 1) == 0
    assert mtp_layer("model.layers.2.self_attn.o_proj.weight", 3, 1) is None
    assert is_nextn_part("model.layers.3.eh_proj.weight")
    assert not is_nextn_part("model.layers.3.mlp.gate.weight")
    with caplog.at_level(logging.INFO, logger="specserve.models.decoder"):
        model = _load(path)
    assert sum("MTP/NextN layer 0" in r.message for r in caplog.records) == 1
    assert torch.equal(_logits(model), _logits(_load(ckpts[name])))
    undeclared = _rewrite(ckpts[name], tmp_path / "undeclared", _with_mtp_layer)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.3\."):
        _load(undeclared)


@pytest.mark.parametrize("name,kinds", [
    ("glm-4.5-air-4l", ["dense", "moe", "moe", "moe"]),
    ("glm-5-3l", ["dense", "moe", "moe"]),
])  # fmt: skip
def test_cost_presets(name: str, kinds: list[str]) -> None:
    """Real per-layer dims, few layers; built on the meta device (no memory)."""
    cfg = ModelConfig.from_hf(PRESETS[name])
    model = build_model(cfg, torch.bfloat16, "meta")
    layers = model.model.layers
    assert ["moe" if isinstance(la.mlp, DeepseekMoE) else "dense" for la in layers] == kinds
    moe = layers[1].mlp
    if name == "glm-4.5-air-4l":
        attn = layers[0].self_attn
        assert attn.qkv_proj.weight.shape == ((96 + 2 * 8) * 128, 4096)
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
        assert attn.rotary.rotary_dim == 64 and not attn.qk_norm
        assert moe.experts.w13_weight.shape == (128, 2 * 1408, 4096)
    else:
        attn = layers[0].self_attn
        assert isinstance(attn, DSAAttention) and attn.scale == 256**-0.5
        assert attn.indexer.wq_b.weight.shape == (32 * 128, 2048)
        assert attn.kv_spec.elements_per_token == 512 + 64 + 128
        assert moe.experts.w13_weight.shape == (256, 2 * 2048, 6144)
        dense = ModelConfig.from_hf(PRESETS["glm-5-3l-dense"])
        assert dense.dsa.index_topk >= dense.max_position_embeddings
    assert moe.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.__setitem__("indexer_types", ["full", "shared"]),
     "indexer_types has 2 entries for 3 layers"),
    (lambda c: c.__setitem__("indexer_types", ["shared", "full", "full"]),
     "the first 'full'"),
    (lambda c: c.__setitem__("mlp_layer_types", ["dense", "sparse"]),
     "mlp_layer_types has 2 entries for 3 layers"),
    (lambda c: c.__setitem__("index_topk", 0), r"index_topk \(0\).*must be >= 1"),
])  # fmt: skip
def test_bad_dsa_configs(ckpts: dict[str, str], tmp_path: Path, edit, match: str) -> None:  # noqa: ANN001
    path = _rewrite(ckpts["glm5"], tmp_path / "bad", edit_config=edit)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(path)


def test_bad_model_configs(ckpts: dict[str, str], tmp_path: Path) -> None:
    odd = _rewrite(ckpts["glm4_moe"], tmp_path / "odd")
    edit_config(odd, lambda c: c["rope_parameters"].__setitem__("partial_rotary_factor", 0.3))
    with pytest.raises(ValueError, match="rotary dims must be even.*partial_rotary_factor"):
        _load(odd)  # 32 * 0.3 = 9 dims
    no_qlora = _rewrite(ckpts["glm5"], tmp_path / "noq")
    edit_config(no_qlora, lambda c: c.__setitem__("q_lora_rank", None))
    with pytest.raises(ValueError, match="indexer reads the q latent.*q_lora_rank"):
        _load(no_qlora)


# GLM-4.5 / 4.6 / 4.7 (355B) per-layer dims, 4 layers (3 dense, 1 MoE), as GLM-4.5-FP8 ships
# them: 128 x 128 block-scaled FP8 (config.json's quantization_config)
GLM45_FP8 = {
    **PRESETS["glm-4.5-air-4l"], "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_routed_experts": 160, "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5, "use_qk_norm": True, "max_position_embeddings": 202752,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}  # fmt: skip


def test_fp8_block_experts_name_the_tp_sizes_that_work() -> None:
    """moe_intermediate_size 1536 over TP 8 gives each rank 192 rows, which cuts a 128-row
    block: building rank 0's shard refuses with the tensor and the TP sizes that work (1536 =
    12 blocks: 1, 2, 3, 4, 6, 12); TP 4 (3 blocks a rank) builds."""
    from specserve.distributed import parallel_state

    cfg = ModelConfig.from_hf(GLM45_FP8)
    try:
        parallel_state.init_emulated(8)
        with pytest.raises(ValueError, match=(
            r"model\.layers\.3\.mlp\.experts\.0\.gate_proj\.weight_scale_inv.*\(1536\).*"
            r"blocks of 128; tp_size 8 gives each rank 192.*"
            r"tp sizes that work for this tensor: 1, 2, 3, 4, 6, 12$")):  # fmt: skip
            build_model(cfg, torch.bfloat16, "meta")
        parallel_state.init_emulated(4)
        model = build_model(cfg, torch.bfloat16, "meta")
        assert model.model.layers[3].mlp.experts.w13_weight.shape == (160, 2 * 384, 5120)
    finally:
        parallel_state.destroy()
