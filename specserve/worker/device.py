"""Where and in what precision the engine runs: device and dtype resolution, and the fastest
attention backend usable on that device (with the reason when it falls back)."""

from __future__ import annotations

import logging

import torch

from specserve.config import ModelConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto': float32 on the CPU; on a GPU the checkpoint's half dtype (bf16 for fp32 ones)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model_config.torch_dtype == "float16" else torch.bfloat16


def select_backend(device: torch.device) -> object:
    """The fastest attention backend usable here; the torch reference otherwise (reason logged)."""
    from specserve.layers.backends.torch_ref import TorchRefBackend

    if device.type == "cuda":
        try:
            from specserve.layers.backends.triton_backend import TritonBackend, available

            ok, reason = available()
        except ImportError as exc:  # pragma: no cover - depends on the install
            ok, reason = False, f"triton backend not importable: {exc}"
        if ok:
            return TritonBackend()
        log.warning("GPU attention kernels unavailable (%s); using the torch reference", reason)
    return TorchRefBackend()
