"""compressed-tensors checkpoints (llm-compressor): `"quant_method": "compressed-tensors"`.

A config lists scheme groups (`config_groups`), each with `targets` (module class names such
as "Linear", exact module names or "re:" patterns), weight and input-activation arguments, and
a global `ignore` list. Supported schemes:
    pack-quantized       int4 weights, symmetric, group strategy: W4A16 (Kimi K2.5, RedHat)
    float-quantized      fp8 weights (block / channel / tensor) with fp8 activations (dynamic
                         per group or per token, or static per tensor): W8A8
    nvfp4-pack-quantized fp4 weights, fp8 scales per 16: run weight-only
"""

from __future__ import annotations

import re
from typing import Any

from specserve.layers.quantization.base import (
    LinearMethod,
    QuantConfig,
    all_or_none,
    checkpoint_names,
)
from specserve.layers.quantization.fp8 import Fp8LinearMethod
from specserve.layers.quantization.nvfp4 import GROUP as NVFP4_GROUP
from specserve.layers.quantization.nvfp4 import Nvfp4LinearMethod
from specserve.layers.quantization.unquantized import UNQUANTIZED
from specserve.layers.quantization.w4a16 import Int4LinearMethod

LINEAR_TARGETS = ("Linear", "nn.Linear", "torch.nn.Linear")


def matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _scheme_method(
    weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str, group_name: str
) -> LinearMethod:
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    strategy = weights.get("strategy")
    where = f"compressed-tensors group {group_name!r} ({fmt}, {kind}{bits} {strategy})"
    if weights.get("symmetric") is False:
        raise ValueError(f"{where}: asymmetric weights (zero points) are not supported")
    if weights.get("actorder") not in (None, "static"):
        raise ValueError(f"{where}: activation reordering (actorder) is not supported")
    if kind == "int" and bits == 4 and acts is None and fmt == "pack-quantized":
        if strategy != "group":
            raise ValueError(f"{where}: int4 needs the group strategy")
        return Int4LinearMethod(int(weights["group_size"]))
    if kind == "float" and bits == 4 and fmt == "nvfp4-pack-quantized":
        if int(weights.get("group_size") or NVFP4_GROUP) != NVFP4_GROUP:
            raise ValueError(f"{where}: NVFP4 groups are {NVFP4_GROUP} elements")
        return Nvfp4LinearMethod("compressed-tensors", has_input_scale=acts is not None)
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if acts is None:
            raise ValueError(f"{where}: FP8 weight-only (W8A16) is not supported; use W8A8")
        a_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            if a_strategy != "group" or not dynamic or int(acts["group_size"]) != block[1]:
                raise ValueError(
                    f"{where}: block FP8 needs dynamic per-group activations with "
                    f"group_size {block[1]}"
                )
            return Fp8LinearMethod("block", "group", (int(block[0]), int(block[1])))
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"{where}: unknown FP8 weight strategy {strategy!r}")
        if dynamic and a_strategy == "token":
            return Fp8LinearMethod(strategy, "token")
        if not dynamic and a_strategy == "tensor":
            return Fp8LinearMethod(strategy, "static")
        raise ValueError(
            f"{where}: FP8 activations must be dynamic per token or static per "
            f"tensor, got {'dynamic' if dynamic else 'static'} {a_strategy}"
        )
    raise ValueError(
        f"{where}: unsupported scheme; supported: int4 group pack-quantized "
        "(W4A16), fp8 float-quantized (W8A8), nvfp4-pack-quantized"
    )


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, raw: dict[str, Any]) -> None:
        groups = raw.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        if raw.get("sparsity_config"):
            raise ValueError("sparse compressed-tensors checkpoints are not supported")
        self.ignore = list(raw.get("ignore") or [])
        self.groups: list[tuple[list[str], LinearMethod]] = []
        for gname, group in groups.items():
            fmt = group.get("format") or raw.get("format") or "dense"
            method = _scheme_method(
                group.get("weights") or {}, group.get("input_activations"), fmt, gname
            )
            self.groups.append((list(group.get("targets") or []), method))
        families = {m.family for _, m in self.groups}
        self.family = families.pop() if len(families) == 1 else "mixed"

    def _method_for(self, name: str) -> LinearMethod | None:
        for targets, method in self.groups:
            if any(t in LINEAR_TARGETS or matches(name, t) for t in targets):
                return method
        return None

    def linear_method(self, prefix: str) -> LinearMethod:
        names = checkpoint_names(prefix)
        if all_or_none(prefix, [any(matches(n, p) for p in self.ignore) for n in names]):
            return UNQUANTIZED
        methods = [self._method_for(n) for n in names]
        if any(m is not methods[0] for m in methods):
            raise ValueError(
                f"the parts of {prefix} fall in different compressed-tensors "
                "groups, but this engine fuses them into one matrix"
            )
        return methods[0] or UNQUANTIZED

    def describe(self) -> str:
        return "compressed-tensors (" + ", ".join(m.name for _, m in self.groups) + ")"
