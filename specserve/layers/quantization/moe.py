"""Quantization methods of the routed experts (layers.moe.FusedMoE).

Like a linear method, a `MoEMethod` creates the experts' tensors, post-processes them after
loading and computes the routed output; its tensors are stacked over experts ([E, ...] with
expert e's tensor at [e]) and split over TP ranks along the intermediate dim (gate/up rows,
down columns), scales included. The checkpoint stores each expert's matrices apart:
`experts.E.{gate,up,down}_proj.SUFFIX` loads into parameter `w13_SUFFIX` (gate and up) or
`w2_SUFFIX` (down), shard (E, kind).

    unquantized  w13_weight [E, 2I, H], w2_weight [E, H, I] in the activation dtype
    fp8 block    + w13_weight_scale_inv / w13_weight_scale [E, 2 ceil(I/bn), ceil(H/bk)] fp32
                 (gate blocks then up blocks), w2_... [E, ceil(H/bn), ceil(I/bk)]: W8A8, the
                 activations of both GEMMs quantized per token and 128-group in the K loop
    int4 W4A16   w13_weight_packed int32 [E, 2I, H/8], w13_weight_scale [E, 2I, H/G],
                 w13_weight_shape (checked, then dropped); w2 likewise [E, H, I/8], [E, H, I/G]
    nvfp4 W4A16  w13_weight uint8 [E, 2I, H/2] (two e2m1 codes a byte, low nibble first),
                 w13_weight_scale float8_e4m3fn [E, 2I, H/16], w13_weight_scale_2 fp32 [E, 2]
                 (gate, up: each part's global scale), w13_input_scale [E, 2] (W4A4 only:
                 read, then dropped); w2 likewise [E, H, I/2], [E, H, I/16], [E, 1], [E, 1].
                 compressed-tensors names: weight_packed, weight_global_scale (the reciprocal),
                 input_global_scale. After loading: w13_packed (the bytes as int32 words) and
                 w13_global_scale [E, 2] fp32 (w = e2m1 * scale * global)
The config's method for the experts is its linear method for `experts.0.{gate,up,down}_proj`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.kernels.dispatch import use_triton
from specserve.kernels.fp8_gemm import FP8
from specserve.kernels.fused_moe import (
    DENSE,
    FP8_BLOCK,
    INT4,
    NVFP4,
    ExpertWeights,
    fused_moe,
    fused_moe_ref,
)
from specserve.layers.quantization.base import (
    LinearMethod,
    ParamSpec,
    QuantConfig,
    block_range,
    cdiv,
    check_dtype,
    child,
)
from specserve.layers.quantization.fp8 import FLOATS, Fp8LinearMethod
from specserve.layers.quantization.nvfp4 import FP4_STD, NAMES, Nvfp4LinearMethod
from specserve.layers.quantization.nvfp4 import GROUP as NVFP4_GROUP
from specserve.layers.quantization.unquantized import UNQUANTIZED
from specserve.layers.quantization.w4a16 import INT4_STD, Int4LinearMethod

if TYPE_CHECKING:
    from specserve.layers.moe import FusedMoE

PART = {"gate": 0, "up": 1, "down": 0}  # row part of w13 (gate | up) or w2
FP4_SCALE = torch.float8_e4m3fn  # NVFP4's group scales


def add_expert_param(
    layer: FusedMoE, which: str, suffix: str, tensor: torch.Tensor, spec: ParamSpec
) -> nn.Parameter:
    """Register `tensor` ([E, ...]) as `{which}_{suffix}`, loaded per (expert, kind) shard. A
    TP split that would cut one of its blocks fails here, naming the checkpoint tensor."""
    kinds = ("gate", "up") if which == "w13" else ("down",)
    name = f"{which}_{suffix}"
    if not spec.per_shard:
        for dim, block in ((0, spec.out_block), (1, spec.in_block)):
            full, local, split = _extent(layer, which, dim)
            try:
                block_range(full, local, 0, block, layer.tp_size if split else 1, 0,
                            _label(split))  # fmt: skip
            except ValueError as err:
                tensor_name = child(layer.prefix, f"0.{kinds[0]}_proj.{suffix}")
                raise ValueError(f"tensor {tensor_name!r}: {err}") from None
    param = nn.Parameter(tensor, requires_grad=False)
    param.quant_spec = spec
    param.moe_which = which
    param.weight_loader = layer.weight_loader
    # every shard a complete checkpoint loads into the parameter
    param.shard_ids = [(e, kind) for e in range(layer.num_experts) for kind in kinds]
    layer.register_parameter(name, param)
    return param


def _label(split: bool) -> str:
    return "intermediate" if split else "hidden"


def _extent(layer: FusedMoE, which: str, dim: int) -> tuple[int, int, bool]:
    """(full size, this rank's size, split over TP) of dim 0 (out) / 1 (in) of one expert's
    matrix: w13 rows and w2 columns are the intermediate dim."""
    if (which == "w13") == (dim == 0):
        return layer.full_inter, layer.inter, True
    return layer.hidden_size, layer.hidden_size, False


def load_expert_shard(
    layer: FusedMoE, param: nn.Parameter, loaded: torch.Tensor, shard_id: object
) -> None:
    """Copy this rank's part of one expert's checkpoint tensor (`loaded`: its full [out, in]
    matrix, block scales or packed words) into `param[expert]`, part `kind`."""
    if not (isinstance(shard_id, tuple) and len(shard_id) == 2
            and 0 <= shard_id[0] < layer.num_experts):  # fmt: skip
        raise ValueError(f"expert weights need shard_id (expert, kind), got {shard_id!r}")
    expert, kind = shard_id
    which = param.moe_which
    if kind not in PART or (kind == "down") != (which == "w2"):
        raise ValueError(f"shard kind {kind!r} does not belong to this parameter")
    spec: ParamSpec = param.quant_spec
    check_dtype(spec, loaded)
    target = param.data[expert]
    part = PART[kind]
    if spec.per_shard:
        if loaded.numel() != target[part].numel():
            raise ValueError(
                f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"the model expects {tuple(target[part].shape)}"
            )
        target[part].copy_(loaded.reshape(target[part].shape))
        return
    cuts = []
    for dim, block in ((0, spec.out_block), (1, spec.in_block)):
        full, local, split = _extent(layer, which, dim)
        tp, rank = (layer.tp_size, layer.tp_rank) if split else (1, 0)
        src, n, _, extent = block_range(full, local, 0, block, tp, rank, _label(split))
        cuts.append((src, n, extent))
    expected = (cuts[0][2], cuts[1][2])
    if tuple(loaded.shape) != expected:
        raise ValueError(
            f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"the model expects {expected}"
        )
    (src_o, n_o, _), (src_i, n_i, _) = cuts
    # part p of w13 starts at row p * (its rows): gate then up, each with its own blocks
    dst = target.narrow(0, part * n_o, n_o).narrow(1, 0, n_i)
    dst.copy_(loaded.narrow(0, src_o, n_o).narrow(1, src_i, n_i))


class MoEMethod:
    """How the routed experts store their weights and compute with them."""

    name = "?"
    family: str | None = None  # as --quantization spells it (None: unquantized)

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Turn the checkpoint's tensors into the form `apply` reads (once, after loading)."""

    def expert_weights(self, layer: FusedMoE) -> tuple[ExpertWeights, ExpertWeights]:
        """(gate_up, down) as the grouped GEMMs read them."""
        raise NotImplementedError

    def random_init(self, layer: FusedMoE, gen: torch.Generator, std: float) -> None:
        """Random weights in this format whose values are ~N(0, std) (cost benchmarks)."""
        raise NotImplementedError

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        # x [T, H], topk_* [T, k] -> this rank's partial routed output [T, H]
        w13, w2 = self.expert_weights(layer)
        if use_triton(x):
            return fused_moe(x, w13, w2, topk_weights, topk_ids)
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)

    def stream_tensors(self, layer: FusedMoE, expert: int) -> list[list[torch.Tensor]]:
        """The tensors expert `expert`'s two matmuls read (codes first, then scales)."""
        out = []
        for w in self.expert_weights(layer):
            out.append([w.weight[expert]] + ([w.scale[expert]] if w.scale is not None else []))
        return out


