"""EAGLE-3 draft head: one decoder layer over [embedding ; fused target features].

    g      = fc(concat(low, mid, high))                 # [T, 3*Ht] -> [T, H]; first step only
    x      = concat(input_layernorm(embed(tok)), hidden_norm(g))      # [T, 2H], embedding first
    r      = g + o_proj(attn(x))                        # residual is the un-normed g
    out    = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out))                         # over the draft vocabulary Vd
    next step: g := out (fc skipped)

The feature at position t is paired with the embedding of token t+1 and predicts token t+2; the
head keeps its own KV cache over the context (an extra layer of the engine's paged pool).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import get_tp_size
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.activation import SiluAndMul
from specserve.layers.attention import Attention
from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from specserve.layers.norm import RMSNorm
from specserve.layers.quantization.base import CODE_DTYPES
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.capture import find_embedding_and_head


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(2 * h, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, h)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.head_dim = cfg.head_dim
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim,
                              cfg.head_dim**-0.5, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(h, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, h)
        self.act = SiluAndMul()

    def forward(self, positions: torch.Tensor, emb: torch.Tensor,
                g: torch.Tensor) -> torch.Tensor:
        # emb, g: [T, H] -> out [T, H] (pre-norm; fed back as the next step's g)
        normed_g = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(emb), normed_g], dim=-1)  # [T, 2H]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = q.shape[0]
        q = q.view(t, -1, self.head_dim)
        k = k.view(t, -1, self.head_dim)
        a = self.o_proj(self.attn(q, k, v.view(t, -1, self.head_dim), positions,
                                  self.rotary).reshape(t, -1))
        r = (normed_g if self.norm_before_residual else g) + a
        return r + self.down_proj(self.act(self.gate_up_proj(self.post_attention_layernorm(r))))


def eagle3_kv_specs(cfg: ModelConfig) -> list[KVCacheSpec]:
    """The KV layers an Eagle3Head of this config adds to the engine's pool: its one decoder
    layer (MHA/GQA, kv heads local to this TP rank), whatever the target's attention kind."""
    kv_heads = divide(cfg.num_kv_heads, get_tp_size(), "num_kv_heads")
    return [KVCacheSpec.mha(kv_heads, cfg.head_dim)]


