"""EAGLE-3 head loading: the public formats, known values, d2t mapping and clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.config import ModelConfig
from specserve.models.eagle3 import load_eagle3_head
from specserve.models.loader import build_model, iter_weights


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, torch.nn.Module, ModelConfig]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t") / "m", num_hidden_layers=4)
    cfg = ModelConfig.from_hf(path)
    model = build_model(cfg, torch.float32, "cpu")
    model.load_weights(iter_weights(path))
    return path, model, cfg


def _load(head_dir: str, target) -> torch.nn.Module:
    _, model, cfg = target
    return load_eagle3_head(head_dir, model, cfg, cfg.num_layers, torch.float32,
                            torch.device("cpu"))


@pytest.mark.parametrize("layout,use_bin", [("official", False), ("official", True),
                                            ("layers0", False)])
def test_known_values_load_into_place(tmp_path, target, layout: str, use_bin: bool) -> None:
    head_dir = make_tiny_eagle3_head(str(tmp_path / "h"), target[0], draft_vocab_size=32,
                                     layout=layout, use_bin=use_bin, fc_bias=True)
    raw = (torch.load(os.path.join(head_dir, "pytorch_model.bin")) if use_bin
           else load_file(os.path.join(head_dir, "model.safetensors")))
    prefix = "midlayer." if layout == "official" else "layers.0."
    head = _load(head_dir, target)
    torch.testing.assert_close(head.fc.weight, raw["fc.weight"])
    torch.testing.assert_close(head.fc.bias, raw["fc.bias"])
    qkv = torch.cat([raw[prefix + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(head.midlayer.qkv_proj.weight, qkv)
    gate_up = torch.cat([raw[prefix + "mlp.gate_proj.weight"], raw[prefix + "mlp.up_proj.weight"]])
    torch.testing.assert_close(head.midlayer.gate_up_proj.weight, gate_up)
    torch.testing.assert_close(head.midlayer.hidden_norm.weight, raw[prefix + "hidden_norm.weight"])
    torch.testing.assert_close(head.lm_head.weight, raw["lm_head.weight"])
    # the test's draft vocabulary is target id 2i + 1 for draft id i
    draft_ids = torch.tensor([0, 1, 5, 31])
    assert head.to_target_ids(draft_ids).tolist() == [1, 3, 11, 63]
    # the embedding is the target's own table, shared rather than copied
    emb = target[1].get_input_embeddings()
    ids = torch.tensor([3, 7])
    assert torch.equal(head.embed(ids), emb(ids))


def test_head_without_draft_vocab_uses_target_lm_head(tmp_path, target) -> None:
    head_dir = make_tiny_eagle3_head(str(tmp_path / "h"), target[0], draft_vocab_size=None)
    head = _load(head_dir, target)
    out = torch.randn(2, target[2].hidden_size)
    logits = head.compute_logits(out)
    assert logits.shape == (2, target[2].vocab_size)
    assert head.to_target_ids(torch.tensor([4, 9])).tolist() == [4, 9]


def _rewrite(head_dir: str, change) -> None:
    path = os.path.join(head_dir, "model.safetensors")
    weights = load_file(path)
    change(weights)
    save_file(weights, path)


def test_mismatches_are_clear_errors(tmp_path, target) -> None:
    h = target[2].hidden_size
    d = make_tiny_eagle3_head(str(tmp_path / "fc"), target[0])
    _rewrite(d, lambda w: w.__setitem__("fc.weight", torch.randn(h, 2 * h)))
    with pytest.raises(ValueError, match="fc takes"):
        _load(d, target)

    d = make_tiny_eagle3_head(str(tmp_path / "vocab"), target[0])
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["vocab_size"] = 1000
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="vocabulary size"):
        _load(d, target)

    d = make_tiny_eagle3_head(str(tmp_path / "missing"), target[0])
    _rewrite(d, lambda w: w.pop("norm.weight"))
    with pytest.raises(ValueError, match="norm.weight"):
        _load(d, target)

    d = make_tiny_eagle3_head(str(tmp_path / "extra"), target[0])
    _rewrite(d, lambda w: w.__setitem__("midlayer.bogus.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="bogus"):
        _load(d, target)

    d = make_tiny_eagle3_head(str(tmp_path / "noconfig"), target[0])
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ValueError, match="config.json"):
        _load(d, target)
