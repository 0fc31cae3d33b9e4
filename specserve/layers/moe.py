"""The DeepSeek mixture-of-experts block (DeepSeek-V2/V3, Kimi K2): router, routed experts,
shared experts; and the dense-or-MoE choice per layer.

    x [T, H] -> router (fp32): weights, ids [T, k]
             -> routed experts (fused grouped GEMM) + shared experts  -> one all_reduce -> [T, H]

Tensor parallelism splits every expert (routed and shared) over its intermediate dim, like a
dense MLP: rank r holds gate/up rows and down columns [r*I/tp, (r+1)*I/tp) of each expert, runs
every routed token through its slice, and the partial outputs are summed by one all_reduce.
The router is replicated. Routed weights live stacked, w13 [E, 2*I/tp, H] (gate | up) and
w2 [E, H, I/tp]; the checkpoint's per-expert tensors load into their rows (`expert_shards`):
`experts.E.gate_proj.SUFFIX` -> `experts.w13_SUFFIX`, shard (E, "gate"), for the weight and
for a quantized format's scales and packed codes alike (layers/quantization/moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig, MoEConfig
from specserve.distributed.comm import all_reduce
from specserve.distributed.parallel_state import get_tp_rank, get_tp_size
from specserve.kernels.dispatch import EXACT, use_triton
from specserve.kernels.exact_gemm import exact_linear
from specserve.kernels.moe_routing import RoutingRule, grouped_topk, grouped_topk_ref
from specserve.layers.linear import default_weight_loader, divide
from specserve.layers.mlp import GatedMLP
from specserve.layers.quantization.base import QuantConfig, child
from specserve.layers.quantization.moe import load_expert_shard, moe_method

# checkpoint names of routed-expert weights: per expert (hub, transformers-saved) or stacked
# over experts (transformers' in-memory names: gate_up_proj [E, 2I, H], down_proj [E, H, I])
_PER_EXPERT = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.(gate|up|down)_proj\.(\w+)$")
_STACKED = re.compile(r"^((?:.*\.)?experts)\.(gate_up|down)_proj$")

ExpertShard = tuple[int, str]  # (expert, "gate" | "up" | "down")


def expert_shards(
    name: str, tensor: torch.Tensor
) -> list[tuple[str, ExpertShard, torch.Tensor]] | None:
    """(parameter name, shard id, full tensor) for each expert matrix in checkpoint tensor
    `name`; None if `name` is not a routed-expert weight."""
    if match := _PER_EXPERT.match(name):
        prefix, expert, kind, suffix = match.groups()
        param = f"{prefix}.{'w2' if kind == 'down' else 'w13'}_{suffix}"
        return [(param, (int(expert), kind), tensor)]
    if match := _STACKED.match(name):
        prefix, kind = match.groups()
        if kind == "down":
            return [(f"{prefix}.w2_weight", (e, "down"), t) for e, t in enumerate(tensor)]
        inter = tensor.shape[1] // 2
        return [
            (f"{prefix}.w13_weight", (e, part), t[i * inter : (i + 1) * inter])
            for e, t in enumerate(tensor)
            for i, part in enumerate(("gate", "up"))
        ]
    return None


class FusedMoE(nn.Module):
    """The routed experts, stacked over experts and sliced over TP ranks along the
    intermediate dim (dense: w13 [E, 2*I/tp, H], w2 [E, H, I/tp]); the tensors, the loader's
    sharding and the matmul belong to the experts' quantization method
    (layers/quantization/moe.py), which the quant config picks from `prefix.0.gate_proj`."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.full_inter = intermediate_size
        self.inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.prefix = prefix
        self.quant_method = moe_method(quant_config, prefix)
        self.quant_method.create_weights(self, torch.get_default_dtype())

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard | None = None
    ) -> None:
        """`loaded`: one expert's full gate/up [I, H] or down [H, I] tensor (or its scales)."""
        load_expert_shard(self, param, loaded, shard_id)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def stream_tensors(self, expert: int) -> list[list[torch.Tensor]]:
        """The tensors one expert's matmuls read, per matrix (gate_up, down): codes first,
        then scales (the weight-stream floor)."""
        return self.quant_method.stream_tensors(self, expert)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        # x [T, H], topk_* [T, k] -> this rank's partial routed output [T, H]
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


