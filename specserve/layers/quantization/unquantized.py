"""The dense method: W [out, in] in the activation dtype, y = F.linear(x, W, b)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.dispatch import EXACT
from specserve.kernels.exact_gemm import exact_linear
from specserve.layers.quantization.base import LinearMethod, ParamSpec, add_param


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        weight = torch.empty(layer.output_size, layer.input_size, dtype=dtype)
        add_param(layer, "weight", weight, ParamSpec())

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if EXACT.on:  # M-invariant (kernels/exact_gemm.py)
            return exact_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def random_init(self, layer, gen: torch.Generator, std: float) -> None:
        layer.weight.data.normal_(0.0, std, generator=gen)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return layer.weight.data.float()


UNQUANTIZED = UnquantizedLinearMethod()
