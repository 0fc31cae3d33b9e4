"""specserve: a PyTorch-native LLM inference engine built around EAGLE-3 speculative decoding.

    from specserve import LLM, SamplingParams

The package import is cheap: `LLM` (which brings torch) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from specserve.llm import LLM, GenerationOutput
    from specserve.sampling_params import SamplingParams

_LAZY = {"LLM": "specserve.llm", "GenerationOutput": "specserve.llm",
         "SamplingParams": "specserve.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