class Eagle3Head(nn.Module):
    """The draft model. `embed_tokens` and (without a draft vocabulary) `lm_head` may be the
    target's own modules, shared by reference."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, layer_idx: int,
                 target_embed: VocabParallelEmbedding | None,
                 target_lm_head: ParallelLMHead | None, own_embed: bool = False,
                 fc_bias: bool = False) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = ReplicatedLinear(3 * target_hidden, h, bias=fc_bias)
        self.midlayer = Eagle3Layer(cfg, layer_idx)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.draft_vocab_size = cfg.draft_vocab_size or cfg.vocab_size
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h)
        else:
            assert target_embed is not None
        # the target's modules, kept out of this module's parameters (never loaded or cast here)
        self._shared = {"embed": target_embed, "lm_head": target_lm_head}
        if cfg.draft_vocab_size:
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h)
        else:
            assert target_lm_head is not None
        # target_id = draft_id + d2t[draft_id]; zeros when the draft vocabulary is the target's
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(input_ids)
        return self._shared["embed"](input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                g: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; g [T, 3*Ht] (target features: fc applied) or [T, H]
        (the previous draft step's output). Returns out [T, H]."""
        if g.shape[-1] == self.fc.weight.shape[1]:  # target features: fuse low/mid/high
            g = self.fc(g)
        return self.midlayer(positions, self.embed(input_ids), g)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        # [n, H] -> [n, Vd] float32 over the draft vocabulary
        head = self.lm_head if hasattr(self, "lm_head") else self._shared["lm_head"]
        return head.compute_logits(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# -- loading the public formats -------------------------------------------------------------

_RENAMES = {
    "self_attn.o_proj.": "o_proj.",
    "mlp.down_proj.": "down_proj.",
}
_STACKED = {  # checkpoint sub-name -> (our parameter, shard id)
    "self_attn.q_proj.": ("qkv_proj.", "q"),
    "self_attn.k_proj.": ("qkv_proj.", "k"),
    "self_attn.v_proj.": ("qkv_proj.", "v"),
    "mlp.gate_proj.": ("gate_up_proj.", 0),
    "mlp.up_proj.": ("gate_up_proj.", 1),
}


def _normalise_name(name: str) -> str | None:
    """Map official (`midlayer.*`) and speculators (`layers.0.*`) names onto ours."""
    for prefix in ("model.", "draft_model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    elif name.startswith("layers.") or name.startswith("midlayer.") and name.split(".")[1].isdigit():
        layer = name.split(".")[1]
        if layer != "0":
            raise ValueError(f"multi-layer EAGLE-3 heads are not supported (found {name})")
        name = "midlayer." + name.split(".", 2)[2]
    if name == "t2d":  # membership mask, used only in training
        return None
    return name


def load_eagle3_head(path: str, target: nn.Module, target_cfg: ModelConfig, layer_idx: int,
                     dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """Load an EAGLE-3 head directory (safetensors or pytorch_model.bin) for `target`."""
    from specserve.models.loader import iter_weights

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in the draft model directory {path}")
    # the head is dense: a quantization_config copied from the target does not apply to it
    cfg = dataclasses.replace(ModelConfig.from_hf(path), quantization=None)
    ht = target_cfg.hidden_size
    weights = {}
    for name, tensor in iter_weights(path):
        key = _normalise_name(name)
        if key is not None:
            weights[key] = tensor
    quantized = [n for n, t in weights.items() if t.dtype in CODE_DTYPES]
    if quantized:
        raise ValueError(
            f"the EAGLE-3 head at {path} stores quantized tensors ({quantized[0]}: "
            f"{weights[quantized[0]].dtype}); draft heads run dense: use a bf16/fp32 head")
    if "fc.weight" not in weights:
        raise ValueError(f"{path} has no fc.weight: it is not an EAGLE-3 head")
    fc_in = weights["fc.weight"].shape[1]
    if fc_in != 3 * ht:
        raise ValueError(
            f"EAGLE-3 head fc takes {fc_in} features but the target's hidden size is {ht} "
            f"(expected 3 x {ht} = {3 * ht}): this head was trained for another target")
    own_embed = "embed_tokens.weight" in weights
    if cfg.hidden_size != ht and not own_embed:
        raise ValueError(
            f"draft hidden size {cfg.hidden_size} differs from the target's {ht} and the head "
            "carries no embed_tokens: it cannot share the target's embedding")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft vocabulary size {cfg.vocab_size} differs from the target's "
                         f"{target_cfg.vocab_size}: the head belongs to another tokenizer")
    if cfg.draft_vocab_size is None and "lm_head.weight" in weights:
        rows = weights["lm_head.weight"].shape[0]
        if rows != target_cfg.vocab_size:
            cfg = _with_draft_vocab(cfg, rows)
    embed, lm_head = find_embedding_and_head(target)
    with torch.device(device):
        head = Eagle3Head(cfg, ht, layer_idx, embed, lm_head, own_embed,
                          fc_bias="fc.bias" in weights)
    head.to(dtype)
    _load_head_weights(head, weights, path)
    return head.eval()


def _with_draft_vocab(cfg: ModelConfig, rows: int) -> ModelConfig:
    return dataclasses.replace(cfg, draft_vocab_size=rows)


def _load_head_weights(head: Eagle3Head, weights: dict[str, torch.Tensor], path: str) -> None:
    params = dict(head.named_parameters())
    params.update({"d2t": head.d2t})
    loaded = set()
    for name, tensor in weights.items():
        target_name, shard = name, None
        for old, (new, sid) in _STACKED.items():
            if old in name:
                target_name, shard = name.replace(old, new), sid
        for old, new in _RENAMES.items():
            target_name = target_name.replace(old, new)
        if name == "d2t":
            if tensor.shape != head.d2t.shape:
                raise ValueError(f"d2t has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(head.d2t.shape)} (draft_vocab_size)")
            head.d2t.copy_(tensor.long())
            loaded.add("d2t")
            continue
        if target_name not in params:
            if name == "embed_tokens.weight" or name == "lm_head.weight" and not hasattr(
                    head, "lm_head"):
                continue
            raise ValueError(f"unexpected tensor {name!r} in the EAGLE-3 head at {path}")
        param = params[target_name]
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        if loader is None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target_name)
    if not head.config.draft_vocab_size:
        loaded.add("d2t")  # the identity map: the draft vocabulary is the target's
    missing = [n for n in params if n not in loaded and "rotary" not in n]
    if missing:
        raise ValueError(f"the EAGLE-3 head at {path} lacks tensors: {', '.join(missing)}")
