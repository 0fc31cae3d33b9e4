"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) in one implementation.

Per-family differences are ModelConfig flags: GQA (num_kv_heads), q/k/v bias (Qwen2),
per-head q/k RMSNorm before RoPE (Qwen3), rope scaling, tied embeddings, and a head_dim that
need not be hidden_size / num_heads. Tensor parallelism lives in the layers.

Decoder layers pass (hidden, residual) so each residual add is fused into the next RMSNorm:
    layer 0:  residual = x;            h = attn(norm(x))
    layer i:  h, residual = norm(h + residual) ...
The residual stream entering layer i is therefore `hidden + residual` (just `hidden` for
layer 0), which is what aux-hidden-state capture reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import get_tp_size
from specserve.layers.attention import Attention
from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import QKVParallelLinear, RowParallelLinear, default_weight_loader
from specserve.layers.mlp import GatedMLP
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding

# checkpoint name fragment -> (our fused parameter fragment, shard id)
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, config.num_heads, config.num_kv_heads, config.attention_bias
        )
        # Qwen2 puts a bias on q/k/v only; Llama-style attention_bias covers o_proj too
        o_bias = config.attention_bias and not config.architecture.startswith("Qwen2")
        self.o_proj = RowParallelLinear(config.num_heads * hd, config.hidden_size, o_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = hd
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, hd**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [T, H] -> qkv [T, (heads + 2 * kv_heads) * head_dim] (local heads)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE is applied by the attention layer (fused with its KV write where it can)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> final-normed hidden [T, H]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [n, H] -> [n, vocab] float32, full vocabulary on every rank
        return self.lm_head.compute_logits(hidden).float()

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
        params = dict(self.named_parameters())  # tied weights appear once, as embed_tokens
        expected = set(_expected_loads(params))
        done: set[tuple[str, object]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if self.config.tie_word_embeddings and hf_name == "lm_head.weight":
                continue
            name, shard = _map_name(hf_name)
            if name not in params:
                raise ValueError(
                    f"unexpected tensor {hf_name!r} in the checkpoint: it has no place in "
                    f"{self.config.architecture} (tp_size {get_tp_size()}); check the "
                    f"architecture and config.json"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                with torch.no_grad():
                    loader(param, tensor, shard)
            except ValueError as err:
                raise ValueError(f"tensor {hf_name!r}: {err}") from err
            done.add((name, shard))
        missing = sorted(_hf_name(n, s) for n, s in expected - done)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {', '.join(missing)}")


def _map_name(hf_name: str) -> tuple[str, str | int | None]:
    for ckpt, ours, shard in STACKED_PARAMS:
        if ckpt in hf_name:
            return hf_name.replace(ckpt, ours), shard
    return hf_name, None


def _hf_name(name: str, shard: str | int | None) -> str:
    for ckpt, ours, s in STACKED_PARAMS:
        if ours in name and s == shard:
            return name.replace(ours, ckpt)
    return name


def _expected_loads(params: dict[str, nn.Parameter]) -> list[tuple[str, str | int | None]]:
    """Every (parameter, shard) pair a complete checkpoint fills."""
    out: list[tuple[str, str | int | None]] = []
    for name in params:
        shards = [s for _, ours, s in STACKED_PARAMS if ours in name]
        out.extend((name, s) for s in shards or [None])
    return out
