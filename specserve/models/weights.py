"""Checkpoint tensors into a model's parameters: name mapping, shard ids, completeness.

Each checkpoint tensor maps to one or more (parameter, shard id) targets:
    routed experts   `...experts.E.gate_proj.X` -> (`...experts.w13_X`, (E, "gate")) for the
                     weight and any scale or packed tensor of a quantized format,
                     via layers.moe.expert_shards (stacked spellings too)
    stacked          a fragment of `stacked`, e.g. `.q_proj.` -> (`.qkv_proj.`, "q")
    otherwise        the parameter of the same name, no shard id
and is copied by the parameter's `weight_loader`. Every (parameter, shard) pair a complete
checkpoint fills must be filled: a parameter lists its pairs in `shard_ids` (routed
experts), else they follow from `stacked`, else it is one unsharded tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.distributed.parallel_state import get_tp_size
from specserve.layers.linear import default_weight_loader
from specserve.layers.moe import expert_shards

Shard = int | str | tuple[int, str] | None
# (checkpoint name fragment, our fused parameter fragment, shard id)
Stacked = tuple[tuple[str, str, int | str], ...]
MAX_LISTED = 12  # missing tensors named in the error, the rest counted


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: Stacked,
    architecture: str, skip: Callable[[str], bool] | None = None,
) -> None:  # fmt: skip
    """Load (checkpoint name, tensor) pairs into `model`; `skip(name)` drops a tensor."""
    params = dict(model.named_parameters())  # tied weights appear once
    expected = {(n, s) for n, p in params.items() for s in _shard_ids(n, p, stacked)}
    done: set[tuple[str, Shard]] = set()
    for hf_name, tensor in weights:
        if "rotary_emb.inv_freq" in hf_name or (skip is not None and skip(hf_name)):
            continue
        for name, shard, part in _targets(hf_name, tensor, stacked):
            if name not in params:
                raise ValueError(
                    f"unexpected tensor {hf_name!r} in the checkpoint: it has no place in "
                    f"{architecture} (tp_size {get_tp_size()}); check the architecture and "
                    f"config.json"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                with torch.no_grad():
                    loader(param, part, shard)
            except ValueError as err:
                raise ValueError(f"tensor {hf_name!r}: {err}") from err
            done.add((name, shard))
    missing = sorted(_hf_name(n, s, stacked) for n, s in expected - done)
    if missing:
        more = f" (and {len(missing) - MAX_LISTED} more)" if len(missing) > MAX_LISTED else ""
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:MAX_LISTED])}{more}")


def _targets(
    hf_name: str, tensor: torch.Tensor, stacked: Stacked
) -> list[tuple[str, Shard, torch.Tensor]]:
    experts = expert_shards(hf_name, tensor)
    if experts is not None:
        return list(experts)
    for ckpt, ours, shard in stacked:
        if ckpt in hf_name:
            return [(hf_name.replace(ckpt, ours), shard, tensor)]
    return [(hf_name, None, tensor)]


def _shard_ids(name: str, param: nn.Parameter, stacked: Stacked) -> list[Shard]:
    if hasattr(param, "shard_ids"):
        return list(param.shard_ids)
    return [s for _, ours, s in stacked if ours in name] or [None]


def _hf_name(name: str, shard: Shard, stacked: Stacked) -> str:
    """The checkpoint name that fills (parameter, shard)."""
    if isinstance(shard, tuple):  # routed expert: experts.w13_SUFFIX -> experts.E.gate_proj.SUFFIX
        expert, kind = shard
        prefix, leaf = name.rsplit(".", 1)
        return f"{prefix}.{expert}.{kind}_proj.{leaf.split('_', 1)[1]}"
    for ckpt, ours, s in stacked:
        if ours in name and s == shard:
            return name.replace(ours, ckpt)
    return name
