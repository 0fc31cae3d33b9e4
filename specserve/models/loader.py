"""Find a checkpoint on disk, stream its tensors, and build a model from it.

Weights are read from the local disk only: a directory, a GGUF file, or a Hugging Face repo id
already in the local HF cache. Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import get_tp_rank
from specserve.layers.quantization import process_weights_after_loading
from specserve.models import gguf
from specserve.models.registry import get_model_class

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


def _hf_cache_dir() -> str:
    """The HF hub cache, read from the environment at call time."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    if env.get("HF_HOME"):
        return os.path.join(env["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model_path(model: str) -> str:
    """A local directory or GGUF file as is, or the cached snapshot of HF repo id `model` (no
    network)."""
    if os.path.isdir(model):
        return model
    if gguf.is_gguf(model):
        if not os.path.isfile(model):
            raise ValueError(f"model file {model} does not exist")
        return model
    from huggingface_hub import snapshot_download

    cache = _hf_cache_dir()
    try:
        return snapshot_download(model, cache_dir=cache, local_files_only=True)
    except Exception as err:  # not cached, incomplete, or not a valid repo id
        raise ValueError(
            f"model {model!r} is neither a local directory nor a repo in the local Hugging Face "
            f"cache ({cache}): pass a directory, or download it first "
            f"(`huggingface-cli download {model}`)"
        ) from err


def load_model_config(path: str) -> ModelConfig:
    """The normalised config of the checkpoint at `path` (a directory or a GGUF file)."""
    if gguf.is_gguf(path):
        return ModelConfig.from_hf(gguf.hf_config(path))
    return ModelConfig.from_hf(path)


def weight_files(path: str) -> list[str]:
    """The checkpoint's weight files, in load order."""
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as fh:
                names = sorted(set(json.load(fh)["weight_map"].values()))
            files = [os.path.join(path, n) for n in names]
            absent = [f for f in files if not os.path.isfile(f)]
            if absent:
                raise ValueError(f"{index_name} in {path} lists missing files: {absent}")
            return files
    for name in (SAFETENSORS, TORCH_BIN):
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    raise ValueError(
        f"no weight files in {path}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN} "
        f"or {TORCH_BIN_INDEX}"
    )


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint at `path` (HF names)."""
    from safetensors import safe_open

    if gguf.is_gguf(path):
        yield from gguf.iter_gguf_weights(path)
        return

    files = weight_files(path)
    bar = tqdm(
        total=len(files),
        desc="loading weights",
        unit="file",
        disable=get_tp_rank() != 0 or len(files) == 1,
    )
    for file in files:
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        else:  # weights_only: never execute pickled code from a checkpoint
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
        bar.update(1)
    bar.close()


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model for this TP rank, built directly on `device` in `dtype` (weights unset)."""
    cls = get_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_model(
    config: ModelConfig, path: str, dtype: torch.dtype, device: torch.device | str
) -> nn.Module:
    """Build the model for this TP rank directly on `device` in `dtype`, load, eval mode.
    Quantized layers then turn the checkpoint's tensors into the form their kernels read."""
    model = build_model(config, dtype, device)
    model.load_weights(iter_weights(path))
    process_weights_after_loading(model)
    return model
