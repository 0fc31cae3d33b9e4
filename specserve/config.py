"""Engine configuration: composed, frozen dataclasses.

The model's own configuration (`ModelConfig.from_hf` in `model_config.py`, its MoE / MLA / DSA
parts in `layer_configs.py`) is re-exported here. CLI flags, offline-API keywords and value
checks come from each field's metadata (`config_flags.option`): one source of truth. Building
a config checks it, so a bad value fails before anything loads. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from specserve.config_flags import (
    ConfigError,
    check_fields,
    keyword_aliases,
    option,
    unwrap_optional,
)
from specserve.layer_configs import DSAConfig, MLAConfig, MoEConfig  # noqa: F401 (re-exported)
from specserve.model_config import CONFIG_ADAPTERS, ModelConfig, config_adapter  # noqa: F401
from specserve.spec_config import SpecConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
GENERATION_CONFIG_HELP = ("request sampling defaults: auto = the model's generation_config.json "
                          "(temperature, top_p, top_k, min_p, repetition_penalty); vllm = none "
                          "(neutral defaults); DIR = DIR/generation_config.json")


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
    exact_attention: bool = option(
        False, "batch-invariant attention only (one tile shape and a fixed KV split length for "
        "decode, extend and verify; the GEMMs keep their fastest plans): what --exact costs "
        "and gains for attention alone; --exact implies it")
    cuda_graph_max_bs: int = option(128, "largest decode batch captured in a CUDA graph", min=1)
    cuda_graph_max_tokens: int = option(
        8192, "largest step with prefill chunks captured in CUDA graphs, in tokens (token "
        "buckets up to it, at most the token budget plus the verify nodes; 0: such steps run "
        "eagerly): removes their host time (Llama-8B: 10-40 ms a step); MHA/GQA models",
        min=0)
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
