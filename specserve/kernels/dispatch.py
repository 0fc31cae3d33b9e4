"""Triton, imported if installed, and whether its fast paths apply to a tensor."""

from __future__ import annotations

import functools
import importlib.util

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # CPU-only install: kernel modules still import; their references work
    triton = tl = None

    def jit(fn):  # type: ignore[no-redef]
        return fn


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def triton_usable() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def use_triton(*tensors: torch.Tensor) -> bool:
    """CUDA tensors, Triton usable, and no gradient needed (the kernels have no backward:
    a training module built on these layers falls back to torch instead of losing its
    gradient)."""
    if not (tensors[0].is_cuda and triton_usable()):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
