"""Tensor-parallel linear layers (the Megatron split, as nano-vllm does it).

Each parameter carries `weight_loader(param, loaded, shard_id=None)`: given the FULL checkpoint
tensor it checks the shape and copies this rank's shard, so model code reads like single-GPU
code. Weights are [out_features, in_features] like nn.Linear.

    ColumnParallel   W [out, in] split on out: rank r holds rows [r*out/tp, (r+1)*out/tp)
    RowParallel      W [out, in] split on in:  partial outputs summed by all_reduce
    Merged / QKV     several column-parallel matrices stacked along out, each split per rank
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.comm import all_reduce
from specserve.distributed.parallel_state import get_tp_rank, get_tp_size


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
    """y = x W^T (+ b) with W [output_size, input_size] already local to this rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; the output stays sharded (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is None
        copy_shard(param, loaded, dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along out (gate_up: shard_id 0 = gate, 1 = up).

    Local layout: [gate shard | up shard], each output_sizes[i] / tp rows.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        self.local_sizes = [divide(s, self.tp_size, "output size") for s in output_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"merged linear needs shard_id in 0..{len(self.local_sizes) - 1}")
        offset = sum(self.local_sizes[:shard_id])
        copy_shard(param, loaded, dim=0, param_offset=offset, shard_size=self.local_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, heads split over ranks (GQA aware).

    Local layout along out: [q: num_heads/tp * head_dim | k: kv/tp * head_dim | v: same].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "num_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp, "num_kv_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total_out = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, total_out, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in offsets:
            raise ValueError(f"qkv linear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = offsets[shard_id]
        copy_shard(param, loaded, dim=0, param_offset=offset, shard_size=size)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial products summed with all_reduce.

    The bias is replicated and added once: by rank 0, before the sum. `reduce_output=False`
    returns the partial product, for a caller that adds several partials and reduces once (the
    decoder layers reduce o_proj and down_proj together with the residual add + RMSNorm).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, reduce_output: bool = True
    ) -> None:
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias)
        self.reduce_output = reduce_output

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is None
        copy_shard(param, loaded, dim=1 if param.dim() == 2 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, input_size / tp] -> partial [T, output_size], summed over ranks
        bias = self.bias if self.tp_rank == 0 else None
        out = F.linear(x, self.weight, bias)
        return all_reduce(out) if self.reduce_output else out
