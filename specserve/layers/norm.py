"""RMSNorm with an optional fused residual add (the vLLM decoder-layer convention)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.distributed.comm import all_reduce_add_rms_norm
from specserve.kernels.dispatch import use_triton
from specserve.kernels.fused_ops import fused_add_rms_norm, rms_norm
from specserve.layers.linear import default_weight_loader
from specserve.layers.quantization.base import InputFeeder


class RMSNorm(InputFeeder, nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics in fp32 like transformers.

    forward(x) -> y; forward(x, residual) -> (norm(x + residual), x + residual): the sum is
    the residual stream carried to the next sub-layer. reduce_add(x, residual) is the same
    with x a tensor-parallel partial sum: all-reduced first, fused where the backend can.
    feeds(linear): the normed output is that linear's input; an FP8 one gets its rows
    quantized by the norm's kernel (InputFeeder).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x, self.weight) and x.is_contiguous():  # one fused kernel instead of ~7
            group = self.fp8_group()
            if not group:
                if residual is None:
                    return rms_norm(x, self.weight, self.eps)
                return fused_add_rms_norm(x, residual, self.weight, self.eps)
            if residual is None:
                out, rows = rms_norm(x, self.weight, self.eps, fp8_group=group)
                self.offer(out, rows)
                return out
            out, res, rows = fused_add_rms_norm(x, residual, self.weight, self.eps, group)
            self.offer(out, rows)
            return out, res
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the activation dtype, as the unfused model adds
        return self._norm(x), x

    def reduce_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this rank's partial sum [T, H] -> (norm(sum + residual), sum + residual); at
        TP 1 exactly forward(x, residual)."""
        return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.forward)
