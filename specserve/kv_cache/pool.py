"""The KV cache tensors: per layer, k and v of shape [num_pages, page_size, num_kv_heads,
head_dim] (heads local to this TP rank); slot = page * page_size + offset.

Which pages belong to which request is the (torch-free) allocator's business; the pool only
owns memory and hands each Attention module its layer's views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.layers.attention import Attention


def bytes_per_page(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one page costs across all layers, k and v."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def pages_for_budget(
    budget_bytes: int,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many whole pages fit in `budget_bytes`."""
    return max(0, budget_bytes) // bytes_per_page(
        num_layers, page_size, num_kv_heads, head_dim, dtype
    )


GPU_RESERVE_BYTES = 2 << 30  # left free for activations, logits and CUDA-graph pools


def plan_num_pages(cache, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device) -> int:
    """Pages the allocator may hand out under a CacheConfig: `num_pages` when given, else what
    fits in `gpu_memory_utilization` of the free GPU memory (less GPU_RESERVE_BYTES) or in
    `kv_cache_bytes` on the CPU. ValueError (what to change) below two pages."""
    if cache.num_pages > 0:
        num_pages = cache.num_pages
    else:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * cache.gpu_memory_utilization) - GPU_RESERVE_BYTES
        else:
            budget = cache.kv_cache_bytes
        num_pages = pages_for_budget(budget, num_layers, cache.page_size, num_kv_heads,
                                     head_dim, dtype)
    if num_pages < 2:
        per_page = bytes_per_page(num_layers, cache.page_size, num_kv_heads, head_dim, dtype)
        raise ValueError(
            f"the KV-cache budget holds {num_pages} pages of {cache.page_size} tokens "
            f"({per_page} bytes each); raise --kv-cache-bytes / --gpu-memory-utilization or "
            "lower --page-size")
    return num_pages


class KVPool:
    bytes_per_page = staticmethod(bytes_per_page)
    pages_for_budget = staticmethod(pages_for_budget)

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 1:
            raise ValueError(
                f"the KV cache needs at least one page, got {num_pages}: "
                f"raise the KV memory budget or lower the model size"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # one allocation each; zero-filled so kernels that read masked slots see finite values
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_caches: list[torch.Tensor] = list(self.k.unbind(0))
        self.v_caches: list[torch.Tensor] = list(self.v.unbind(0))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bind(self, modules: Sequence[Attention], first_layer: int = 0) -> None:
        """Give modules[i] the caches of layer first_layer + i (e.g. target layers from 0,
        then the draft layer at num_target_layers)."""
        if first_layer + len(modules) > self.num_layers:
            raise ValueError(
                f"binding {len(modules)} attention layers from layer {first_layer} needs "
                f"{first_layer + len(modules)} KV layers; the pool has {self.num_layers}"
            )
        for i, module in enumerate(modules):
            if (module.num_kv_heads, module.head_dim) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"attention layer {module.layer_idx} has {module.num_kv_heads} kv heads of "
                    f"dim {module.head_dim}; the pool was sized for {self.num_kv_heads} x "
                    f"{self.head_dim}"
                )
            module.k_cache = self.k_caches[first_layer + i]
            module.v_cache = self.v_caches[first_layer + i]
