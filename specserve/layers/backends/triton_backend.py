"""GPU attention backend: Triton kernels over the paged KV cache.

forward() writes the new K/V at md.slot_mapping, then runs one paged-attention launch: the
decode form (one query per request, flash-decoding splits) when md.max_query_len == 1 and there
is no custom mask, else the extend form (causal, or the tree mask for verify). Launch shapes
depend only on host values fixed for a captured batch (bs, heads, max_query_len), so both forms
can be recorded in CUDA graphs; no per-step host state is kept, so no graph hooks are needed.
"""

from __future__ import annotations

import importlib.util

import torch

from specserve.layers.attention_metadata import AttentionMetadata


def available() -> tuple[bool, str]:
    """Whether this backend can run here, and if not, why."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'specserve[gpu]')"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install reports why instead of crashing start-up
        return False, f"triton failed to import: {exc}"
    return True, "ok"


class TritonBackend:
    name = "triton"
    fuses_rope = True  # forward(rope=...) rotates q/k in the KV-write launch

    def __init__(self) -> None:
        # imported here so that this module loads on machines without triton
        from specserve.kernels import kv_store, paged_attention, rotary

        self._kernels = paged_attention
        self._kv_store = kv_store
        self._rotary = rotary

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim] (already rotated)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (positions [T], cos_sin table)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        kernels = self._kernels
        if k_cache.numel() == 0:
            if rope is not None:
                self._rotary.rotary_inplace(rope[0], q, k, rope[1])
            return self._forward_uncached(q, k, v, md, scale)
        if rope is None:
            self._kv_store.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        else:  # q, k rotated in place; k, v written to the cache in the same launch
            self._rotary.rotary_store_kv(rope[0], q, k, v, rope[1], k_cache, v_cache,
                                         md.slot_mapping)
        if md.is_decode and md.custom_mask is None and q.shape[0] == md.batch_size:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, md.seq_lens, md.page_table, scale
            )
        return kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            md.query_start_loc,
            md.seq_lens,
            md.page_table,
            md.max_query_len,
            scale,
            custom_mask=md.custom_mask,
        )

    def _forward_uncached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """No pool bound yet (e.g. a profiling run): every request is a fresh prefill whose KV is
        its own new tokens. They are read in place as a cache of one-token pages:
        page_table[r, i] = query_start_loc[r] + i."""
        k_pages = k.unsqueeze(1)  # [T, 1, num_kv_heads, head_dim]
        v_pages = v.unsqueeze(1)
        offsets = torch.arange(md.max_query_len, device=q.device, dtype=torch.int32)
        page_table = md.query_start_loc[:-1, None].int() + offsets  # [bs, max_query_len]
        seq_lens = md.query_start_loc.diff().int()  # [bs]
        return self._kernels.paged_attention(
            q,
            k_pages,
            v_pages,
            md.query_start_loc,
            seq_lens,
            page_table,
            md.max_query_len,
            scale,
            custom_mask=md.custom_mask,
        )
