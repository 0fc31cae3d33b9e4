"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.dispatch import use_triton
from specserve.kernels.fused_ops import silu_and_mul
from specserve.layers.quantization.base import InputFeeder


class SiluAndMul(InputFeeder, nn.Module):
    """SwiGLU gate: x = [gate | up] along the last dim -> silu(gate) * up. feeds(linear): the
    output is that linear's input (its FP8 rows written by the same kernel: InputFeeder)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, 2 * I] -> [T, I]
        if use_triton(x) and x.is_contiguous():
            group = self.fp8_group()
            if not group:
                return silu_and_mul(x)
            out, rows = silu_and_mul(x, fp8_group=group)
            self.offer(out, rows)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
