"""GPU attention backend: Triton kernels over the paged KV cache.

forward() writes the new K/V at md.slot_mapping, then runs one paged-attention launch: the
decode form (one query per request, flash-decoding splits) when md.max_query_len == 1 and there
is no custom mask, else the extend form (causal, or the tree mask for verify). Launch shapes
depend only on host values fixed for a captured batch (bs, heads, max_query_len), so both forms
can be recorded in CUDA graphs; no per-step host state is kept, so no graph hooks are needed.

MLA layers use `TritonBackend.mla`: the latent write (kernels/mla_store.py), the absorbed form
(kernels/mla_attention.py, decode / causal / tree mask, graph-capturable) and the compute form
(latent rows gathered and expanded to per-head K/V, then the paged-attention kernel above over
them as a cache of one-token pages; eager batches only: it is sized by host lengths). DSA
layers use `TritonBackend.dsa`: the indexer's scores (kernels/dsa_index.py), the top-k
(kernels/dsa_select.py) and the attention over the selected slots (kernels/sparse_mla.py), all
graph-capturable, the first two doing work in proportion to the requests' lengths.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

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


class TritonMLA:
    """MLA ops on the Triton kernels (the MLABackend protocol of layers/mla.py)."""

    def __init__(self) -> None:
        from specserve.kernels import mla_attention, mla_store, paged_attention

        self._attention = mla_attention
        self._store = mla_store
        self._paged = paged_attention

    def rope_and_store(self, positions: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                       k_pe: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool,
                       latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._store.mla_store(positions, q_pe, c_kv, k_pe, cos_sin, latent_cache, slot_mapping,
                              interleaved)

    def absorbed(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                 md: AttentionMetadata, scale: float) -> torch.Tensor:
        decode = md.is_decode and md.custom_mask is None and q_lat.shape[0] == md.batch_size
        return self._attention.mla_attention(
            q_lat, q_pe, latent_cache, None if decode else md.query_start_loc, md.seq_lens,
            md.page_table, md.max_query_len, scale, custom_mask=md.custom_mask)

    def compute(self, q: torch.Tensor, latent_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, kv_lora_rank: int,
                expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        # q [T, N, P + R] -> [T, N, V]. Every request's rows [0, seq_len), request after
        # request, expanded to K [S, N, P + R] and V [S, N, V]; request r's K/V start at
        # kv_start[r], read as one-token pages: page_table[r, i] = kv_start[r] + i
        assert md.seq_lens_cpu is not None, "the compute form needs host sequence lengths"
        rows = self._attention.latent_rows(latent_cache, md.page_table, md.seq_lens,
                                           md.seq_lens_cpu)  # [S, L + R]
        k_nope, v = expand(rows[:, :kv_lora_rank])  # [S, N, P], [S, N, V] (views)
        k_pe = rows[:, None, kv_lora_rank:].expand(-1, k_nope.shape[1], -1)
        k = torch.cat([k_nope, k_pe], dim=-1)  # [S, N, P + R]
        seq_lens = md.seq_lens.long()
        kv_start = (torch.cumsum(seq_lens, 0) - seq_lens).int()
        offsets = torch.arange(max(md.seq_lens_cpu), device=q.device, dtype=torch.int32)
        return self._paged.paged_attention(
            q, k.unsqueeze(1), v.unsqueeze(1), md.query_start_loc, md.seq_lens,
            kv_start[:, None] + offsets, md.max_query_len, scale, custom_mask=md.custom_mask)


class TritonDSA:
    """DSA ops on the Triton kernels (the DSABackend protocol of layers/dsa.py)."""

    def __init__(self) -> None:
        from specserve.kernels import dsa_index, dsa_select, sparse_mla

        self._index = dsa_index
        self._select = dsa_select
        self._sparse = sparse_mla

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                     md: AttentionMetadata, first_token: int = 0,
                     token_req: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return self._index.index_scores(q, w, index_cache, md.query_start_loc, md.seq_lens,
                                        md.page_table, md.custom_mask, first_token,
                                        token_req=token_req)  # fmt: skip

    def select(self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
               md: AttentionMetadata, k: int, first_token: int = 0) -> torch.Tensor:
        token_req = self._index.token_requests(md.query_start_loc, q.shape[0], first_token)
        scores = self.index_scores(q, w, index_cache, md, first_token, token_req)
        page_size = index_cache.shape[1]
        # one program a token up to a 32k context limit; past it each token's positions are
        # spread over programs (the one-program scan of a 128k row alone is ~3x torch.topk)
        if scores.shape[1] <= self._select.ONE_PROGRAM_MAX_WIDTH:
            select = self._select.select_slots_fast
        else:
            select = self._select.select_slots_split
        return select(scores, k, token_req, md.seq_lens, md.page_table, page_size)

    def sparse_absorbed(self, q_lat: torch.Tensor, q_pe: torch.Tensor,
                        latent_cache: torch.Tensor, slots: torch.Tensor,
                        scale: float) -> torch.Tensor:
        return self._sparse.sparse_mla_attention(q_lat, q_pe, latent_cache, slots, scale)


class TritonBackend:
    name = "triton"
    fuses_rope = True  # forward(rope=...) rotates q/k in the KV-write launch

    def __init__(self) -> None:
        # imported here so that this module loads on machines without triton
        from specserve.kernels import kv_store, paged_attention, rotary

        self._kernels = paged_attention
        self._kv_store = kv_store
        self._rotary = rotary
        self.mla = TritonMLA()
        self.dsa = TritonDSA()

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
            block_table=md.block_table,
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