class UnquantizedMoEMethod(MoEMethod):
    name = "unquantized"

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.inter
        add_expert_param(layer, "w13", "weight", torch.empty(e, 2 * i, h, dtype=dtype),
                         ParamSpec())  # fmt: skip
        add_expert_param(layer, "w2", "weight", torch.empty(e, h, i, dtype=dtype), ParamSpec())

    def expert_weights(self, layer: FusedMoE) -> tuple[ExpertWeights, ExpertWeights]:
        h, i = layer.hidden_size, layer.inter
        return (ExpertWeights(DENSE, layer.w13_weight, None, h, parts=2),
                ExpertWeights(DENSE, layer.w2_weight, None, i))  # fmt: skip

    def random_init(self, layer: FusedMoE, gen: torch.Generator, std: float) -> None:
        for p in (layer.w13_weight, layer.w2_weight):
            p.data.normal_(0.0, std, generator=gen)


class Fp8BlockMoEMethod(MoEMethod):
    """FP8 experts with [bn, bk] block scales, W8A8 (activations per token and bk-group)."""

    family = "fp8"

    def __init__(self, block: tuple[int, int], scale_name: str) -> None:
        bn, bk = block
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"FP8 expert blocks of {bk} input features: need a power of 2, "
                             "at least 16 (the K of one MMA step)")
        self.block, self.scale_name = (bn, bk), scale_name
        self.name = f"fp8-block{bn}x{bk}-moe"

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        (bn, bk), e, h, i = self.block, layer.num_experts, layer.hidden_size, layer.inter
        code = ParamSpec(dtypes=(FP8,))
        scale = ParamSpec(out_block=bn, in_block=bk, dtypes=FLOATS)
        add_expert_param(layer, "w13", "weight", torch.empty(e, 2 * i, h, dtype=FP8), code)
        add_expert_param(layer, "w13", self.scale_name,
                         torch.empty(e, 2 * cdiv(i, bn), cdiv(h, bk)), scale)  # fmt: skip
        add_expert_param(layer, "w2", "weight", torch.empty(e, h, i, dtype=FP8), code)
        add_expert_param(layer, "w2", self.scale_name,
                         torch.empty(e, cdiv(h, bn), cdiv(i, bk)), scale)  # fmt: skip

    def expert_weights(self, layer: FusedMoE) -> tuple[ExpertWeights, ExpertWeights]:
        (bn, bk), s = self.block, self.scale_name
        w13 = ExpertWeights(FP8_BLOCK, layer.w13_weight, getattr(layer, f"w13_{s}"),
                            layer.hidden_size, bn, bk, parts=2)  # fmt: skip
        w2 = ExpertWeights(FP8_BLOCK, layer.w2_weight, getattr(layer, f"w2_{s}"), layer.inter,
                           bn, bk)  # fmt: skip
        return w13, w2

    def random_init(self, layer: FusedMoE, gen: torch.Generator, std: float) -> None:
        for which in ("w13", "w2"):
            w = getattr(layer, f"{which}_weight")
            for e in range(w.shape[0]):  # one expert at a time: fp32 codes of all 384 of
                # Kimi K2's experts would take 42 GB
                codes = torch.randn(w.shape[1:], generator=gen, device=w.device)
                w.data[e].copy_((codes * 64).clamp(-448, 448).to(FP8))
            getattr(layer, f"{which}_{self.scale_name}").data.fill_(std / 64)


