"""Triton, imported if installed, and whether its fast paths apply to a tensor."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # CPU-only install: kernel modules still import; their references work
    triton = tl = None

    def jit(fn=None, **_options):  # type: ignore[no-redef]
        return fn if fn is not None else (lambda f: f)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(n - 1, 0).bit_length()


COMPILE_ONLY_ENV = "SPECSERVE_TRITON_COMPILE_ONLY"


def host_launches() -> bool:
    """Triton launches on host tensors: under the interpreter (TRITON_INTERPRET=1), or in a
    compile-only check (SPECSERVE_TRITON_COMPILE_ONLY=<sm>, tests/triton_compile.py) that builds
    every launch for a GPU architecture without running it."""
    return triton is not None and (
        os.environ.get("TRITON_INTERPRET") == "1" or bool(os.environ.get(COMPILE_ONLY_ENV))
    )


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


# Exact mode (EngineConfig.exact): every kernel whose result for one row could depend on how
# many rows are computed with it picks a launch that does not (fixed tiles, no M-dependent
# split-K, a fixed KV split size). Set once per process by the model runner before any launch.
EXACT_KV_SPLIT_TOKENS = 256  # KV positions per attention split in exact mode


class _ExactMode:
    on: bool = False  # every kernel (EngineConfig.exact)
    attention: bool = False  # attention kernels only (EngineConfig.exact_attention; on implies it)
    kv_split_tokens: int = EXACT_KV_SPLIT_TOKENS
    kv_splits: int = 16


EXACT = _ExactMode()


def set_exact(on: bool, max_positions: int = 4096, max_splits: int = 16,
              attention: bool = False) -> None:
    """Turn exact (batch-invariant) mode on or off for this process; `attention` alone makes
    only the attention kernels invariant (the GEMMs keep their fastest plans). Attention then
    cuts the KV into splits of a fixed length (EXACT_KV_SPLIT_TOKENS, doubled until at most
    max_splits of them cover max_positions) and launches that many splits whatever the batch:
    the split count never depends on sequence lengths (CUDA graphs stay valid)."""
    tokens = EXACT_KV_SPLIT_TOKENS
    while -(-max_positions // tokens) > max_splits:
        tokens *= 2
    EXACT.on = bool(on)
    EXACT.attention = bool(on or attention)
    EXACT.kv_split_tokens = tokens
    EXACT.kv_splits = -(-max_positions // tokens)


def exact_mode() -> bool:
    return EXACT.on
