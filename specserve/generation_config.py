"""Request sampling defaults from a model's generation_config.json (`--generation-config`).

As in vLLM: `auto` reads the model directory's file, `vllm` uses none (neutral defaults), any
other value is a directory holding one. The sampling fields it sets become the defaults of
requests that leave them out (server) or that pass no SamplingParams (offline API); all of
SAMPLING_KEYS are applied (repetition_penalty by layers/logits_processor.py). A key the
sampler could not apply would be kept in `unapplied` and reported at start-up, never dropped
without a word. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from specserve.sampling_params import SamplingParams

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    source: str  # the file read, or why none was
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields it sets
    unapplied: dict[str, Any] = field(default_factory=dict)  # set, but no sampler support yet

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with these defaults under `overrides` (None values left out)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return SamplingParams(**{**self.params, **given})

    def describe(self) -> str:
        if not self.params and not self.unapplied:
            sets_none = " sets none" if self.source.endswith(FILE) else ""
            return f"sampling defaults: neutral ({self.source}{sets_none})"
        text = f"sampling defaults from {self.source}: " + (
            ", ".join(f"{k}={v}" for k, v in self.params.items()) or "none"
        )
        if self.unapplied:
            text += "; NOT applied (no sampler support yet): " + ", ".join(
                f"{k}={v}" for k, v in self.unapplied.items()
            )
        return text


def generation_config_file(value: str, model_path: str | None) -> str | None:
    """The generation_config.json that `value` (auto | vllm | DIR) names; None for none.
    ValueError when a directory was named that holds no such file."""
    if value == "vllm":
        return None
    if value == "auto":
        if model_path is None or not os.path.isdir(model_path):
            return None
        path = os.path.join(model_path, FILE)
        return path if os.path.isfile(path) else None
    path = os.path.join(value, FILE) if os.path.isdir(value) else value
    if not os.path.isfile(path):
        raise ValueError(f"{value!r} is neither auto, vllm, nor a directory holding {FILE}")
    return path


def load_generation_defaults(value: str, model_path: str | None) -> GenerationDefaults:
    """The sampling defaults `value` selects; ValueError for an unreadable or invalid file."""
    path = generation_config_file(value, model_path)
    if path is None:
        why = "--generation-config vllm" if value == "vllm" else f"no {FILE} beside the model"
        return GenerationDefaults(why)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    supported = {f.name for f in dataclasses.fields(SamplingParams)}
    params, unapplied = {}, {}
    for key in SAMPLING_KEYS:
        if data.get(key) is None:
            continue
        value_ = data[key]
        if key == "top_k" and value_ == 0:
            value_ = -1  # transformers' "off"
        if key in supported:
            params[key] = value_
        elif value_ != NEUTRAL[key]:
            unapplied[key] = value_
    try:
        SamplingParams(**params)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return GenerationDefaults(path, params, unapplied)
