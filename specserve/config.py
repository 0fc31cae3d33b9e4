"""Engine configuration: composed, frozen dataclasses.

`ModelConfig.from_hf` normalises a Hugging Face config.json once; everything downstream reads
the normalised fields. CLI flags, offline-API keywords and value checks come from each field's
metadata (`config_flags.option`): one source of truth. Building a config checks it, so a bad
value fails before anything loads. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.config_flags import (
    ConfigError,
    check_fields,
    keyword_aliases,
    option,
    unwrap_optional,
)
from specserve.spec_config import SpecConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
GENERATION_CONFIG_HELP = ("request sampling defaults: auto = the model's generation_config.json "
                          "(temperature, top_p, top_k, min_p, repetition_penalty); vllm = none "
                          "(neutral defaults); DIR = DIR/generation_config.json")


def _first(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of `names` present (and not null) in `hf`: one field, several
    spellings (hub config.json vs transformers' saved names)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


MOE_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5+).

    Routing: sigmoid (or softmax) scores; `noaux_tc` adds e_score_correction_bias for the
    selection only; n_group / topk_group restrict the choice to the best groups; weights from
    the unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor.
    """

    num_experts: int  # routed experts
    num_experts_per_tok: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int = 0  # one shared MLP of intermediate_size * num_shared_experts
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    first_k_dense_replace: int = 0  # layers below this one have a dense MLP
    moe_layer_freq: int = 1  # a layer at or past first_k_dense_replace is MoE if i % freq == 0
    # explicit per-layer kinds ("dense" / "sparse"), when a config gives them
    mlp_layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"scoring_func must be 'sigmoid' or 'softmax', got {self.scoring_func!r}"
            )
        if self.topk_method not in MOE_TOPK_METHODS:
            raise ValueError(
                f"topk_method must be one of {MOE_TOPK_METHODS}, got {self.topk_method!r}"
            )
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) "
                f"and 1 <= topk_group ({self.topk_group}) <= n_group"
            )
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError("noaux_tc group scores sum the top 2 experts: need >= 2 per group")
        if not 0 < self.num_experts_per_tok <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be >= 1 and at most the "
                f"experts of the topk_group kept groups ({self.topk_group * per_group})"
            )

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_idx] == "sparse"
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        """The MoE fields of a config.json (hub or transformers-saved spelling); None if the
        model has no routed experts."""
        num_experts = _first(hf, "n_routed_experts", "num_local_experts", "num_experts")
        if not num_experts:
            return None
        method = _first(hf, "topk_method", default="noaux_tc")
        scoring = _first(
            hf, "scoring_func", default="sigmoid" if method == "noaux_tc" else "softmax"
        )
        layer_types = hf.get("mlp_layer_types")
        return cls(
            num_experts=int(num_experts),
            num_experts_per_tok=int(_first(hf, "num_experts_per_tok", "moe_top_k", default=1)),
            intermediate_size=int(_first(hf, "moe_intermediate_size", "intermediate_size")),
            num_shared_experts=int(_first(hf, "n_shared_experts", "num_shared_experts", default=0)),
            n_group=int(_first(hf, "n_group", default=1)),
            topk_group=int(_first(hf, "topk_group", default=1)),
            norm_topk_prob=bool(_first(hf, "norm_topk_prob", default=method == "noaux_tc")),
            routed_scaling_factor=float(_first(hf, "routed_scaling_factor", default=1.0)),
            scoring_func=str(scoring),
            topk_method=str(method),
            first_k_dense_replace=int(_first(hf, "first_k_dense_replace", default=0)),
            moe_layer_freq=int(_first(hf, "moe_layer_freq", default=1)),
            mlp_layer_types=tuple(layer_types) if layer_types else None,
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dims (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, GLM-5).

    Per token: q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None) gives
    every head qk_nope + qk_rope dims; kv_a_proj_with_mqa(x) gives one latent c_kv
    (kv_lora_rank, normed) and one shared rope key k_pe (qk_rope); kv_b_proj maps c_kv to each
    head's k_nope (qk_nope) and v (v_head_dim). See layers/mla.py."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # rope dims stored as interleaved pairs (2i, 2i+1), GPT-J style

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig | None:
        """The MLA fields of a (text) config.json, or None for a model without MLA."""
        if hf.get("kv_lora_rank") is None:
            return None
        q_lora = hf.get("q_lora_rank")
        return cls(
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )


INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): an MLA layer's lightning indexer
    scores every cached token for each query and the attention reads only the top
    `index_topk` of them (layers/dsa.py). A "shared" layer reuses the selection of the
    previous "full" layer instead of running its own indexer (GLM-5.2's indexer_types)."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...] | None = None  # per layer; None: every layer "full"
    rope_interleave: bool = True  # the indexer's rope dims as pairs (2i, 2i+1) (GLM)

    def __post_init__(self) -> None:
        if self.index_topk < 1 or self.index_head_dim < 1 or self.index_n_heads < 1:
            raise ValueError(
                f"index_topk ({self.index_topk}), index_head_dim ({self.index_head_dim}) and "
                f"index_n_heads ({self.index_n_heads}) must be >= 1"
            )
        types = self.indexer_types or ()
        if any(t not in INDEXER_TYPES for t in types) or types[:1] == ("shared",):
            raise ValueError(
                f"indexer_types must be 'full' or 'shared' per layer, the first 'full'; got "
                f"{list(types)}"
            )

    def runs_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types is None or self.indexer_types[layer_idx] == "full"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DSAConfig | None:
        """The DSA fields of a (text) config.json, or None for a model without an indexer."""
        if hf.get("index_topk") is None:
            return None
        types = hf.get("indexer_types")
        return cls(
            index_topk=int(hf["index_topk"]),
            index_head_dim=int(hf["index_head_dim"]),
            index_n_heads=int(hf["index_n_heads"]),
            indexer_types=tuple(types) if types else None,
            rope_interleave=bool(hf.get("indexer_rope_interleave", True)),
        )


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
    # MTP / NextN layers stored after the decoder layers (DeepSeek-V3, GLM: 1; not used yet)
    num_mtp_layers: int = 0

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
            num_mtp_layers=int(_first(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
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
        return self.vocab_size * h + layers + h + head

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


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = option(1, "tensor-parallel degree (GPUs per model replica)", min=1,
                          flags=("-tp", "--tensor-parallel-size", "--tp-size"), metavar="N")
    distributed_backend: str = option(
        "auto", "collectives between TP ranks: auto (nccl on GPUs, gloo on the CPU) | nccl | "
        "gloo", choices=("auto", "nccl", "gloo"))
    step_timeout_s: float = option(
        30.0, "a step running longer than this means a hang (a TP worker, or the server's "
        "engine thread): the engine stops (seconds; 0 = no server watchdog)", min=0.0)

    def __post_init__(self) -> None:
        check_fields(self)


COMM_BACKENDS = ("auto", "nccl", "gloo", "symm-one-shot", "symm-two-shot", "triton-one-shot")


@dataclass(frozen=True)
class CommConfig:
    """Tensor-parallel communication, and the communication-cost emulator."""

    comm_backend: str = option(
        "auto", "all-reduce backend under TP: auto picks the fastest per message size by "
        "measurement at start-up (cached per machine); a named one is used, unmeasured, for "
        "every message its buffers hold (nccl|gloo: the process group's own)",
        choices=COMM_BACKENDS)
    comm_fuse: str = option(
        "auto", "all-reduce fused with the residual add + RMSNorm in one launch: auto (where "
        "measured faster) | on (wherever a backend has the kernel) | off",
        choices=("auto", "on", "off"))
    comm_tune: str = option(
        "auto", "start-up measurement: auto (reuse the cached table, measure missing sizes) | "
        "refresh (measure anew) | off (no measurement: the chosen backend, else nccl/gloo)",
        choices=("auto", "refresh", "off"))
    comm_cache_dir: str = option("", "where measured tables are cached",
                                 help_default="the user cache dir, ~/.cache/specserve/comm")
    emulate_comm: str = option(
        "", "COST-ONLY benchmarking: each all-reduce also costs (TP 1: costs instead) the "
        "latency this table gives for its size, as a GPU busy-wait; a name from "
        "specserve/distributed/comm_tables or a JSON path (bench latency: comma-separated, "
        "one pass per table)", help_default="off")
    emulate_tp: int = option(8, "world size whose latencies the emulated table supplies", min=2)
    emulate_compute: str = option(
        "full", "with --emulate-comm on one GPU: full = the whole model's math (TP 1); "
        "shard = rank 0's shard of a TP --emulate-tp model (its per-GPU compute; outputs are "
        "meaningless)", choices=("full", "shard"))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = option(16, "tokens per KV-cache page", min=1,
                            flags=("--page-size", "--block-size"))
    gpu_memory_utilization: float = option(
        0.90, "fraction of the GPU's free memory (after weights) given to the KV cache",
        above=0.0, max=1.0)
    kv_cache_bytes: int = option(256 << 20, "KV-cache size in bytes when running on the CPU",
                                 min=1)
    num_pages: int = option(0, "fix the number of KV pages (0 = size from the memory budget)",
                            min=0)
    enable_prefix_caching: bool | None = option(
        None, "reuse the KV pages of prefixes computed before (automatic prefix caching; a "
        "draft head's KV is cached with the target's)",
        help_default="on, except with a drafter given as a Python object that names no "
        "prefix_cache_key")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "most requests running at once", min=1)
    max_num_batched_tokens: int = option(2048, "token budget of one forward (chunked prefill)",
                                         min=1)
    max_model_len: int = option(0, "context length (0 = the model's max_position_embeddings)",
                                min=0)
    max_waiting: int = option(1024, "bounded waiting queue; the server answers 429 past it",
                              min=1)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class EngineConfig:
    model: str = option("", "model directory or Hugging Face repo id (local cache only)",
                        metavar="MODEL")
    tokenizer: str = option("", "tokenizer directory", help_default="the model's")
    load_format: str = option(
        "auto", "auto: read the checkpoint; dummy: random weights (cost benchmarks; --model may "
        "then name a preset such as llama-3.1-8b)", choices=("auto", "dummy"))
    dtype: str = option("auto", "weight/activation dtype (half = float16, float = float32); "
                        "auto: float32 on the CPU, the checkpoint's half type on a GPU",
                        choices=DTYPES, cli_choices=(*DTYPES, *DTYPE_ALIASES))
    quantization: str = option(
        "auto", "weight format: auto = what the checkpoint declares (quantization_config or "
        "hf_quant_config.json); fp8 (128x128 blocks, W8A8) | w4a16 (int4, group 128; a preset "
        "may name its own, e.g. kimi-k2-3l: Kimi K2.5's INT4 g32 experts) | nvfp4 "
        "(weight-only) must match the checkpoint, or give --load-format dummy random weights "
        "in that format", choices=("auto", "fp8", "w4a16", "nvfp4"))
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    seed: int = option(0, "engine seed for requests without their own", min=0)
    enforce_eager: bool = option(False, "disable CUDA graphs")
    exact: bool = option(
        False, "batch-invariant kernels: a row's logits do not depend on how many rows or "
        "which requests share its forward, so greedy speculative output equals plain greedy "
        "output token for token (and a request alone equals it batched); costs speed")
    cuda_graph_max_bs: int = option(128, "largest decode batch captured in a CUDA graph", min=1)
    decode_overlap: str = option(
        "auto", "launch the next decode step (or speculative cycle) before the host reads "
        "this one (hides the host's work); auto: on where decode CUDA graphs are captured",
        choices=("auto", "on", "off"))
    cpu_threads: int = option(
        0, "torch threads on the CPU (0 = auto: 1 for small models, whose matmuls are too "
        "small to split, else torch's default)", min=0)
    generation_config: str = option("auto", GENERATION_CONFIG_HELP, metavar="auto|vllm|DIR")
    max_logprobs: int = option(
        20, "most log-probs per token a request may ask for (logprobs, top_logprobs)", min=0)
    chat_template: str = option(
        "", "chat template for chat requests: a Jinja file or the template text itself",
        metavar="FILE|TEMPLATE", help_default="the tokenizer's")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        check_fields(self)
        device = self.device
        if device not in ("auto", "cpu", "cuda") and not (
                device.startswith("cuda:") and device[5:].isdigit()):
            raise ConfigError(EngineConfig, "device", f"must be auto, cpu, cuda or cuda:N; "
                              f"got {device!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        """Return a copy with fields changed; nested configs accept dicts of changes."""
        out = {}
        for key, value in changes.items():
            current = getattr(self, key)
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                value = dataclasses.replace(current, **value)
            out[key] = value
        return dataclasses.replace(self, **out)


# keyword (a field name, or a long flag spelled with underscores) -> (nested config, field)
ENGINE_KEYWORDS: dict[str, tuple[str | None, str]] = {
    **{k: (None, v) for k, v in keyword_aliases(EngineConfig).items()},
    **{k: (name, v) for name, cls in (("parallel", ParallelConfig), ("cache", CacheConfig),
                                      ("scheduler", SchedulerConfig))
       for k, v in keyword_aliases(cls).items()},
}


def engine_config(base: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from keywords: EngineConfig fields, the leaf fields of the nested configs
    by name or flag spelling (`page_size=32`, `tensor_parallel_size=1`), or nested configs
    (`cache=CacheConfig(...)` or a dict of changes). Unknown keywords raise TypeError."""
    base = base or EngineConfig()
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        if key in ("parallel", "cache", "scheduler", "spec", "comm"):
            top[key] = value
        elif key not in ENGINE_KEYWORDS:
            raise TypeError(f"unknown engine option {key!r}; see specserve.config.EngineConfig")
        else:
            group, name = ENGINE_KEYWORDS[key]
            if group is None:
                top[name] = value
            else:
                nested.setdefault(group, {})[name] = value
    config = base.replace(**top)
    return config.replace(**nested) if nested else config


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    """Plain JSON-able dict of an EngineConfig (nested configs as dicts)."""
    return dataclasses.asdict(config)


def config_from_dict(values: dict[str, Any], cls: type = EngineConfig) -> Any:
    """Inverse of `config_to_dict`; unknown keys are an error naming them."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for name, value in values.items():
        tp = unwrap_optional(hints[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = config_from_dict(value, tp)
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return cls(**out)
