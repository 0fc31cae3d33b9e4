"""The KV cache tensors, laid out by each layer's KVCacheSpec (kv_cache/spec.py).

Consecutive layers with the same spec form a group; each group holds one allocation per named
tensor of its spec, [group_layers, num_pages, page_size, *row] (heads local to this TP rank).
A llama target and its EAGLE-3 layer are one group (k and v of L + 1 layers); an MLA target
with an MHA draft layer is two (latent of L layers, then k and v of one). slot = page *
page_size + offset addresses the same position in every layer.

Which pages belong to which request is the (torch-free) allocator's business; the pool only
owns memory and hands each attention module its layer's views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.kv_cache.spec import KVCacheSpec


class CachedLayer(Protocol):
    """An attention module that keeps a paged KV cache (layers.attention.CachedAttention)."""

    layer_idx: int

    @property
    def kv_spec(self) -> KVCacheSpec: ...

    def bind_kv_cache(self, caches: dict[str, torch.Tensor]) -> None: ...


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def bytes_per_page(specs: Sequence[KVCacheSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page costs across all layers (one spec per layer), every tensor."""
    itemsize = _itemsize(dtype)
    return sum(spec.bytes_per_page(page_size, itemsize) for spec in specs)


def pages_for_budget(
    budget_bytes: int, specs: Sequence[KVCacheSpec], page_size: int, dtype: torch.dtype
) -> int:
    """How many whole pages fit in `budget_bytes`."""
    return max(0, budget_bytes) // bytes_per_page(specs, page_size, dtype)


GPU_RESERVE_BYTES = 2 << 30  # left free for activations, logits and CUDA-graph pools


def plan_num_pages(
    cache, specs: Sequence[KVCacheSpec], dtype: torch.dtype, device: torch.device,
    reserve_bytes: int = 0,
) -> int:
    """Pages the allocator may hand out under a CacheConfig for layers of these specs:
    `num_pages` when given, else what fits in `gpu_memory_utilization` of the free GPU memory
    less GPU_RESERVE_BYTES and `reserve_bytes` (weights allocated after the pool: the
    drafters'), or in `kv_cache_bytes` on the CPU. ValueError (what to change) below two
    pages."""
    if cache.num_pages > 0:
        num_pages = cache.num_pages
    else:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * cache.gpu_memory_utilization) - GPU_RESERVE_BYTES - reserve_bytes
        else:
            budget = cache.kv_cache_bytes
        num_pages = pages_for_budget(budget, specs, cache.page_size, dtype)
    if num_pages < 2:
        per_page = bytes_per_page(specs, cache.page_size, dtype)
        raise ValueError(
            f"the KV-cache budget holds {num_pages} pages of {cache.page_size} tokens "
            f"({per_page} bytes each); raise --kv-cache-bytes / --gpu-memory-utilization or "
            "lower --page-size"
        )
    return num_pages


@dataclass
class KVGroup:
    """Layers [first_layer, first_layer + num_layers) of one spec and their tensors."""

    spec: KVCacheSpec
    first_layer: int
    num_layers: int
    tensors: dict[str, torch.Tensor]  # name -> [num_layers, num_pages, page_size, *row]


class KVPool:
    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 1:
            raise ValueError(
                f"the KV cache needs at least one page, got {num_pages}: "
                f"raise the KV memory budget or lower the model size"
            )
        self.specs = list(specs)
        self.num_layers = len(self.specs)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.groups: list[KVGroup] = []
        for layer, spec in enumerate(self.specs):
            if self.groups and self.groups[-1].spec == spec:
                self.groups[-1].num_layers += 1
            else:
                self.groups.append(KVGroup(spec, layer, 1, {}))
        for g in self.groups:  # one allocation per tensor; zero-filled so that kernels reading
            for name, row in g.spec.tensors:  # masked slots see finite values
                shape = (g.num_layers, num_pages, page_size, *row)
                g.tensors[name] = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self.groups for t in g.tensors.values())

    def layer_caches(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s views, name -> [num_pages, page_size, *row]."""
        for g in self.groups:
            if g.first_layer <= layer < g.first_layer + g.num_layers:
                return {name: t[layer - g.first_layer] for name, t in g.tensors.items()}
        raise IndexError(f"layer {layer} is outside the pool's {self.num_layers} layers")

    def groups_below(self, num_layers: int) -> list[tuple[KVGroup, int]]:
        """(group, how many of its leading layers lie in [0, num_layers)) for every group that
        starts below num_layers: what a pass over the first num_layers layers touches."""
        return [
            (g, min(g.num_layers, num_layers - g.first_layer))
            for g in self.groups
            if g.first_layer < num_layers
        ]

    def bind(self, modules: Sequence[CachedLayer], first_layer: int = 0) -> None:
        """Give modules[i] the caches of layer first_layer + i (e.g. target layers from 0,
        then the draft layer at num_target_layers); each module's spec must be its layer's."""
        if first_layer + len(modules) > self.num_layers:
            raise ValueError(
                f"binding {len(modules)} attention layers from layer {first_layer} needs "
                f"{first_layer + len(modules)} KV layers; the pool has {self.num_layers}"
            )
        for i, module in enumerate(modules):
            want = self.specs[first_layer + i]
            if module.kv_spec != want:
                raise ValueError(
                    f"attention layer {module.layer_idx} keeps {module.kv_spec.describe()} per "
                    f"token; pool layer {first_layer + i} was sized for {want.describe()}"
                )
            module.bind_kv_cache(self.layer_caches(first_layer + i))
