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
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text."""
    return field(default=default, metadata={"help": help, **kw})


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
    """The normalised view of a model's config.json (llama family, and EAGLE-3 heads)."""

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
        hf = dict(hf)
        if "text_config" in hf and "hidden_size" not in hf:  # wrapper (e.g. vision-language)
            inner = dict(hf["text_config"])
            inner.setdefault("architectures", hf.get("architectures"))
            hf = inner
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // heads
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
            mla=MLAConfig.from_hf(hf),
        )


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = _f(1, "tensor-parallel degree (GPUs per model replica)")


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