class Int4MoEMethod(MoEMethod):
    """INT4 experts (compressed-tensors pack-quantized, symmetric groups of G), W4A16."""

    family = "w4a16"

    def __init__(self, group: int) -> None:
        self.group = group
        self.name = f"int4-w4a16-g{group}-moe"

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.inter, self.group
        packed = ParamSpec(in_block=8, dtypes=(torch.int32,))
        scale = ParamSpec(in_block=g, dtypes=FLOATS)
        shape = ParamSpec(out_dim=None, in_dim=None, per_shard=True,
                          dtypes=(torch.int32, torch.int64))  # fmt: skip
        for which, (n, k), parts in (("w13", (2 * i, h), 2), ("w2", (h, i), 1)):
            add_expert_param(layer, which, "weight_packed",
                             torch.empty(e, n, cdiv(k, 8), dtype=torch.int32), packed)  # fmt: skip
            add_expert_param(layer, which, "weight_scale",
                             torch.empty(e, n, cdiv(k, g), dtype=dtype), scale)  # fmt: skip
            add_expert_param(layer, which, "weight_shape",
                             torch.zeros(e, parts, 2, dtype=torch.long), shape)  # fmt: skip

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        full = {"w13": [layer.full_inter, layer.hidden_size],
                "w2": [layer.hidden_size, layer.full_inter]}  # fmt: skip
        for which, want in full.items():
            shapes = layer._parameters.pop(f"{which}_weight_shape").data
            bad = (shapes != torch.tensor(want, device=shapes.device)).any(-1).nonzero()
            if len(bad):
                e, part = bad[0].tolist()
                kind = "down" if which == "w2" else ("gate", "up")[part]
                raise ValueError(
                    f"{child(layer.prefix, f'{e}.{kind}_proj.weight_shape')}: "
                    f"{shapes[e, part].tolist()} differs from the layer's {want}"
                )

    def expert_weights(self, layer: FusedMoE) -> tuple[ExpertWeights, ExpertWeights]:
        g = self.group
        w13 = ExpertWeights(INT4, layer.w13_weight_packed, layer.w13_weight_scale,
                            layer.hidden_size, 1, g, parts=2)  # fmt: skip
        w2 = ExpertWeights(INT4, layer.w2_weight_packed, layer.w2_weight_scale, layer.inter, 1, g)
        return w13, w2

    def random_init(self, layer: FusedMoE, gen: torch.Generator, std: float) -> None:
        for which, want in (("w13", [layer.full_inter, layer.hidden_size]),
                            ("w2", [layer.hidden_size, layer.full_inter])):  # fmt: skip
            p = getattr(layer, f"{which}_weight_packed")
            p.data.copy_(torch.randint(-(2**31), 2**31 - 1, p.shape, generator=gen,
                                       dtype=torch.int32, device=p.device))  # fmt: skip
            getattr(layer, f"{which}_weight_scale").data.fill_(std / INT4_STD)
            getattr(layer, f"{which}_weight_shape").data[:] = torch.tensor(want)


