"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate: x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
