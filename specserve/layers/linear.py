"""Tensor-parallel linear layers (the Megatron split, as nano-vllm does it).

Each parameter carries `weight_loader(param, loaded, shard_id=None)`: given the FULL checkpoint
tensor it checks the shape and copies this rank's shard, so model code reads like single-GPU
code. Weights are [out_features, in_features] like nn.Linear.

A layer's tensors and its matmul belong to its quantization method (layers/quantization/):
dense (`F.linear`, the default), FP8, INT4 or NVFP4, picked per layer by the checkpoint's
quantization config from the layer's checkpoint name (`prefix`). The layer describes its
sharding (`out_shards`, `out_split`, `in_split`); one loader shards every tensor of every
method along it (`quantization.base.load_shard`).

    ColumnParallel   W [out, in] split on out: rank r holds rows [r*out/tp, (r+1)*out/tp)
    RowParallel      W [out, in] split on in:  partial outputs summed by all_reduce
    Merged / QKV     several column-parallel matrices stacked along out, each split per rank
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.distributed.comm import all_reduce
from specserve.distributed.parallel_state import get_tp_rank, get_tp_size
from specserve.layers.quantization.base import (
    FusedInput,
    ParamSpec,
    QuantConfig,
    add_param,
    check_dense_dtype,
    load_shard,
)
from specserve.layers.quantization.unquantized import UNQUANTIZED


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by tp_size ({denominator}): "
            f"choose a tp_size that divides it"
        )
    return numerator // denominator


def copy_shard(
    param: torch.Tensor,
    loaded: torch.Tensor,
    dim: int | None,
    param_offset: int = 0,
    shard_size: int | None = None,
) -> None:
    """Copy this rank's slice of the full tensor `loaded` into `param`.

    dim None: `loaded` is replicated and must match `param` exactly. Otherwise the rank's block
    of `shard_size` rows along `dim` goes to param[param_offset : param_offset + shard_size].
    """
    check_dense_dtype(loaded)
    target = param.data
    source = loaded
    expected = list(target.shape)
    if dim is not None:
        shard_size = target.shape[dim] if shard_size is None else shard_size
        target = target.narrow(dim, param_offset, shard_size)
        expected[dim] = shard_size * get_tp_size()
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"the model expects {tuple(expected)}"
        )
    if dim is not None:
        source = loaded.narrow(dim, get_tp_rank() * shard_size, shard_size)
    target.copy_(source)


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str | None = None
) -> None:
    """Replicated parameter: the checkpoint tensor is copied whole."""
    assert shard_id is None, "replicated parameters take no shard_id"
    copy_shard(param, loaded, dim=None)


class LinearBase(nn.Module):
    """y = x W^T (+ b), W [output_size, input_size] local to this rank, held by the quant method.

    out_shards[i] = (full size, local offset, local size) of fused shard i along the output
    (one entry for an unfused layer); out_split / in_split: whether TP splits that axis.
    reduce_output (row-parallel layers): False returns this rank's partial product, for a
    caller that adds several partials and reduces once. dequantize_after_loading: a layer whose
    weight its owner reads as a dense matrix (MLA's kv_b_proj, viewed as W_UK / W_UV) loads in
    the checkpoint's format, then becomes a dense layer holding the dequantized weight.
    """

    out_split = False
    in_split = False

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        *,
        reduce_output: bool = True,
        dequantize_after_loading: bool = False,
    ) -> None:
        super().__init__()
        self.reduce_output = reduce_output
        self.dequantize_after_loading = dequantize_after_loading
        self.params_dtype = torch.get_default_dtype()
        if isinstance(output_sizes, int):
            output_sizes = [output_sizes]
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.full_input_size = input_size
        self.input_size = (
            divide(input_size, self.tp_size, "input size") if self.in_split else input_size
        )
        locals_ = [
            divide(s, self.tp_size, "output size") if self.out_split else s for s in output_sizes
        ]
        offsets = [sum(locals_[:i]) for i in range(len(locals_))]
        self.out_shards = list(zip(output_sizes, offsets, locals_))
        self.output_size = sum(locals_)
        self.prefix = prefix
        method = UNQUANTIZED if quant_config is None else quant_config.linear_method(prefix)
        self.quant_method = method
        self.fused_input = FusedInput()  # rows a producer kernel quantized for it (FP8)
        method.create_weights(self, torch.get_default_dtype())
        if bias:
            add_param(self, "bias", torch.empty(self.output_size), ParamSpec(in_dim=None))
        else:
            self.register_parameter("bias", None)

    def shard_index(self, shard_id: int | str | None) -> int:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        return 0

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        load_shard(self, param, loaded, shard_id)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)
        if self.dequantize_after_loading and self.quant_method is not UNQUANTIZED:
            weight = self.quant_method.dequantized_weight(self).to(self.params_dtype)
            for name in [n for n in self._parameters if n != "bias"]:
                del self._parameters[name]
            self.quant_method = UNQUANTIZED
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; the output stays sharded (no communication)."""

    out_split = True


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices stacked along out (gate_up: shard_id 0 = gate, 1 = up).

    Local layout: [gate shard | up shard], each output_sizes[i] / tp rows.
    """

    out_split = True

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, self.output_sizes, bias, quant_config, prefix)
        self.local_sizes = [size for _, _, size in self.out_shards]

    def shard_index(self, shard_id: int | str | None) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear needs shard_id in 0..{len(self.output_sizes) - 1}")
        return shard_id


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matrix, heads split over ranks (GQA aware).

    Local layout along out: [q: num_heads/tp * head_dim | k: kv/tp * head_dim | v: same].
    """

    out_split = True
    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "num_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp, "num_kv_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        sizes = [total_num_heads * head_dim] + [total_num_kv_heads * head_dim] * 2
        super().__init__(hidden_size, sizes, bias, quant_config, prefix)

    def shard_index(self, shard_id: int | str | None) -> int:
        if shard_id not in self.SHARDS:
            raise ValueError(f"qkv linear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        return self.SHARDS.index(shard_id)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial products summed with all_reduce.

    The bias is replicated and added once: by rank 0, before the sum. `reduce_output=False`
    returns the partial product, for a caller that adds several partials and reduces once (the
    decoder layers reduce o_proj and down_proj together with the residual add + RMSNorm).
    """

    in_split = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, input_size / tp] -> partial [T, output_size], summed over ranks
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        return all_reduce(out) if self.reduce_output else out
