"""FP8 (e4m3) W8A8 linear layers, and the `"quant_method": "fp8"` checkpoint config.

Weight scales, by strategy (the checkpoint's tensor names differ per producer):
    block    [ceil(N/bn), ceil(K/bk)] fp32, multiplied per bn x bk tile (DeepSeek-V3, Kimi, GLM:
             `weight_scale_inv`; compressed-tensors FP8_BLOCK: `weight_scale`)
    channel  [N, 1] (compressed-tensors FP8_DYNAMIC)
    tensor   one scalar per fused shard (ModelOpt FP8, compressed-tensors FP8), expanded to a
             per-row vector after loading, so fused q/k/v keep their own scales exactly
Activations: dynamic per row and group of 128 (block), dynamic per row (channel/tensor), or a
static per-tensor `input_scale` (fused shards' scales: their maximum, as the shards share x).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specserve.kernels.dispatch import use_triton
from specserve.kernels.fp8_gemm import FP8, fp8_linear, fp8_mm_torch, quant_fp8_torch
from specserve.layers.quantization.base import (
    LinearMethod,
    ParamSpec,
    QuantConfig,
    add_param,
    all_or_none,
    cdiv,
    checkpoint_names,
)
from specserve.layers.quantization.unquantized import UNQUANTIZED

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
STRATEGIES = ("block", "channel", "tensor")
ACTIVATIONS = ("group", "token", "static")


class Fp8LinearMethod(LinearMethod):
    family = "fp8"

    def __init__(
        self,
        strategy: str,
        activation: str,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
    ) -> None:
        assert strategy in STRATEGIES and activation in ACTIVATIONS
        if strategy == "block" and (block is None or activation != "group"):
            raise ValueError(
                "block-scaled FP8 needs weight_block_size and dynamic per-group "
                "activation quantization"
            )
        self.strategy, self.activation, self.block = strategy, activation, block
        self.scale_name = scale_name
        self.name = f"fp8-{strategy}" + (f"{block[0]}x{block[1]}" if block else "")

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, shards = layer.output_size, layer.input_size, len(layer.out_shards)
        add_param(layer, "weight", torch.empty(n, k, dtype=FP8), ParamSpec(dtypes=(FP8,)))
        if self.strategy == "block":
            bn, bk = self.block
            scale = torch.empty(cdiv(n, bn), cdiv(k, bk), dtype=torch.float32)
            spec = ParamSpec(out_block=bn, in_block=bk, dtypes=FLOATS)
        elif self.strategy == "channel":
            scale, spec = (
                torch.empty(n, 1, dtype=torch.float32),
                ParamSpec(in_dim=None, dtypes=FLOATS),
            )
        else:
            scale = torch.empty(shards, dtype=torch.float32)
            spec = ParamSpec(out_dim=None, in_dim=None, per_shard=True, dtypes=FLOATS)
        add_param(layer, self.scale_name, scale, spec)
        if self.activation == "static":
            add_param(
                layer,
                "input_scale",
                torch.empty(shards, dtype=torch.float32),
                ParamSpec(out_dim=None, in_dim=None, per_shard=True, dtypes=FLOATS),
            )

    def process_weights_after_loading(self, layer) -> None:
        scale = getattr(layer, self.scale_name)
        del layer._parameters[self.scale_name]
        if self.strategy == "tensor":  # one scalar per shard -> one per output row
            rows = torch.cat(
                [scale.data[i].expand(size) for i, (_, _, size) in enumerate(layer.out_shards)]
            )
            scale = rows[:, None].contiguous()
        layer.weight_scale = nn.Parameter(scale.data, requires_grad=False)
        if self.activation == "static":
            layer.input_scale = nn.Parameter(
                layer.input_scale.data.max().reshape(1), requires_grad=False
            )

    def _geometry(self, layer) -> tuple[int, int, int]:
        """(activation group, weight scale block rows, block cols) the matmul reads."""
        k = layer.input_size
        if self.strategy == "block":
            return self.block[1], self.block[0], self.block[1]
        return k, 1, k

    def fused_input_group(self, layer) -> int | None:
        # dynamic activation scales (per 128-group or per row) can come from the producer
        return None if self.activation == "static" else self._geometry(layer)[0]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        group, bn, bk = self._geometry(layer)
        static = layer.input_scale if self.activation == "static" else None
        rows = layer.fused_input.take(x)  # x's FP8 rows, if its producer wrote them
        if use_triton(x2):
            y = fp8_linear(x2.contiguous(), layer.weight, layer.weight_scale, bn, bk, group, static,
                           rows=rows)  # fmt: skip
        else:
            xq, xs = quant_fp8_torch(x2, group, static)
            y = fp8_mm_torch(xq, xs, group, layer.weight, layer.weight_scale, bn, bk, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])

    def random_init(self, layer, gen: torch.Generator, std: float) -> None:
        codes = torch.randn(layer.weight.shape, generator=gen, device=layer.weight.device)
        layer.weight.data.copy_((codes * 64).clamp(-448, 448).to(FP8))
        getattr(layer, self.scale_name).data.fill_(std / 64)
        if self.activation == "static":
            layer.input_scale.data.fill_(0.05)

    def dequantized_weight(self, layer) -> torch.Tensor:
        from specserve.kernels.fp8_gemm import expand_scale

        _, bn, bk = self._geometry(layer)
        w = layer.weight.float()
        return w * expand_scale(layer.weight_scale, w.shape[0], w.shape[1], bn, bk)


def _excluded(prefix: str, ignored: list[str]) -> bool:
    names = checkpoint_names(prefix)
    return all_or_none(
        prefix, [any(n == i or n.startswith(i + ".") for i in ignored) for n in names]
    )


class Fp8Config(QuantConfig):
    """`"quant_method": "fp8"` (DeepSeek-V3 style block FP8, or per-tensor FP8)."""

    name = "fp8"
    family = "fp8"

    def __init__(self, raw: dict[str, Any]) -> None:
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported (only e4m3)")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"unknown FP8 activation_scheme {scheme!r} (dynamic | static)")
        block = raw.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or scheme != "dynamic":
                raise ValueError(
                    f"weight_block_size {block} needs two sizes and the dynamic activation scheme"
                )
            self.method = Fp8LinearMethod(
                "block", "group", (int(block[0]), int(block[1])), scale_name="weight_scale_inv"
            )
        else:
            self.method = Fp8LinearMethod("tensor", "static" if scheme == "static" else "token")
        self.ignored = list(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or [])

    def linear_method(self, prefix: str) -> LinearMethod:
        return UNQUANTIZED if _excluded(prefix, self.ignored) else self.method

    def describe(self) -> str:
        return f"fp8 ({self.method.name}, activations {self.method.activation})"
