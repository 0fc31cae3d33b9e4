"""Quantized checkpoints: the config parsers and what the model loader calls.

    get_quant_config(ModelConfig.quantization)   -> QuantConfig | None (None: dense)
    resolve_quantization(raw, flag, dummy)       -> the raw config a --quantization flag implies
    process_weights_after_loading(model)         once, after the checkpoint (or random) weights

Methods, one file each: unquantized.py (dense F.linear), fp8.py (W8A8: block / channel /
tensor scales), w4a16.py (INT4 groups), nvfp4.py (NVFP4, weight-only); routed experts: moe.py
(dense, FP8 block W8A8, INT4 W4A16, NVFP4 W4A16). Config formats:
fp8.py (`"quant_method": "fp8"`), compressed_tensors.py, modelopt.py.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import torch
from torch import nn

from specserve.layers.quantization.base import InputFeeder, LinearMethod, QuantConfig
from specserve.layers.quantization.compressed_tensors import CompressedTensorsConfig
from specserve.layers.quantization.fp8 import Fp8Config
from specserve.layers.quantization.modelopt import ModelOptConfig
from specserve.layers.quantization.moe import MoEMethod

log = logging.getLogger(__name__)

CONFIGS: dict[str, type[QuantConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "modelopt": ModelOptConfig,
}

# what --quantization X gives a random-weight (--load-format dummy) model
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                },
            }
        },
        "ignore": ["lm_head"],
    },
    "nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    },
}


@functools.lru_cache(maxsize=16)
def _parse(raw_json: str) -> QuantConfig:
    raw = json.loads(raw_json)
    method = str(raw.get("quant_method", "")).lower()
    if method not in CONFIGS:
        raise ValueError(
            f"quantization method {method or None!r} is not supported; "
            f"supported: {', '.join(CONFIGS)}"
        )
    return CONFIGS[method](raw)


def get_quant_config(raw: dict[str, Any] | None) -> QuantConfig | None:
    """The parsed quantization of a checkpoint (ModelConfig.quantization); None = dense."""
    if not raw:
        return None
    return _parse(json.dumps(raw, sort_keys=True, default=str))


def resolve_quantization(
    raw: dict[str, Any] | None, flag: str, dummy: bool,
    model_formats: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The quantization config to build with: the checkpoint's for `auto`; with random
    weights, the format `flag` names (`model_formats[flag]`: how the model's own releases
    quantize in that family, e.g. Kimi K2.5's INT4 routed experts; else PRESET_CONFIGS);
    else `flag` must agree with the checkpoint."""
    if flag == "auto":
        get_quant_config(raw)  # a bad config fails here, before anything loads
        return raw
    if flag not in PRESET_CONFIGS:
        raise ValueError(f"--quantization {flag!r}: choose auto or {', '.join(PRESET_CONFIGS)}")
    if dummy:
        return dict((model_formats or {}).get(flag) or PRESET_CONFIGS[flag])
    found = get_quant_config(raw)
    family = found.family if found is not None else "none (a dense checkpoint)"
    if family != flag:
        raise ValueError(
            f"--quantization {flag} but the checkpoint's weights are {family}: "
            "drop the flag (auto), or use --load-format dummy for random weights"
        )
    return raw


def check_device(raw: dict[str, Any] | None, device: torch.device) -> None:
    """FP8 (W8A8) GEMMs run on FP8 tensor cores, which GPUs before compute capability 8.9
    lack (Triton has no e4m3 type there): refused by name before any weight loads. INT4 and
    NVFP4 run weight-only everywhere (NVFP4's e4m3 scales are decoded from their bits)."""
    from specserve.kernels.gemm_split import fp8_native

    found = get_quant_config(raw)
    if found is None or device.type != "cuda" or fp8_native(device):
        return
    families = {found.family, *(m.family for _, m in getattr(found, "groups", ()))}
    if "fp8" not in families:
        return
    cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
    raise ValueError(
        f"this checkpoint is FP8 ({found.name}), whose GEMMs need FP8 tensor cores: compute "
        f"capability 8.9 or later (Ada, Hopper, Blackwell), and {device} is {cc}; serve a bf16 "
        "or INT4 (w4a16) checkpoint of the model on this GPU, or run with --device cpu"
    )


def quant_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights a quantization method holds: linear layers and routed
    experts (dense ones included)."""
    methods = (LinearMethod, MoEMethod)
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), methods)]


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    for module in quant_modules(model):
        module.process_weights_after_loading()
    for module in model.modules():  # the FP8 rows its kernel writes, per the loaded methods
        if isinstance(module, InputFeeder):
            module.forget_fp8_group()
    counts = describe(model)
    if set(counts) - {"unquantized"}:
        log.info("linear layers and experts by method: %s", counts)


def describe(model: nn.Module) -> dict[str, int]:
    """Linear layers and routed-expert blocks per method name (what logs print)."""
    counts: dict[str, int] = {}
    for module in quant_modules(model):
        counts[module.quant_method.name] = counts.get(module.quant_method.name, 0) + 1
    return counts
