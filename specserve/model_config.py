"""Model configuration: a Hugging Face config.json normalised once (`ModelConfig.from_hf`),
with the nested MoE / MLA / DSA fields read in either spelling (hub config.json or
transformers-saved), and the per-architecture config adapters (a wrapper served text-only
hands over its text_config). Everything downstream reads the normalised fields. Imports no
torch; `specserve.config` re-exports these names beside the engine options.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.layer_configs import DSAConfig, MLAConfig, MoEConfig, hf_field


@dataclass(frozen=True)
class ModelConfig:
    """The normalised view of a model's config.json (llama family, DeepSeek-V2/V3 family with
    nested MLA and MoE fields, EAGLE-3 heads)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, GLM-4.5)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, GLM-4.5 355B)
    # RoPE rotates the first head_dim * partial_rotary_factor dims of each head (GLM-4.5: 0.5)
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # EAGLE-3 head fields (None for ordinary models)
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    # capture convention: residual stream ENTERING these target decoder layers (0-based)
    aux_layer_ids: tuple[int, ...] | None = None
    # what a head's aux_layer_ids mean as written in its config: "input" (as above) or
    # "output" (leaving layer i; SpecForge-style exports)
    aux_layer_convention: str = "input"
    norm_before_residual: bool = False
    # local attention window (Mistral v0.1); None = full attention
    sliding_window: int | None = None
    # multi-head latent attention dims; None = MHA/GQA attention
    mla: MLAConfig | None = None
    # the checkpoint's quantization: config.json `quantization_config`, or ModelOpt's
    # hf_quant_config.json (tagged {"quant_method": "modelopt", ...}); None = unquantized.
    # Parsed by specserve.layers.quantization; an EAGLE-3 head never inherits it.
    quantization: dict | None = field(default=None, hash=False, compare=False)
    # DeepSeek sparse attention over the MLA layers (GLM-5); None = dense attention
    dsa: DSAConfig | None = None
    # routed experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5+); None = dense MLPs
    moe: MoEConfig | None = None
    # MTP / NextN layers stored after the decoder layers (DeepSeek-V3, GLM: 1; the MTP drafter)
    num_mtp_layers: int = 0
    # parameters beside the decoder stack (an MTP block's eh_proj and input norms), counted by
    # num_parameters
    extra_parameters: int = 0

    def __post_init__(self) -> None:
        for field_name, kinds in (
            ("mlp_layer_types", self.moe and self.moe.mlp_layer_types),
            ("indexer_types", self.dsa and self.dsa.indexer_types),
        ):
            if kinds and len(kinds) != self.num_layers:
                raise ValueError(
                    f"{field_name} has {len(kinds)} entries for {self.num_layers} layers "
                    "(num_hidden_layers): give one per layer"
                )

    @property
    def rotary_dim(self) -> int:
        """The rotating dims of each head (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike) -> ModelConfig:
        """Build from a config.json dict, a file path, or a model directory."""
        quant_file = None
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                quant_file = os.path.join(path, "hf_quant_config.json")
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"no config.json at {path}: pass a model directory holding one")
            with open(path) as fh:
                hf = json.load(fh)
        hf = dict(hf)
        quantization = _read_quantization(hf, quant_file)
        hf = config_adapter((hf.get("architectures") or [""])[0])(hf)
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        mla = MLAConfig.from_hf(hf)
        # MLA: the q/k head dim (transformers saves head_dim = qk_rope_head_dim)
        head_dim = mla.qk_head_dim if mla else hf.get("head_dim") or hidden // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        eagle = hf.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        rope_scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 spelling
        rope_theta = hf.get("rope_theta")
        partial = hf.get("partial_rotary_factor")  # top level (hub) or in rope_parameters
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            partial = partial or rope_params.get("partial_rotary_factor")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = kind
            # one spelling of the kind; theta and the partial factor apart
            for spelling in ("type", "rope_theta", "partial_rotary_factor"):
                rope_scaling.pop(spelling, None)
            if kind == "default":
                rope_scaling = None
        arch = archs[0]
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3") or bool(hf.get("use_qk_norm", False)),
            partial_rotary_factor=float(partial or 1.0),
            hidden_act=str(hf.get("hidden_act", "silu")),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            draft_vocab_size=hf.get("draft_vocab_size"),
            target_hidden_size=hf.get("target_hidden_size"),
            aux_layer_ids=tuple(aux) if aux else None,
            aux_layer_convention=str(eagle.get("aux_layer_convention", "input")),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True)
            else None,
            mla=mla,
            quantization=quantization,
            dsa=DSAConfig.from_hf(hf),
            moe=MoEConfig.from_hf(hf),
            num_mtp_layers=int(hf_field(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
        )

    def num_parameters(self) -> int:
        """Parameters of a decoder-only model of this shape: embeddings, decoder layers
        (attention with its optional biases / q-k norms, or MLA's latent projections and a DSA
        indexer; a gated
        MLP, or a MoE block's router, routed and shared experts; two norms), final norm and LM
        head (unless tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias
        attn += 2 * self.head_dim * self.qk_norm
        if self.mla is not None:  # projections through the latents (biases left out)
            m, heads = self.mla, self.num_heads
            q_out = heads * m.qk_head_dim
            attn = h * q_out if m.q_lora_rank is None else (
                m.q_lora_rank * (h + 1 + q_out))
            attn += (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                     + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
                     + heads * m.v_head_dim * h)
        layers = self.num_layers * (attn + 2 * h)
        if self.dsa is not None and self.mla is not None:  # the indexers of the full layers
            d, q_lora = self.dsa, self.mla.q_lora_rank or 0
            per = q_lora * d.index_n_heads * d.index_head_dim + h * (d.index_head_dim
                                                                     + d.index_n_heads)
            layers += self.dsa_index_layers * (per + 2 * d.index_head_dim)  # + k_norm
        moe = self.moe
        for i in range(self.num_layers):
            if moe is None or not moe.is_moe_layer(i):
                layers += 3 * h * self.intermediate_size
                continue
            router = moe.num_experts * h + moe.num_experts * (moe.topk_method == "noaux_tc")
            experts = (moe.num_experts + moe.num_shared_experts) * 3 * h * moe.intermediate_size
            layers += router + experts
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + head + self.extra_parameters

    @property
    def dsa_index_layers(self) -> int:
        """Layers that run a DSA indexer (and cache its keys)."""
        if self.dsa is None:
            return 0
        return sum(self.dsa.runs_indexer(i) for i in range(self.num_layers))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every decoder layer for one token (MLA: the latent and rope key; DSA:
        plus the indexer's key)."""
        if self.mla is not None:
            latent = self.num_layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
            index = self.dsa_index_layers * (self.dsa.index_head_dim if self.dsa else 0)
            return (latent + index) * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Config adapters: an architecture's config.json -> the flat text-model config `from_hf` reads.

def _unwrap_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A wrapper (vision-language) config: its text_config, under the text model's own
    architecture when it names one (the wrapper's weights are then its text model's)."""
    if "text_config" not in hf or "hidden_size" in hf:
        return hf
    inner = dict(hf["text_config"])
    inner.setdefault("architectures", hf.get("architectures"))
    return inner


def _wrapped_text_model(hf: dict[str, Any]) -> dict[str, Any]:
    """A wrapper served text-only by its own model class (which maps the wrapper's weight
    names): the text_config, under the WRAPPER's architecture; token ids and tying fall back
    to the wrapper's fields."""
    if "text_config" not in hf:
        raise ValueError(
            f"{hf.get('architectures')}: config.json has no text_config; expected the "
            "language model's config nested under text_config"
        )
    inner = dict(hf["text_config"])
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if inner.get(key) is None and hf.get(key) is not None:
            inner[key] = hf[key]
    inner["architectures"] = hf["architectures"]
    return inner


CONFIG_ADAPTERS = {
    "KimiK25ForConditionalGeneration": _wrapped_text_model,
    "Kimi_K25ForConditionalGeneration": _wrapped_text_model,  # transformers' spelling
}


def config_adapter(architecture: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The adapter of `architecture` (default: unwrap any text_config)."""
    return CONFIG_ADAPTERS.get(architecture, _unwrap_text_config)


def _read_quantization(hf: dict[str, Any], quant_file: str | None) -> dict | None:
    """config.json's quantization_config (also a wrapper's, e.g. a vision-language model's
    top level), else ModelOpt's hf_quant_config.json beside it."""
    inline = hf.get("quantization_config") or (hf.get("text_config") or {}).get(
        "quantization_config")
    if inline:
        return dict(inline)
    if quant_file and os.path.isfile(quant_file):
        with open(quant_file) as fh:
            data = json.load(fh)
        return {"quant_method": "modelopt", **dict(data.get("quantization") or {}),
                "producer": data.get("producer")}
    return None
