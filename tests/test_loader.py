"""Checkpoint resolution and loading: every user mistake gets a ValueError naming the culprit."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_checkpoint

from specserve.config import ModelConfig
from specserve.models.loader import iter_weights, load_model, resolve_model_path
from specserve.models.registry import get_model_class

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base"), "qwen2")


def _edited(ckpt: str, dst: str, edit: Callable[[dict], object]) -> str:
    """Copy the checkpoint to `dst`, rewriting its tensors with `edit(dict)`."""
    shutil.copytree(ckpt, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, CPU)


def test_loads_every_tensor(ckpt: str) -> None:
    model = _load(ckpt)
    tensors = dict(iter_weights(ckpt))
    params = dict(model.named_parameters())
    q = tensors["model.layers.1.self_attn.q_proj.bias"]
    torch.testing.assert_close(params["model.layers.1.self_attn.qkv_proj.bias"][: q.numel()], q)
    up = tensors["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(params["model.layers.0.mlp.gate_up_proj.weight"][up.shape[0] :], up)
    assert not model.training


def test_missing_tensor(ckpt: str, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _edited(ckpt, str(tmp_path / "m"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {name}"):
        _load(path)


def test_unexpected_tensor(ckpt: str, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.extra_proj.weight"
    path = _edited(ckpt, str(tmp_path / "m"), lambda t: t.__setitem__(name, torch.zeros(2)))
    with pytest.raises(ValueError, match=f"unexpected tensor '{name}'"):
        _load(path)


def test_misshaped_tensor(ckpt: str, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.v_proj.bias"
    path = _edited(ckpt, str(tmp_path / "m"), lambda t: t.__setitem__(name, torch.zeros(5)))
    with pytest.raises(ValueError, match=rf"'{name}'.*\(5,\).*\(32,\)"):
        _load(path)


def test_missing_weight_files(ckpt: str, tmp_path: Path) -> None:
    path = str(tmp_path / "m")
    shutil.copytree(ckpt, path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="no weight files"):
        _load(path)


def test_sharded_index_with_a_missing_shard(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "llama", max_shard_size="20KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as fh:
        shard = sorted(set(json.load(fh)["weight_map"].values()))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(ValueError, match=shard):
        _load(path)


def test_pytorch_bin_checkpoint(ckpt: str, tmp_path: Path) -> None:
    path = str(tmp_path / "bin")
    os.makedirs(path)
    shutil.copy(os.path.join(ckpt, "config.json"), path)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    from_bin, from_st = _load(path), _load(ckpt)
    for (name, a), (_, b) in zip(from_bin.named_parameters(), from_st.named_parameters()):
        assert torch.equal(a, b), name


def test_unknown_architecture(ckpt: str) -> None:
    config = dataclasses.replace(ModelConfig.from_hf(ckpt), architecture="FooForCausalLM")
    with pytest.raises(ValueError, match="'FooForCausalLM'.*LlamaForCausalLM"):
        load_model(config, ckpt, torch.float32, CPU)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("BarModel")


def test_hf_cache_resolution(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-qwen2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(ckpt, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_model_path("tiny-org/tiny-qwen2")
    assert os.path.samefile(resolved, snapshot)
    assert isinstance(_load(resolved), torch.nn.Module)
    assert resolve_model_path(ckpt) == ckpt  # a local directory is taken as is
    with pytest.raises(ValueError, match="'tiny-org/not-there'.*local Hugging Face cache"):
        resolve_model_path("tiny-org/not-there")


def test_tiny_checkpoint_with_tokenizer(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tok", "llama", tokenizer=True)
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