class MoEGate(nn.Module):
    """The router, in fp32 whatever the model dtype (checkpoints store it fp32 or bf16)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        f32 = torch.float32
        self.weight = nn.Parameter(
            torch.empty(moe.num_experts, hidden_size, dtype=f32), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader
        if moe.has_correction_bias:  # shifts the selection only, never the weights
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(moe.num_experts, dtype=f32), requires_grad=False
            )
            self.e_score_correction_bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("e_score_correction_bias", None)
        self.rule = RoutingRule(
            top_k=moe.num_experts_per_tok,
            n_group=moe.n_group if moe.topk_method != "greedy" else 1,
            topk_group=moe.topk_group if moe.topk_method != "greedy" else 1,
            softmax=moe.scoring_func == "softmax",
            group_max=moe.topk_method == "group_limited_greedy",
            renormalize=moe.norm_topk_prob and moe.num_experts_per_tok > 1,
            scaling=moe.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H] -> weights fp32 [T, k], expert ids int32 [T, k]
        # [T, E] fp32; exact mode: M-invariant, so a token's routing ignores its batch
        logits = (exact_linear if EXACT.on else F.linear)(x.float(), self.weight)
        if use_triton(logits):
            return grouped_topk(logits, self.e_score_correction_bias, self.rule)
        return grouped_topk_ref(logits, self.e_score_correction_bias, self.rule)


class DeepseekMoE(nn.Module):
    """Routed experts + shared experts; the TP partial sums are reduced once (or, with
    reduce_output=False, left to the caller: the decoder layer's reduce + add + norm).
    `prefix`: the block's checkpoint name (`model.layers.3.mlp`); the router stays
    unquantized."""

    def __init__(
        self, hidden_size: int, moe: MoEConfig, hidden_act: str = "silu",
        reduce_output: bool = True, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        self.reduce_output = reduce_output
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.gate = MoEGate(hidden_size, moe)
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.intermediate_size,
                                quant_config, child(prefix, "experts"))  # fmt: skip
        self.shared_experts = None
        if moe.num_shared_experts:
            inter = moe.intermediate_size * moe.num_shared_experts
            self.shared_experts = GatedMLP(
                hidden_size, inter, hidden_act, reduce_output=False, quant_config=quant_config,
                prefix=child(prefix, "shared_experts"),
            )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, H] -> [T, H]
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out) if self.reduce_output else out


def make_mlp(
    layer_idx: int, hidden_size: int, intermediate_size: int, moe: MoEConfig | None,
    hidden_act: str = "silu", reduce_output: bool = True,
    quant_config: QuantConfig | None = None, prefix: str = "",
) -> nn.Module:  # fmt: skip
    """Layer `layer_idx`'s feed-forward block: the MoE block, or a dense MLP of
    `intermediate_size` (layers before first_k_dense_replace, off the moe_layer_freq beat)."""
    if moe is not None and moe.is_moe_layer(layer_idx):
        return DeepseekMoE(hidden_size, moe, hidden_act, reduce_output, quant_config, prefix)
    return GatedMLP(hidden_size, intermediate_size, hidden_act, reduce_output, quant_config,
                    prefix)  # fmt: skip


def mlp_layers(
    config: ModelConfig, quant_config: QuantConfig | None = None
) -> Callable[[int, str], nn.Module]:
    """(layer index, checkpoint name) -> that decoder layer's feed-forward block (`make_mlp`),
    leaving its TP partial sum to the decoder layer's reduce + add + norm."""
    return lambda i, name: make_mlp(i, config.hidden_size, config.intermediate_size, config.moe,
                                    config.hidden_act, False, quant_config, name)  # fmt: skip
