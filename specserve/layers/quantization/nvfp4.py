"""NVFP4 linear layers, run weight-only (W4A16): e2m1 codes, fp8 scales per 16, a global scale.

Checkpoint tensors per linear (ModelOpt names; compressed-tensors in brackets):
    weight [weight_packed]           uint8 [N, K/2], two e2m1 codes per byte, low nibble first
    weight_scale                     float8_e4m3fn [N, K/16]
    weight_scale_2                   fp32 scalar per fused shard: w = e2m1 * scale * this
      [weight_global_scale]          the reciprocal convention: w = e2m1 * scale / this
    input_scale [input_global_scale] the activation scale of W4A4 kernels; read, unused here
After loading the bytes are viewed as int32 words (the INT4 kernel's layout, no copy) and the
shards' global scales become one fp32 scale per output row.

No FP4 tensor-core GEMM runs here: Hopper has none, and on Blackwell the same W4A16 kernel
runs (`specserve doctor` says so).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.kernels.w4a16_gemm import dequantize_w4
from specserve.layers.quantization.base import LinearMethod, ParamSpec, add_param
from specserve.layers.quantization.w4a16 import apply_w4

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
GROUP = 16
FP4_STD = 2.93  # std of an e2m1 code uniform over its 16 values
NAMES = {  # convention -> (codes, global scale, input scale, global is a reciprocal)
    "modelopt": ("weight", "weight_scale_2", "input_scale", False),
    "compressed-tensors": ("weight_packed", "weight_global_scale", "input_global_scale", True),
}


class Nvfp4LinearMethod(LinearMethod):
    family = "nvfp4"

    def __init__(self, convention: str, has_input_scale: bool = True) -> None:
        self.codes, self.global_name, self.input_name, self.reciprocal = NAMES[convention]
        self.convention = convention
        self.has_input_scale = has_input_scale
        self.name = f"nvfp4-w4a16 ({convention})"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, shards = layer.output_size, layer.input_size, len(layer.out_shards)
        if k % GROUP:
            raise ValueError(
                f"{layer.prefix}: NVFP4 needs input features in multiples of "
                f"{GROUP}, this rank has {k}"
            )
        per_shard = ParamSpec(out_dim=None, in_dim=None, per_shard=True, dtypes=FLOATS)
        add_param(
            layer,
            self.codes,
            torch.empty(n, k // 2, dtype=torch.uint8),
            ParamSpec(in_block=2, dtypes=(torch.uint8,)),
        )
        add_param(
            layer,
            "weight_scale",
            torch.empty(n, k // GROUP, dtype=torch.float8_e4m3fn),
            ParamSpec(in_block=GROUP, dtypes=(torch.float8_e4m3fn,)),
        )
        add_param(layer, self.global_name, torch.empty(shards, dtype=torch.float32), per_shard)
        if self.has_input_scale:
            add_param(layer, self.input_name, torch.empty(shards, dtype=torch.float32), per_shard)

    def process_weights_after_loading(self, layer) -> None:
        codes = layer._parameters.pop(self.codes)
        layer.packed = nn.Parameter(codes.data.view(torch.int32), requires_grad=False)
        glob = layer._parameters.pop(self.global_name).data
        if self.reciprocal:
            glob = 1.0 / glob
        rows = torch.cat([glob[i].expand(size) for i, (_, _, size) in enumerate(layer.out_shards)])
        layer.row_scale = nn.Parameter(rows.contiguous(), requires_grad=False)
        if self.has_input_scale:  # W4A4 only: activations stay in their dtype here
            del layer._parameters[self.input_name]

    def stream_tensors(self, layer) -> list[torch.Tensor]:
        return [layer.packed, layer.weight_scale, layer.row_scale]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_w4(
            layer, x, bias, layer.packed, layer.weight_scale, GROUP, True, layer.row_scale
        )

    def random_init(self, layer, gen: torch.Generator, std: float) -> None:
        codes = getattr(layer, self.codes)
        codes.data.copy_(
            torch.randint(
                0, 256, codes.shape, generator=gen, dtype=torch.uint8, device=codes.device
            )
        )
        layer.weight_scale.data.fill_(8.0)
        glob = std / FP4_STD / 8.0
        getattr(layer, self.global_name).data.fill_(1.0 / glob if self.reciprocal else glob)
        if self.has_input_scale:
            getattr(layer, self.input_name).data.fill_(1.0)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return dequantize_w4(
            layer.packed, layer.weight_scale, GROUP, layer.input_size, True, layer.row_scale
        )