class Nvfp4MoEMethod(MoEMethod):
    """NVFP4 experts (ModelOpt or compressed-tensors), run weight-only (W4A16): e2m1 codes,
    e4m3 scales per 16 inputs, one global scale per expert and part (gate, up, down)."""

    family = "nvfp4"

    def __init__(self, convention: str, has_input_scale: bool = True) -> None:
        self.codes, self.global_name, self.input_name, self.reciprocal = NAMES[convention]
        self.has_input_scale = has_input_scale
        self.name = f"nvfp4-w4a16-moe ({convention})"

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.inter, NVFP4_GROUP
        f32 = torch.float32  # global scales stay fp32 whatever the activation dtype
        for what, size in (("hidden_size", h), ("moe_intermediate_size", layer.full_inter)):
            if size % g:
                raise ValueError(f"{layer.prefix}: NVFP4 experts need {what} in multiples of "
                                 f"{g} (their scale groups), got {size}")  # fmt: skip
        codes = ParamSpec(in_block=2, dtypes=(torch.uint8,))
        # a TP slice of I that cuts a group fails here, naming down_proj's weight_scale
        scale = ParamSpec(in_block=g, dtypes=(FP4_SCALE,))
        per_part = ParamSpec(out_dim=None, in_dim=None, per_shard=True, dtypes=FLOATS)
        for which, (n, k), parts in (("w13", (2 * i, h), 2), ("w2", (h, i), 1)):
            tensors = {self.codes: (torch.empty(e, n, k // 2, dtype=torch.uint8), codes),
                       "weight_scale": (torch.empty(e, n, k // g, dtype=FP4_SCALE), scale),
                       self.global_name: (torch.empty(e, parts, dtype=f32), per_part)}  # fmt: skip
            if self.has_input_scale:
                tensors[self.input_name] = (torch.empty(e, parts, dtype=f32), per_part)
            for suffix, (tensor, spec) in tensors.items():
                add_expert_param(layer, which, suffix, tensor, spec)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for which in ("w13", "w2"):
            codes = layer._parameters.pop(f"{which}_{self.codes}").data
            setattr(layer, f"{which}_packed",
                    nn.Parameter(codes.view(torch.int32), requires_grad=False))  # fmt: skip
            glob = layer._parameters.pop(f"{which}_{self.global_name}").data
            if self.reciprocal:
                glob = 1.0 / glob
            setattr(layer, f"{which}_global_scale",
                    nn.Parameter(glob.contiguous(), requires_grad=False))  # fmt: skip
            if self.has_input_scale:  # W4A4 only: the activations stay in their dtype here
                del layer._parameters[f"{which}_{self.input_name}"]

    def expert_weights(self, layer: FusedMoE) -> tuple[ExpertWeights, ExpertWeights]:
        g = NVFP4_GROUP
        w13 = ExpertWeights(NVFP4, layer.w13_packed, layer.w13_weight_scale, layer.hidden_size,
                            1, g, 2, layer.w13_global_scale)  # fmt: skip
        w2 = ExpertWeights(NVFP4, layer.w2_packed, layer.w2_weight_scale, layer.inter, 1, g, 1,
                           layer.w2_global_scale)  # fmt: skip
        return w13, w2

    def stream_tensors(self, layer: FusedMoE, expert: int) -> list[list[torch.Tensor]]:
        return [[w.weight[expert], w.scale[expert], w.global_scale[expert]]
                for w in self.expert_weights(layer)]  # fmt: skip

    def random_init(self, layer: FusedMoE, gen: torch.Generator, std: float) -> None:
        """Uniform random codes (one expert at a time), scales 8, global scales giving the
        values a std of `std`."""
        glob = std / FP4_STD / 8.0
        for which in ("w13", "w2"):
            codes = getattr(layer, f"{which}_{self.codes}")
            for e in range(codes.shape[0]):
                codes.data[e].copy_(torch.randint(0, 256, codes.shape[1:], generator=gen,
                                                  dtype=torch.uint8, device=codes.device))
            getattr(layer, f"{which}_weight_scale").data.fill_(8.0)
            getattr(layer, f"{which}_{self.global_name}").data.fill_(
                1.0 / glob if self.reciprocal else glob)
            if self.has_input_scale:
                getattr(layer, f"{which}_{self.input_name}").data.fill_(1.0)


UNQUANTIZED_MOE = UnquantizedMoEMethod()


def moe_method(quant_config: QuantConfig | None, prefix: str) -> MoEMethod:
    """The routed experts' method under `quant_config` (None: dense): the format its linear
    method gives `experts.0.{gate,up,down}_proj` (`prefix`: the experts' checkpoint name)."""
    if quant_config is None:
        return UNQUANTIZED_MOE
    names = [child(prefix, f"0.{kind}_proj") for kind in ("gate", "up", "down")]
    methods: list[LinearMethod] = [quant_config.linear_method(n) for n in names]
    if any(m is not methods[0] for m in methods):
        raise ValueError(
            f"{quant_config.describe()} gives {', '.join(names)} different formats "
            f"({', '.join(m.name for m in methods)}); one format for every expert matrix is "
            "supported"
        )
    method = methods[0]
    if method is UNQUANTIZED:
        return UNQUANTIZED_MOE
    if isinstance(method, Fp8LinearMethod) and method.strategy == "block":
        return Fp8BlockMoEMethod(method.block, method.scale_name)
    if isinstance(method, Int4LinearMethod):
        return Int4MoEMethod(method.group)
    if isinstance(method, Nvfp4LinearMethod):
        return Nvfp4MoEMethod(method.convention, method.has_input_scale)
    raise ValueError(
        f"{names[0]}: routed experts in {method.name} are not supported; supported expert "
        "formats: unquantized, fp8 block (W8A8), int4 pack-quantized (W4A16), nvfp4 (run as "
        "W4A16)"
    )
