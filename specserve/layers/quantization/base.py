"""The quantization-method interface of a linear layer, and the TP-aware shard loader.

A `LinearMethod` owns a layer's weight tensors: it creates them (`create_weights`), the layer's
generic loader copies each checkpoint tensor's shard into them, the method post-processes them
once everything is loaded (`process_weights_after_loading`) and computes y = x W^T (+ b)
(`apply`). A `QuantConfig` (parsed from the checkpoint's config) picks the method per layer.

Every parameter a method creates carries a `ParamSpec`: which of its dims follows the layer's
output features and which its input features, and how many features one index along that dim
covers (1 for a dense weight, 8 for int4 nibbles packed in an int32, 128 for a 128x128 block
scale). The loader shards any such tensor the way the layer shards its logical weight, and
refuses a split that would cut a block (the error names the TP sizes that work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from specserve.layers.linear import LinearBase

# dtypes a quantized checkpoint stores codes in: loading one into a dense parameter would turn
# codes into values without their scales
CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.uint8, torch.int8)


@dataclass(frozen=True)
class ParamSpec:
    """How a parameter maps onto the layer's logical [out, in] weight."""

    out_dim: int | None = 0  # dim indexed by output features (None: not along out)
    in_dim: int | None = 1  # dim indexed by input features (None: not along in)
    out_block: int = 1  # output features per index along out_dim
    in_block: int = 1  # input features per index along in_dim
    per_shard: bool = False  # one entry per fused shard (q/k/v, gate/up): [num_shards, ...]
    dtypes: tuple[torch.dtype, ...] | None = None  # accepted checkpoint dtypes (None: floats)


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor, spec: ParamSpec) -> nn.Parameter:
    """Register `tensor` as parameter `name` of `layer`, loaded through the layer's loader.
    A blocked layout that this layer's shards (fused parts, TP split) would cut fails here,
    naming the checkpoint tensor, before anything is loaded."""
    _check_blocks(layer, name, spec)
    param = nn.Parameter(tensor, requires_grad=False)
    param.quant_spec = spec
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    return param


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _working_tp_sizes(full: int, block: int) -> str:
    sizes = [t for t in range(1, 65) if full % t == 0 and (t == 1 or (full // t) % block == 0)]
    return ", ".join(map(str, sizes))


def block_range(
    full: int, local: int, offset: int, block: int, tp: int, rank: int, what: str
) -> tuple[int, int, int, int]:
    """(source start, length, destination start, checkpoint extent) in block units for a rank
    that takes `local` of the `full` features and places them at local feature `offset`."""
    if offset % block:
        raise ValueError(
            f"this fused layer places a shard at {what} feature {offset}, inside a block of "
            f"{block} features: every shard but the last must be a multiple of {block}"
        )
    if tp == 1:
        rows = cdiv(full, block)
        return 0, rows, offset // block, rows
    if local % block:
        raise ValueError(
            f"its {what} features ({full}) are quantized in blocks of {block}; tp_size {tp} "
            f"gives each rank {local}, which cuts a block: tp sizes that work for this tensor: "
            f"{_working_tp_sizes(full, block)}"
        )
    return rank * local // block, local // block, offset // block, full // block


def _check_blocks(layer: LinearBase, name: str, spec: ParamSpec) -> None:
    if spec.per_shard:
        return
    parts = checkpoint_names(layer.prefix) if layer.prefix else [type(layer).__name__]
    for i, (full, offset, local) in enumerate(layer.out_shards):
        tensor = f"{parts[i] if len(parts) == len(layer.out_shards) else parts[0]}.{name}"
        try:
            if spec.out_dim is not None and spec.out_block > 1:
                block_range(
                    full,
                    local,
                    offset,
                    spec.out_block,
                    layer.tp_size if layer.out_split else 1,
                    0,
                    "output",
                )
            if spec.in_dim is not None and spec.in_block > 1:
                block_range(
                    layer.full_input_size,
                    layer.input_size,
                    0,
                    spec.in_block,
                    layer.tp_size if layer.in_split else 1,
                    0,
                    "input",
                )
        except ValueError as err:
            raise ValueError(f"tensor {tensor!r}: {err}") from None


def load_shard(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None
) -> None:
    """Copy this rank's part of the full checkpoint tensor `loaded` (shard `shard_id` of a
    fused layer) into `param`, following its ParamSpec."""
    spec: ParamSpec = getattr(param, "quant_spec", ParamSpec())
    index = layer.shard_index(shard_id)
    check_dtype(spec, loaded)
    if spec.per_shard:
        target = param.data[index]
        if loaded.numel() != target.numel():
            raise ValueError(
                f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"the model expects {tuple(target.shape) or '(1,) or ()'}"
            )
        target.copy_(loaded.reshape(target.shape))
        return
    full_out, out_offset, out_local = layer.out_shards[index]
    source, target = loaded, param.data
    expected = list(target.shape)
    cuts = []
    if spec.out_dim is not None:
        tp = layer.tp_size if layer.out_split else 1
        rank = layer.tp_rank if layer.out_split else 0
        src, n, dst, rows = block_range(
            full_out, out_local, out_offset, spec.out_block, tp, rank, "output"
        )
        expected[spec.out_dim] = rows
        cuts.append((spec.out_dim, src, n, dst))
    if spec.in_dim is not None:
        tp = layer.tp_size if layer.in_split else 1
        rank = layer.tp_rank if layer.in_split else 0
        src, n, dst, cols = block_range(
            layer.full_input_size, layer.input_size, 0, spec.in_block, tp, rank, "input"
        )
        expected[spec.in_dim] = cols
        cuts.append((spec.in_dim, src, n, dst))
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"the model expects {tuple(expected)}"
        )
    for dim, src, n, dst in cuts:
        source = source.narrow(dim, src, n)
        target = target.narrow(dim, dst, n)
    target.copy_(source)


def check_dense_dtype(loaded: torch.Tensor) -> None:
    """A tensor loaded into a parameter in the activation dtype must hold values, not codes."""
    if loaded.dtype in CODE_DTYPES:
        raise ValueError(
            f"dtype {loaded.dtype} holds quantized codes but this layer is not quantized: "
            "the checkpoint's quantization config is missing, or excludes this layer"
        )


def check_dtype(spec: ParamSpec, loaded: torch.Tensor) -> None:
    if spec.dtypes is None:
        check_dense_dtype(loaded)
    elif loaded.dtype not in spec.dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        raise ValueError(
            f"dtype {str(loaded.dtype).removeprefix('torch.')} where the "
            f"checkpoint's quantization config implies {names}"
        )


class LinearMethod:
    """How one linear layer stores its weight and computes with it."""

    name = "?"
    # the format's family as --quantization spells it (None: unquantized)
    family: str | None = None

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the checkpoint's tensors into the form `apply` reads (once, after loading)."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def random_init(self, layer: LinearBase, gen: torch.Generator, std: float) -> None:
        """Random weights in this format whose values are ~N(0, std) (cost benchmarks)."""
        raise NotImplementedError

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        """The [out, in] fp32 weight this layer computes with (after post-processing)."""
        raise NotImplementedError

    def fused_input_group(self, layer: LinearBase) -> int | None:
        """The group of columns a producer kernel (RMSNorm, SiLU-and-mul: InputFeeder) may
        quantize this layer's input rows in, to FP8 with one scale a row and group, for apply to
        take (FusedInput); None: the layer reads its input as is."""
        return None

    def stream_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        """The weight tensors one forward reads (packed codes first, then scales; no bias)."""
        return [p for name, p in layer.named_parameters(recurse=False) if name != "bias"]

    def stream_bytes(self, layer: LinearBase) -> int:
        """Bytes of weight data one forward reads (packed weights + scales, bias excluded)."""
        return sum(t.numel() * t.element_size() for t in self.stream_tensors(layer))


class QuantConfig:
    """A checkpoint's quantization: which method each linear layer gets."""

    name = "?"
    family = "?"  # fp8 | w4a16 | nvfp4, as --quantization spells it

    def linear_method(self, prefix: str) -> LinearMethod:
        raise NotImplementedError

    def skips_tensor(self, name: str) -> bool:
        """Checkpoint tensors this engine reads past (FP8 KV-cache scales: the KV cache stays
        in the activation dtype)."""
        return name.endswith((".k_scale", ".v_scale"))

    def describe(self) -> str:
        return self.name


# fused modules and the checkpoint modules they stack (for ignore lists written per part)
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def child(prefix: str, name: str) -> str:
    """The checkpoint name of submodule `name` of module `prefix` ("" at the top)."""
    return f"{prefix}.{name}" if prefix else name


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint module names behind our module `prefix` (a fused module has several)."""
    head, _, leaf = prefix.rpartition(".")
    parts = FUSED_PARTS.get(leaf)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def all_or_none(prefix: str, excluded: list[bool]) -> bool:
    """Whether the parts of fused module `prefix` are excluded from quantization (all must
    agree: a fused matrix has one format)."""
    if any(excluded) and not all(excluded):
        parts = ", ".join(checkpoint_names(prefix))
        raise ValueError(
            f"the quantization config excludes only some of {parts}, which this "
            "engine fuses into one matrix: such a checkpoint is not supported"
        )
    return bool(excluded) and all(excluded)


class FusedInput:
    """A linear layer's input rows as a producer kernel already quantized them: offered with
    the very tensor they quantize and taken by the layer's apply for that same tensor only (any
    other input, or none offered: None), so a consumer never reads rows of another tensor."""

    __slots__ = ("x", "rows")

    def __init__(self) -> None:
        self.x = self.rows = None

    def offer(self, x: torch.Tensor, rows: tuple | None) -> None:
        self.x, self.rows = (x, rows) if rows is not None else (None, None)

    def take(self, x: torch.Tensor) -> tuple | None:
        rows = self.rows if self.x is x else None
        self.x = self.rows = None
        return rows


class InputFeeder:
    """For a module whose output is the whole input of some linear layers (the RMSNorm before
    qkv or gate_up, or before MLA's q_a and kv_a; the SiLU-and-mul before down):
    `feeds(*linears)`, then `fp8_group()` says whether its kernel should also write that
    output's FP8 rows (every consumer FP8 with one activation group) and `offer(out, rows)`
    hands them to each. The linears are held outside the module tree (no second registration
    of their parameters)."""

    _consumers: tuple = ()
    _fp8_read: tuple = ()  # (the group,) once read: fixed once the weights are loaded

    def feeds(self, *linears) -> None:  # noqa: ANN002  (LinearBase; None entries dropped)
        object.__setattr__(self, "_consumers", tuple(lin for lin in linears if lin is not None))
        self.forget_fp8_group()

    def fp8_group(self) -> int | None:
        """The consumers' one FP8 activation group, or None: read once (every eager forward
        asked each consumer's method before), again after feeds() or forget_fp8_group()
        (process_weights_after_loading calls it: static scales are known from then)."""
        if not self._fp8_read:
            groups = {lin.quant_method.fused_input_group(lin) for lin in self._consumers}
            object.__setattr__(self, "_fp8_read", (groups.pop() if len(groups) == 1 else None,))
        return self._fp8_read[0]

    def forget_fp8_group(self) -> None:
        object.__setattr__(self, "_fp8_read", ())

    def offer(self, out: torch.Tensor, rows: tuple | None) -> None:
        for lin in self._consumers:
            lin.fused_input.offer(out, rows)
