"""Engine configuration: composed, frozen dataclasses.

`ModelConfig.from_hf` normalises a Hugging Face config.json once; everything downstream reads
the normalised fields. CLI flags are generated from the dataclass fields (`add_cli_args` /
`from_cli_args`), with the help text in each field's metadata: one source of truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text."""
    return field(default=default, metadata={"help": help, **kw})


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
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # EAGLE-3 head fields (None for ordinary models)
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    # capture convention: residual stream ENTERING these target decoder layers (0-based)
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    # local attention window (Mistral v0.1); None = full attention
    sliding_window: int | None = None
    # multi-head latent attention dims; None = MHA/GQA attention
    mla: MLAConfig | None = None
    # routed experts (DeepSeek-V2/V3, Kimi K2); None = dense MLPs
    moe: MoEConfig | None = None
    # MTP / NextN layers stored after the decoder layers (DeepSeek-V3: 1; not used yet)
    num_mtp_layers: int = 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike) -> ModelConfig:
        """Build from a config.json dict, a file path, or a model directory."""
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"no config.json at {path}: pass a model directory holding one")
            with open(path) as fh:
                hf = json.load(fh)
        hf = config_adapter((hf.get("architectures") or [""])[0])(dict(hf))
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
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = kind
            for spelling in ("type", "rope_theta"):  # one spelling of the kind; theta apart
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
            qk_norm=arch.startswith("Qwen3"),
            hidden_act=str(hf.get("hidden_act", "silu")),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            draft_vocab_size=hf.get("draft_vocab_size"),
            target_hidden_size=hf.get("target_hidden_size"),
            aux_layer_ids=tuple(aux) if aux else None,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True)
            else None,
            mla=mla,
            moe=MoEConfig.from_hf(hf),
            num_mtp_layers=int(_first(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
        )


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


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = _f(1, "tensor-parallel degree (GPUs per model replica)")
    distributed_backend: str = _f(
        "auto", "collectives between TP ranks: auto (nccl on GPUs, gloo on the CPU) | nccl | "
        "gloo", choices=("auto", "nccl", "gloo"))
    step_timeout_s: float = _f(
        30.0, "a step running longer than this means a hang (a TP worker, or the server's "
        "engine thread): the engine stops (seconds; 0 = no server watchdog)")


COMM_BACKENDS = ("auto", "nccl", "gloo", "symm-one-shot", "symm-two-shot", "triton-one-shot")


@dataclass(frozen=True)
class CommConfig:
    """Tensor-parallel communication, and the communication-cost emulator."""

    comm_backend: str = _f(
        "auto", "all-reduce backend under TP: auto picks the fastest per message size by "
        "measurement at start-up (cached per machine); a named one is used, unmeasured, for "
        "every message its buffers hold (nccl|gloo: the process group's own)",
        choices=COMM_BACKENDS)
    comm_fuse: str = _f(
        "auto", "all-reduce fused with the residual add + RMSNorm in one launch: auto (where "
        "measured faster) | on (wherever a backend has the kernel) | off",
        choices=("auto", "on", "off"))
    comm_tune: str = _f(
        "auto", "start-up measurement: auto (reuse the cached table, measure missing sizes) | "
        "refresh (measure anew) | off (no measurement: the chosen backend, else nccl/gloo)",
        choices=("auto", "refresh", "off"))
    comm_cache_dir: str = _f("", "where measured tables are cached (default: the user cache "
                                 "dir, ~/.cache/specserve/comm)")
    emulate_comm: str = _f(
        "", "COST-ONLY benchmarking: each all-reduce also costs (TP 1: costs instead) the "
        "latency this table gives for its size, as a GPU busy-wait; a name from "
        "specserve/distributed/comm_tables or a JSON path (bench latency: comma-separated, "
        "one pass per table)")
    emulate_tp: int = _f(8, "world size whose latencies the emulated table supplies")
    emulate_compute: str = _f(
        "full", "with --emulate-comm on one GPU: full = the whole model's math (TP 1); "
        "shard = rank 0's shard of a TP --emulate-tp model (its per-GPU compute; outputs are "
        "meaningless)", choices=("full", "shard"))


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = _f(16, "tokens per KV-cache page")
    gpu_memory_utilization: float = _f(
        0.90, "fraction of the GPU's free memory (after weights) given to the KV cache"
    )
    kv_cache_bytes: int = _f(
        256 << 20, "KV-cache size in bytes when running on the CPU"
    )
    num_pages: int = _f(0, "fix the number of KV pages (0 = size from the memory budget)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(128, "most requests running at once")
    max_num_batched_tokens: int = _f(2048, "token budget of one forward (chunked prefill)")
    max_model_len: int = _f(0, "context length (0 = the model's max_position_embeddings)")
    max_waiting: int = _f(1024, "bounded waiting queue; the server answers 429 past it")


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = _f("none", "speculative decoding: none | eagle3", choices=("none", "eagle3"))
    draft_model: str = _f("", "EAGLE-3 draft head directory ('dummy': a random head)")
    num_steps: int = _f(3, "draft forwards per cycle (tree depth)")
    topk: int = _f(1, "branching factor: 1 = chain, >1 = EAGLE-2 dynamic tree")
    num_draft_tokens: int = _f(0, "tokens verified per cycle incl. the root (0 = num_steps+1)")
    synthetic_accept_len: int = _f(
        0, "COST-ONLY benchmarking: force this accept length (0 = real verification)"
    )

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def verify_tokens(self) -> int:
        """Tokens run through the target per cycle, the root included."""
        if self.num_draft_tokens:
            return self.num_draft_tokens
        return self.num_steps + 1


@dataclass(frozen=True)
class EngineConfig:
    model: str = _f("", "model directory or Hugging Face repo id (local cache only)")
    tokenizer: str = _f("", "tokenizer directory (default: the model's)")
    load_format: str = _f(
        "auto", "auto: read the checkpoint; dummy: random weights (cost benchmarks; --model may "
        "then name a preset such as llama-3.1-8b)", choices=("auto", "dummy"))
    dtype: str = _f("auto", "weight/activation dtype", choices=DTYPES)
    device: str = _f("auto", "auto | cpu | cuda")
    seed: int = _f(0, "engine seed for requests without their own")
    enforce_eager: bool = _f(False, "disable CUDA graphs")
    cuda_graph_max_bs: int = _f(128, "largest decode batch captured in a CUDA graph")
    decode_overlap: str = _f(
        "auto", "launch the next decode step (or speculative cycle) before the host reads "
        "this one (hides the host's work); auto: on where decode CUDA graphs are captured",
        choices=("auto", "on", "off"))
    cpu_threads: int = _f(
        0, "torch threads on the CPU (0 = auto: 1 for small models, whose matmuls are too "
        "small to split, else torch's default)")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def replace(self, **changes: Any) -> EngineConfig:
        """Return a copy with fields changed; nested configs accept dicts of changes."""
        out = {}
        for key, value in changes.items():
            current = getattr(self, key)
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                value = dataclasses.replace(current, **value)
            out[key] = value
        return dataclasses.replace(self, **out)


# ---------------------------------------------------------------------------------------------
# CLI flags generated from the fields


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _flag(prefix: str, name: str) -> str:
    return "--" + (f"{prefix}-{name}" if prefix else name).replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser, cls: type = EngineConfig, prefix: str = "",
                 skip: tuple[str, ...] = ()) -> None:
    """Add one flag per leaf field of `cls` (nested configs get their own flags).

    Nested fields are flattened without a prefix except for `spec` (`--spec-num-steps`), so the
    common flags read naturally (`--page-size`, `--tp-size`).
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_cli_args(parser, tp, "spec" if f.name == "spec" else prefix, skip)
            continue
        flag = _flag(prefix, f.name)
        help_text = f.metadata.get("help", "")
        default = f.default
        if tp is bool:
            parser.add_argument(flag, dest=flag[2:].replace("-", "_"),
                                action=argparse.BooleanOptionalAction, default=None,
                                help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(flag, dest=flag[2:].replace("-", "_"), type=tp, default=None,
                                choices=f.metadata.get("choices"),
                                help=f"{help_text} (default: {default!r})")


def config_from_cli_args(args: argparse.Namespace, cls: type = EngineConfig, prefix: str = "",
                         base: Any = None) -> Any:
    """Inverse of `add_cli_args`: flags left unset keep the dataclass (or `base`) default."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub_base = getattr(base, f.name) if base is not None else None
            values[f.name] = config_from_cli_args(
                args, tp, "spec" if f.name == "spec" else prefix, sub_base)
            continue
        value = getattr(args, _flag(prefix, f.name)[2:].replace("-", "_"), None)
        if value is not None:
            values[f.name] = value
    if base is not None:
        return dataclasses.replace(base, **values)
    return cls(**values)


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
        tp = _unwrap_optional(hints[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = config_from_dict(value, tp)
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return cls(**out)
