"""The transformers peer of a benchmark: `generate` on a transformers model of the engine's
shape whose parameters are views of the engine's tensors (same random init, no second copy of
the weights), with a static cache (which `generate` compiles on CUDA) where a GPU is present,
plain generate otherwise. Decode tok/s counts the tokens made after the first logits."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specserve.bench.floor import sync


def _hf_config_dict(engine: Any) -> dict[str, Any]:
    from specserve.models.presets import PRESETS

    if engine.model_path is None:
        return dict(PRESETS[engine.model_name])
    with open(os.path.join(engine.model_path, "config.json")) as fh:
        return json.load(fh)


def _shard_rows(model_config: Any) -> dict[object, tuple[int, int]]:
    """Row range of each shard id inside our fused qkv / gate_up tensors."""
    q = model_config.num_heads * model_config.head_dim
    kv = model_config.num_kv_heads * model_config.head_dim
    inter = model_config.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
            0: (0, inter), 1: (inter, 2 * inter)}


def hf_peer_model(engine: Any) -> nn.Module:
    """A transformers model of the engine's architecture whose parameters are views of the
    engine's tensors. Built on the meta device, so no second copy of the weights exists."""
    import transformers

    from specserve.distributed.parallel_state import get_tp_size
    from specserve.models.llama import STACKED_PARAMS

    if get_tp_size() != 1:
        raise ValueError("the transformers comparison needs the whole model: use --tp-size 1")
    if engine.model_config.quantization:
        raise ValueError("the transformers comparison shares dense weights: this model is "
                         "quantized; drop --compare-hf")
    hf = _hf_config_dict(engine)
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"), None)
    model_cls = getattr(transformers, arch, None)
    if config_cls is None or model_cls is None:
        raise ValueError(f"transformers has no {arch}; drop --compare-hf for this model")
    config = config_cls(**{k: v for k, v in hf.items() if k != "architectures"})
    ours = dict(engine.runner.model.named_parameters(remove_duplicate=False))
    rows = _shard_rows(engine.model_config)
    with torch.device("meta"):
        peer = model_cls(config)
    for name, param in list(peer.named_parameters(remove_duplicate=False)):
        src_name, shard = name, None
        for ckpt, fused, shard_id in STACKED_PARAMS:
            if ckpt in name:
                src_name, shard = name.replace(ckpt, fused), shard_id
        if src_name not in ours:
            raise ValueError(f"{arch} parameter {name} has no counterpart here; drop --compare-hf")
        tensor = ours[src_name]
        if shard is not None:
            lo, hi = rows[shard]
            tensor = tensor[lo:hi]  # a row slice of a contiguous tensor: a contiguous view
        assert tensor.shape == param.shape, (name, tensor.shape, param.shape)
        owner, leaf = peer.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
    device = engine.runner.device
    for name, module in list(peer.named_modules()):  # rotary tables: rebuild on the device
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device(device):
                fresh = type(module)(module.config)
            owner = peer.get_submodule(name.rpartition(".")[0])
            setattr(owner, name.rpartition(".")[2], fresh)
    left = [n for n, t in [*peer.named_parameters(), *peer.named_buffers()] if t.is_meta]
    assert not left, f"tensors left on the meta device: {left}"
    peer.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
    return peer.eval()


class _DecodeClock:
    """A logits processor that stamps the time generate first asks for logits: the prefill is
    done and every later forward is a decode step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.start is None:
            sync(self.device)
            self.start = time.perf_counter()
        return scores


@dataclass
class HFResult:
    mode: str
    tok_s: list[float] = field(default_factory=list)  # decode tok/s of each timed run
    token_ids: list[int] = field(default_factory=list)  # greedy output of the last run


@torch.inference_mode()
def measure_hf_generate(peer: nn.Module, prompt: list[int], output_len: int, runs: int,
                        warmup: int) -> HFResult:
    """Greedy batch-1 generate of exactly `output_len` tokens; decode tok/s counts the
    output_len - 1 tokens produced after the first logits (prefill excluded)."""
    from transformers import LogitsProcessorList

    if output_len < 2:
        raise ValueError("--output-len must be >= 2 to time a decode phase")
    device = next(peer.parameters()).device
    static = device.type == "cuda"
    mode = ("transformers generate, static cache (auto-compiled)" if static
            else "transformers generate, dynamic cache, eager (no GPU)")
    ids = torch.tensor([prompt], device=device)
    result = HFResult(mode)
    for i in range(warmup + runs):
        clock = _DecodeClock(device)
        out = peer.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
            do_sample=False, pad_token_id=0,
            cache_implementation="static" if static else None,
            logits_processor=LogitsProcessorList([clock]))
        sync(device)
        elapsed = time.perf_counter() - (clock.start or 0.0)
        if i >= warmup:
            result.tok_s.append((output_len - 1) / elapsed)
        result.token_ids = out[0, len(prompt):].tolist()
    return result
