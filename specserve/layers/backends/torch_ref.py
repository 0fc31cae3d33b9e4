"""Reference attention backend in plain torch (CPU or GPU): the correctness oracle.

Per request r (host loop), with q_len new tokens and seq_len KV positions after the write:
    keys/values  = the cache rows of r's first seq_len positions, gathered through page_table
    query i sits at position seq_len - q_len + i and sees
        causal:  KV j <= seq_len - q_len + i
        custom:  width W = custom_mask.shape[-1]: KV j < seq_len - W (the prefix), or
                 KV seq_len - W + j' iff custom_mask[r, i, j']
    out = softmax(q K^T * scale + mask) V, accumulated in fp32; GQA by repeating kv heads.

MLA layers (layers/mla.py) use `TorchRefBackend.mla`: the latent-cache write and the absorbed
form through the references of kernels/mla_attention.py, the compute form by expanding each
request's latent rows to per-head K/V and attending as above. DSA layers (layers/dsa.py) use
`TorchRefBackend.dsa`: the indexer scores and the sparse attention through the (graph-safe)
references of kernels/dsa_index.py and kernels/sparse_mla.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.kernels import mla_attention as mla_ref
from specserve.kernels.dispatch import EXACT
from specserve.kernels.dsa_index import index_scores_ref, select_slots
from specserve.kernels.kv_store import store_kv_ref
from specserve.kernels.mla_store import mla_store_ref
from specserve.kernels.sparse_mla import sparse_mla_ref
from specserve.layers.attention_metadata import AttentionMetadata


def gather_kv_slots(page_table_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Slots of positions [0, seq_len): slot(p) = page_table_row[p // page_size] * ps + p % ps."""
    positions = torch.arange(seq_len, device=page_table_row.device)
    pages = page_table_row[positions // page_size].long()
    return pages * page_size + positions % page_size  # [seq_len]


def attention_mask(
    q_len: int, seq_len: int, custom_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i may attend KV j."""
    prefix = seq_len - q_len
    mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(diagonal=prefix)
    if custom_mask is not None:
        width = custom_mask.shape[-1]
        assert q_len <= width <= seq_len, "mask width must cover the queries, within the KV"
        mask[:, seq_len - width:] = custom_mask[:q_len]
    return mask


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    # q [q_len, num_heads, d]; k, v [seq_len, num_kv_heads, d]; mask [q_len, seq_len]
    if EXACT.attention:
        return attend_rowwise(q, k, v, mask, scale)
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_heads, q_len, seq_len]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [q_len, num_heads, d]


def attend_rowwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact mode: each query attends over exactly the KV it sees, gathered in position order,
    alone. A token's output then depends on its query and the keys/values it sees only, not on
    how many queries share the call nor how long the rest of the KV is (decode, chunked
    prefill and chain or tree verify of the same token at the same position agree bitwise)."""
    group = q.shape[1] // k.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(q.shape[0]):
        seen = mask[i].nonzero().squeeze(1)
        k_i = k[seen].float().repeat_interleave(group, dim=1)  # [n, num_heads, d]
        v_i = v[seen].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), k_i) * scale
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v_i).to(q.dtype)
    return out


class TorchMLA:
    """MLA ops of the reference backend (the MLABackend protocol of layers/mla.py)."""

    def rope_and_store(self, positions: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                       k_pe: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool,
                       latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        mla_store_ref(positions, q_pe, c_kv, k_pe, cos_sin, latent_cache, slot_mapping,
                              interleaved)

    def absorbed(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                 md: AttentionMetadata, scale: float) -> torch.Tensor:
        return mla_ref.mla_attention_ref(q_lat, q_pe, latent_cache, md.query_start_loc,
                                         md.seq_lens, md.page_table, scale, md.custom_mask)

    def compute(self, q: torch.Tensor, latent_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, kv_lora_rank: int,
                expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        # q [T, N, P + R] -> [T, N, V]; per request: K = [c W_UK^T | k_pe], V = c W_UV^T
        starts = md.query_start_loc.tolist()
        out = None
        for r, seq_len in enumerate(md.seq_lens.tolist()):
            a, b = starts[r], starts[r + 1]
            rows = mla_ref.gather_latent(latent_cache, md.page_table[r], seq_len)  # [S, L + R]
            k_nope, v = expand(rows[:, :kv_lora_rank])  # [S, N, P], [S, N, V]
            k_pe = rows[:, None, kv_lora_rank:].expand(-1, k_nope.shape[1], -1)
            if out is None:
                out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
            if a == b:
                continue
            custom = None if md.custom_mask is None else md.custom_mask[r]
            mask = attention_mask(b - a, seq_len, custom, q.device)
            out[a:b] = attend(q[a:b], torch.cat([k_nope, k_pe], dim=-1), v, mask, scale)
        assert out is not None
        return out


class TorchDSA:
    """DSA ops of the reference backend (the DSABackend protocol of layers/dsa.py)."""

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                     md: AttentionMetadata, first_token: int = 0) -> torch.Tensor:
        return index_scores_ref(q, w, index_cache, md.query_start_loc, md.seq_lens,
                                md.page_table, md.custom_mask, first_token)

    def select(self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
               md: AttentionMetadata, k: int, first_token: int = 0) -> torch.Tensor:
        scores = self.index_scores(q, w, index_cache, md, first_token)
        return select_slots(scores, k, md.query_start_loc, md.page_table, index_cache.shape[1],
                            first_token)  # fmt: skip

    def sparse_absorbed(self, q_lat: torch.Tensor, q_pe: torch.Tensor,
                        latent_cache: torch.Tensor, slots: torch.Tensor,
                        scale: float) -> torch.Tensor:
        return sparse_mla_ref(q_lat, q_pe, latent_cache, slots, scale)


class TorchRefBackend:
    name = "torch_ref"
    mla = TorchMLA()
    dsa = TorchDSA()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q [T, num_heads, d]; k, v [T, num_kv_heads, d]; caches [pages, page_size, kv, d]
        cached = k_cache.numel() > 0
        if cached:
            store_kv_ref(k, v, k_cache, v_cache, md.slot_mapping)
        q_lens = md.query_lens_cpu
        if q_lens is None:
            q_lens = md.query_start_loc.diff().tolist()
        seq_lens = md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens.tolist()
        out = torch.zeros_like(q)  # tokens past the last request (graph padding) stay zero
        start = 0
        for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
            assert q_len <= seq_len, f"request {r}: {q_len} new tokens but KV length {seq_len}"
            if q_len == 0:
                continue
            end = start + q_len
            if cached:
                slots = gather_kv_slots(md.page_table[r], seq_len, k_cache.shape[1])
                keys = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [seq_len, kv, d]
                values = v_cache.view(-1, *v_cache.shape[2:])[slots]
            else:  # no pool bound (e.g. a profiling run): the new tokens are the whole KV
                assert q_len == seq_len, "without a KV cache every request must be a fresh prefill"
                keys, values = k[start:end], v[start:end]
            custom = None if md.custom_mask is None else md.custom_mask[r]
            mask = attention_mask(q_len, seq_len, custom, q.device)
            out[start:end] = attend(q[start:end], keys, values, mask, scale)
            start = end
        return out
