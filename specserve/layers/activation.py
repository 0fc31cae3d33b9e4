"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.dispatch import use_triton
from specserve.kernels.fused_ops import silu_and_mul


class SiluAndMul(nn.Module):
    """SwiGLU gate: x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, 2 * I] -> [T, I]
        if use_triton(x) and x.is_contiguous():
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
