"""Will the model fit? Checked from the config before any weight is allocated.

The estimate counts the weights (target and draft head, from their shapes) in the engine's
dtype (a quantized target: the bytes of its tensors as built, codes and scales, from a model
built on the meta device), plus the KV cache where its size is fixed up front (the CPU's --kv-cache-bytes; on a
GPU the cache is sized from what the weights leave free). Compared with the memory available
now: MemAvailable on the CPU, free device memory on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from specserve.config import CacheConfig, EngineConfig, ModelConfig

GB = 1e9


def available_bytes(device: torch.device) -> int:
    """Memory that can be allocated now on `device`."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def drafter_configs(config: EngineConfig, model_config: ModelConfig,
                    model_path: str | None) -> list[ModelConfig]:
    """The models of the drafters that config.spec builds itself (an EAGLE-3 head, an MTP
    layer; primary or extra), for the memory check and the KV budget's reserve."""
    drafts = []
    if config.spec.algorithm == "eagle3":
        from specserve.speculative.eagle3 import load_draft_config

        drafts.append(load_draft_config(config.spec, model_config))
    if "mtp" in (config.spec.algorithm, *config.spec.extra_methods):
        from specserve.speculative.mtp import check_mtp_target  # primary or extra drafter

        drafts.append(check_mtp_target(config.spec.for_method("mtp"),
                                       None if config.load_format == "dummy" else model_path,
                                       model_config))
    return drafts


def drafter_bytes(drafts: Sequence[ModelConfig], dtype: torch.dtype, tp_size: int) -> int:
    """Device bytes one rank gives the drafters' weights (unquantized size: an upper bound)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return -(-sum(d.num_parameters() for d in drafts) * elem // tp_size)


SAMPLER_BYTES_PER_LOGIT = 20  # fp32 logits, their sorted copy and int64 order, fp32 probs


def verify_sampling_bytes(rows: int, vocab_size: int) -> int:
    """Device bytes the sampler takes over `rows` verify rows of the full vocabulary (top-k /
    top-p sort them): the largest captured speculative graph's rows (a tree's batch bucket x
    its nodes) can need GBs that the KV pool's budget must leave free."""
    return rows * vocab_size * SAMPLER_BYTES_PER_LOGIT


def required_bytes(
    target: ModelConfig,
    draft: ModelConfig | Sequence[ModelConfig] | None,
    dtype: torch.dtype,
    device: torch.device,
    cache: CacheConfig,
) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes known before loading) for this engine; `draft`: the
    drafters' models (a head, an MTP layer), one or several."""
    elem = torch.empty((), dtype=dtype).element_size()
    drafts = [] if draft is None else [draft] if isinstance(draft, ModelConfig) else list(draft)
    weights = sum(d.num_parameters() for d in drafts) * elem + (
        quantized_weight_bytes(target, dtype) if target.quantization
        else target.num_parameters() * elem)  # fmt: skip
    kv = 0
    if device.type != "cuda":
        if cache.num_pages:
            layers = target.num_layers + sum(d.num_layers for d in drafts)
            per_token = 2 * layers * target.num_kv_heads * target.head_dim * elem
            kv = cache.num_pages * cache.page_size * per_token
        else:
            kv = cache.kv_cache_bytes
    return weights, kv


def quantized_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of a quantized model's tensors as the checkpoint fills them (packed codes, scales,
    unquantized layers in `dtype`), counted on a meta-device build of the whole model."""
    from specserve.models.loader import build_model

    model = build_model(config, dtype, "meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_fits(
    name: str,
    target: ModelConfig,
    draft: ModelConfig | Sequence[ModelConfig] | None,
    dtype: torch.dtype,
    device: torch.device,
    cache: CacheConfig,
    available: int | None = None,
    tp_size: int = 1,
) -> None:
    """ValueError saying what to change when the weights (+ fixed KV cache) exceed the memory
    available on `device`. With tensor parallelism each GPU holds 1/tp_size of the weights;
    on the CPU the ranks share the host's memory (all the weights, a KV cache each)."""
    weights, kv = required_bytes(target, draft, dtype, device, cache)
    if device.type == "cuda":
        weights //= tp_size
    else:
        kv *= tp_size
    free = available_bytes(device) if available is None else available
    if weights + kv <= free:
        return
    where = "GPU memory free" if device.type == "cuda" else "memory available"
    dtype_name = str(dtype).removeprefix("torch.")
    hints = []
    if dtype == torch.float32:
        half = weights // 2
        if half + kv <= free:
            hints.append(f"--dtype bfloat16 ({half / GB:.1f} GB of weights)")
    if device.type == "cuda":
        hints.append("more GPUs (--tensor-parallel-size)")
    hints.append("a smaller model (e.g. --model tiny-llama --load-format dummy)")
    if device.type != "cuda":
        hints.append("a GPU machine")
    raise ValueError(
        f"{name} needs about {weights / GB:.1f} GB for its {dtype_name} weights"
        + (f" + {kv / GB:.2f} GB of KV cache" if kv else "")
        + f", but {free / GB:.1f} GB of {where}; use "
        + ", or ".join(hints)
    )
