"""The dense method: W [out, in] in the activation dtype, y = F.linear(x, W, b); on a GPU whose
plan table (kernels/plan_table.py) holds a measured plan for this shape and row count, the
dense Triton GEMM under that plan (kernels/dense_gemm.py: where it beat cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import plan_table
from specserve.kernels.dense_gemm import dense_gemm, plan_format
from specserve.kernels.dispatch import EXACT
from specserve.kernels.exact_gemm import exact_linear
from specserve.layers.quantization.base import LinearMethod, ParamSpec, add_param


def dense_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x w^T (+ bias) for a dense weight: M-invariant in exact mode (kernels/exact_gemm.py);
    else the measured plan of this GPU for the shape and row count if there is one (GPUs only),
    else cuBLAS (F.linear)."""
    if EXACT.on:
        return exact_linear(x, w, bias)
    if (fmt := plan_format(x.dtype)) is not None:
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        plan = plan_table.tuned_plan(fmt, m, w.shape[0], w.shape[1], x.device)
        if plan is not None:
            return dense_gemm(x, w, bias, plan)
    return F.linear(x, w, bias)


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        weight = torch.empty(layer.output_size, layer.input_size, dtype=dtype)
        add_param(layer, "weight", weight, ParamSpec())

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)

    def random_init(self, layer, gen: torch.Generator, std: float) -> None:
        layer.weight.data.normal_(0.0, std, generator=gen)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return layer.weight.data.float()


UNQUANTIZED = UnquantizedLinearMethod()
