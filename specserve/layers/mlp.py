"""The gated (SwiGLU) MLP: down(silu(gate(x)) * up(x)), tensor-parallel over the intermediate
dim (gate/up column-parallel in one matrix, down row-parallel)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.layers.activation import SiluAndMul
from specserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from specserve.layers.quantization.base import QuantConfig, child


class GatedMLP(nn.Module):
    """`reduce_output=False` leaves the TP partial sum to the caller (a MoE block adds its
    shared experts to the routed output and reduces once). `prefix`: the checkpoint name of
    the module (`model.layers.3.mlp`), which the quantization config picks formats by."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
        reduce_output: bool = True, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        inter = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [inter, inter], False, quant_config, child(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            inter, hidden_size, False, quant_config, child(prefix, "down_proj"),
            reduce_output=reduce_output,
        )  # fmt: skip
        self.act_fn = SiluAndMul()
        self.act_fn.feeds(self.down_proj)

    @property
    def input_projs(self) -> tuple[MergedColumnParallelLinear]:
        """The linears that read the MLP's whole input (the norm before it feeds them)."""
        return (self.gate_up_proj,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, H] -> [T, 2 * I / tp] -> [T, I / tp] -> [T, H]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
