"""Whether the Triton fast paths apply to a tensor (a CUDA tensor and a usable Triton)."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_usable() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_usable()
