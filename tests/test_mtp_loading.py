"""Loading the MTP layer of the tiny checkpoints (tests/tiny_mtp.py, mtp_fixtures.py): random
weights (--load-format dummy) build a random MTP layer and the tokens are still plain
decoding's; a checkpoint lacking the layer's tensors (GLM-5's MTP indexer tensors too), or a
config declaring none, is refused naming what is missing; the GLM-5 preset builds a full DSA
MTP layer; the speculative config takes mtp without a model and refuses one; the CLI generates
with mtp and refuses a target without the layer in one line.
"""

from __future__ import annotations

import mtp_fixtures
import pytest
import torch
from mtp_fixtures import GREEDY, _mtp, _prompts
from tiny_models import make_tiny_checkpoint
from tiny_mtp import make_mtp_checkpoint

from specserve.llm import LLM
from specserve.spec_config import speculative_config

# the fixture of mtp_fixtures.py, bound here so that pytest finds it in this module
ckpts = mtp_fixtures.ckpts


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa", "glm_moe_dsa_sparse"])
def test_random_weights_draft_with_a_random_mtp_layer(ckpts, name: str) -> None:
    """--load-format dummy (cost benchmarks, the *-mtp presets): a random MoE MTP layer (GLM-5:
    with a random indexer), nothing read from the files; the tokens are still plain
    decoding's. GLM-5 at index_topk 4 too: the dummy weights' index scores tie exactly at the
    top-4 boundary (all-zero relu sums), where the selection takes the earlier position in a
    verify forward as in a decode step."""
    path = ckpts[name][0]
    outs = {}
    for spec in (None, _mtp(2)):
        llm = LLM(path, device="cpu", dtype="float32", load_format="dummy",
                  speculative_config=spec)
        outs[spec is None] = [o.token_ids for o in llm.generate(_prompts(8)[:3], GREEDY)]
    head = llm.engine.drafter.proposer.head
    assert head.mlp.__class__.__name__ == "DeepseekMoE"
    # the KV budget left room for the layer built after the pool (an OOM at DeepSeek-V3 dims)
    target = {id(p) for p in llm.engine.runner.model.parameters()}
    own = sum(p.numel() * p.element_size() for p in head.parameters() if id(p) not in target)
    assert llm.engine.runner.reserve_bytes >= own > 0
    assert llm.engine.drafter.proposer.prefix_cache_key.endswith("random seed 1")
    assert outs[True] == outs[False]


@pytest.mark.parametrize("drop", ["hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"])
def test_checkpoint_lacking_an_mtp_tensor_is_refused(tmp_path, drop: str) -> None:
    path, _ = make_mtp_checkpoint(str(tmp_path / "c"), "deepseek_v3", drop=drop)
    with pytest.raises(ValueError, match=f"lacks the MTP tensor model.layers.3.{drop}"):
        LLM(path, device="cpu", dtype="float32", speculative_config=_mtp())


@pytest.mark.parametrize("drop", ["wk.weight", "k_norm.bias"])
def test_glm5_checkpoint_lacking_an_mtp_indexer_tensor_is_refused(tmp_path, drop: str) -> None:
    path, _ = make_mtp_checkpoint(str(tmp_path / "c"), "glm_moe_dsa",
                                  drop=f"self_attn.indexer.{drop}")
    with pytest.raises(ValueError, match=f"lacks the MTP tensor "
                                         rf"model\.layers\.3\.self_attn\.indexer\.{drop}"):
        LLM(path, device="cpu", dtype="float32", speculative_config=_mtp())


@pytest.mark.parametrize("types", [None, ["full", "shared", "shared"]])
def test_glm5_mtp_preset_builds_a_full_dsa_layer(types) -> None:
    """glm-5-3l-mtp (GLM-5 dims, random weights), also with GLM-5.2's shared indexers: the MTP
    layer built on the meta device runs its own indexer (GLM-5's dims) and its pool layer
    keeps the latent and the index keys; the memory check's one-layer config counts it."""
    from specserve.config import ModelConfig
    from specserve.models.loader import build_model
    from specserve.models.mtp_layer import MTPLayer
    from specserve.models.presets import PRESETS
    from specserve.speculative.mtp import check_mtp_target, mtp_kv_specs

    cfg = ModelConfig.from_hf({**PRESETS["glm-5-3l-mtp"], "indexer_types": types})
    assert cfg.num_mtp_layers == 1 and cfg.dsa_index_layers == (1 if types else 3)
    target = build_model(cfg, torch.bfloat16, "meta")
    with torch.device("meta"):
        layer = MTPLayer(cfg, target, moe=True, own_embed=False, own_head=False)
    attn = layer.self_attn
    assert attn.layer_idx == 3 and attn.indexer.wq_b.weight.shape == (32 * 128, 2048)
    assert mtp_kv_specs(cfg) == [attn.kv_spec] and attn.kv_spec.names == ("latent", "index_k")
    assert attn.kv_spec.elements_per_token == 512 + 64 + 128
    one = check_mtp_target(speculative_config(_mtp()), None, cfg)
    assert one.num_layers == 1 and one.dsa_index_layers == 1


def test_missing_block_tensor_and_config_without_mtp_are_refused(tmp_path) -> None:
    path, _ = make_mtp_checkpoint(str(tmp_path / "c"), "deepseek_v3",
                                  drop="self_attn.kv_b_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors: self_attn\.kv_b_proj\.weight.*"
                                         r"below model\.layers\.3\."):
        LLM(path, device="cpu", dtype="float32", speculative_config=_mtp())
    plain_ckpt = make_tiny_checkpoint(tmp_path / "p", "deepseek_v3", tokenizer=True)
    with pytest.raises(ValueError, match="no MTP layer \\(num_nextn_predict_layers is absent"):
        LLM(plain_ckpt, device="cpu", dtype="float32", speculative_config=_mtp())


def test_speculative_config_takes_mtp_without_a_model() -> None:
    spec = speculative_config('{"method": "mtp", "num_speculative_tokens": 2}')
    assert (spec.algorithm, spec.num_steps, spec.draft_model) == ("mtp", 2, "")
    assert "the target's MTP layer" in spec.describe()
    with pytest.raises(ValueError, match="'model': '/x': method mtp drafts with the target's own"):
        speculative_config({"method": "mtp", "model": "/x"})
    with pytest.raises(ValueError, match="unknown key 'n_predict'"):
        speculative_config({"method": "mtp", "n_predict": 1})


def test_cli_generate_with_mtp_and_the_one_line_refusal(ckpts, capsys) -> None:
    from cli_run import run_cli

    from specserve import defaults

    flag = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    rc, err = run_cli(["generate", "--model", ckpts["glm4_moe"][0], *flag, "--max-tokens", "4",
                       "--device", "cpu", "--dtype", "float32", "hi"], capsys)
    assert rc == 0, err
    rc, err = run_cli(["generate", "--model", str(defaults.tiny_code_path()), *flag, "hi"],
                      capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no MTP layer (num_nextn_predict_layers is absent)" in err
