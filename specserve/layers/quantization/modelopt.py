"""NVIDIA ModelOpt checkpoints: `hf_quant_config.json`, or an inline quantization_config with
`"quant_method": "modelopt"`.

    quant_algo FP8          fp8 weight + per-tensor `weight_scale`, static `input_scale` (W8A8)
    quant_algo NVFP4        see nvfp4.py (run weight-only; routed experts: moe.py)
    quant_algo W4A16_NVFP4  NVFP4 weights without activation scales
`exclude_modules` (legacy file) or `ignore` (inline) list wildcard module names kept in the
activation dtype (e.g. "lm_head", "*self_attn*", "model.layers.0.mlp*").
"""

from __future__ import annotations

from fnmatch import fnmatchcase
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

ALGOS = ("FP8", "NVFP4", "W4A16_NVFP4")


class ModelOptConfig(QuantConfig):
    name = "modelopt"

    def __init__(self, raw: dict[str, Any]) -> None:
        body = {**raw, **dict(raw.get("quantization") or {})}
        algo = str(body.get("quant_algo") or "").upper()
        if algo not in ALGOS:
            raise ValueError(
                f"ModelOpt quant_algo {algo or None!r} is not supported; "
                f"supported: {', '.join(ALGOS)}"
            )
        if algo == "FP8":
            self.method: LinearMethod = Fp8LinearMethod("tensor", "static")
            self.family = "fp8"
        else:
            group = int(body.get("group_size") or NVFP4_GROUP)
            if group != NVFP4_GROUP:
                raise ValueError(f"ModelOpt NVFP4 group_size {group}: only {NVFP4_GROUP}")
            self.method = Nvfp4LinearMethod("modelopt", has_input_scale=algo == "NVFP4")
            self.family = "nvfp4"
        self.algo = algo
        self.exclude = list(body.get("exclude_modules") or body.get("ignore") or [])

    def linear_method(self, prefix: str) -> LinearMethod:
        names = checkpoint_names(prefix)
        excluded = [any(fnmatchcase(n, p) for p in self.exclude) for n in names]
        return UNQUANTIZED if all_or_none(prefix, excluded) else self.method

    def describe(self) -> str:
        return f"modelopt {self.algo} ({self.method.name})"
