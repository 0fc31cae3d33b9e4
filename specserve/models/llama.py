"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) in one implementation.

Per-family differences are ModelConfig flags: GQA (num_kv_heads), q/k/v bias (Qwen2),
per-head q/k RMSNorm before RoPE (Qwen3), rope scaling, partial rotary, tied embeddings, and a
head_dim that need not be hidden_size / num_heads. `LlamaAttention` also serves GLM-4.5's
attention (models/glm4_moe.py). Tensor parallelism lives in the layers; the decoder
structure (fused residual adds, LM head, loading) is models/decoder.py.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.attention import Attention
from specserve.layers.linear import QKVParallelLinear, RowParallelLinear
from specserve.layers.mlp import GatedMLP
from specserve.layers.norm import RMSNorm
from specserve.layers.quantization import QuantConfig
from specserve.layers.quantization.base import child
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.decoder import CausalLM, DecoderModel, quant_config

# checkpoint name fragment -> (our fused parameter fragment, shard id)
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
# families whose attention_bias covers q/k/v only (o_proj has none)
QKV_ONLY_BIAS = ("Qwen2", "Glm4Moe")


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
        quant: QuantConfig | None = None, prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, config.num_heads, config.num_kv_heads, config.attention_bias,
            quant, child(prefix, "qkv_proj"),
        )  # fmt: skip
        # Qwen2 / GLM put a bias on q/k/v only; Llama-style attention_bias covers o_proj too
        o_bias = config.attention_bias and not config.architecture.startswith(QKV_ONLY_BIAS)
        self.o_proj = RowParallelLinear(
            config.num_heads * hd,
            config.hidden_size,
            o_bias,
            quant,
            child(prefix, "o_proj"),
            reduce_output=False,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = hd
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, hd**-0.5, layer_idx)

    @property
    def input_projs(self) -> tuple[QKVParallelLinear]:
        """The linears that read the attention's whole input (the norm before it feeds them)."""
        return (self.qkv_proj,)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [T, H] -> qkv [T, (heads + 2 * kv_heads) * head_dim] (local heads)
        # -> o_proj's partial sum [T, H] (the decoder layer reduces it)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE is applied by the attention layer (fused with its KV write where it can)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary))  # [T, H]


def llama_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The RoPE every layer shares: over config.rotary_dim of each head's head_dim dims."""
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling, rotary_dim=config.rotary_dim)  # fmt: skip


class LlamaForCausalLM(CausalLM):
    stacked = STACKED_PARAMS

    def __init__(self, config: ModelConfig) -> None:
        rotary = llama_rotary(config)
        quant = quant_config(config)
        model = DecoderModel(
            config, rotary, lambda i, name: LlamaAttention(config, i, rotary, quant, name),
            lambda i, name: GatedMLP(config.hidden_size, config.intermediate_size,
                                     config.hidden_act, False, quant, name),
        )  # fmt: skip
        super().__init__(config, model)
