"""INT4 weight-only linear layers (W4A16): compressed-tensors `pack-quantized`, symmetric groups.

Checkpoint tensors per linear: `weight_packed` int32 [N, ceil(K/8)] (element 8c + i in bits
4i of word c, stored as nibble = q + 8), `weight_scale` [N, ceil(K/G)] and `weight_shape`
[2] = (N, K), validated and dropped after loading. w = (nibble - 8) * scale[n, k // G].
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import use_triton
from specserve.kernels.w4a16_gemm import dequantize_w4, w4a16_mm, w4a16_mm_torch
from specserve.layers.quantization.base import LinearMethod, ParamSpec, add_param, cdiv

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INT4_STD = 4.61  # std of a nibble uniform over -8..7


def apply_w4(
    layer,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    fp4: bool,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """y = x W^T (+ b) for a 4-bit weight: the Triton kernel on CUDA, else dequantize."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if use_triton(x2):
        y = w4a16_mm(x2.contiguous(), packed, scales, group, fp4, row_scale)
    else:
        y = w4a16_mm_torch(x2, packed, scales, group, fp4, row_scale)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


class Int4LinearMethod(LinearMethod):
    family = "w4a16"

    def __init__(self, group_size: int) -> None:
        if group_size <= 0 or group_size % 8:
            raise ValueError(f"INT4 group_size {group_size} must be a positive multiple of 8")
        self.group = group_size
        self.name = f"int4-w4a16-g{group_size}"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        add_param(
            layer,
            "weight_packed",
            torch.empty(n, cdiv(k, 8), dtype=torch.int32),
            ParamSpec(in_block=8, dtypes=(torch.int32,)),
        )
        add_param(
            layer,
            "weight_scale",
            torch.empty(n, cdiv(k, self.group), dtype=dtype),
            ParamSpec(in_block=self.group, dtypes=FLOATS),
        )
        add_param(
            layer,
            "weight_shape",
            torch.zeros(len(layer.out_shards), 2, dtype=torch.long),
            ParamSpec(out_dim=None, in_dim=None, per_shard=True, dtypes=(torch.int32, torch.int64)),
        )

    def process_weights_after_loading(self, layer) -> None:
        shapes = layer.weight_shape.tolist()
        del layer._parameters["weight_shape"]
        for (full, _, _), got in zip(layer.out_shards, shapes):
            if got != [full, layer.full_input_size]:
                raise ValueError(
                    f"{layer.prefix}: weight_shape {got} differs from the layer's "
                    f"{[full, layer.full_input_size]}"
                )

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_w4(
            layer, x, bias, layer.weight_packed, layer.weight_scale, self.group, False, None
        )

    def random_init(self, layer, gen: torch.Generator, std: float) -> None:
        p = layer.weight_packed
        p.data.copy_(
            torch.randint(
                -(2**31), 2**31 - 1, p.shape, generator=gen, dtype=torch.int32, device=p.device
            )
        )
        layer.weight_scale.data.fill_(std / INT4_STD)
        for i, (full, _, _) in enumerate(layer.out_shards):
            layer.weight_shape.data[i] = torch.tensor([full, layer.full_input_size])

    def dequantized_weight(self, layer) -> torch.Tensor:
        return dequantize_w4(
            layer.weight_packed, layer.weight_scale, self.group, layer.input_size, False
        )
