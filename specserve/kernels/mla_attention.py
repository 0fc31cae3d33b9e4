"""Multi-head latent attention over the paged latent cache: Triton kernels and torch references.

Cache layout (KVCacheSpec.mla): latent_cache [num_pages, page_size, L + R], one row per token
[c_kv (L = kv_lora_rank) | k_pe (R = qk_rope_head_dim, rotated)], shared by every head; logical
position n of request r lives at page page_table[r, n // page_size], offset n % page_size.

    store      (one launch per layer) rotate q_pe [T, N, R] in place and write [c_kv | rot(k_pe)]
               at each token's slot (-1: no write); rope on interleaved pairs (2i, 2i+1) or on
               halves (i, i + R/2), cos/sin of frequency i from a [positions, R] table
               [cos | sin] (layers/rotary.py)
    attention  the absorbed form: MQA with one latent KV head, per (query, head)
                   s_j = (q_lat . c_j + q_pe . k_pe_j) * scale        q_lat = q_nope W_UK [L]
                   o_lat = sum_j softmax(s)_j c_j                      [L], V = the latent itself
               decode (one query per request), causal extend, or a custom mask (tree verify),
               with the masking rules of layers/attention_metadata.py

Mask rules: the new tokens of request r are the last q_len of its KV. Causal: query i sees
[0, seq_len - q_len + i]. Custom mask of width W: query i sees [0, seq_len - W) plus position
seq_len - W + j iff custom_mask[r, i, j].
"""

from __future__ import annotations

import math

import torch

# --------------------------------------------------------------------------------------------
# torch references


def rotate_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, heads, R] rotated by per-token cos/sin [T, R/2] (fp32 math, x's dtype out).
    Pair i is (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2]); it stays in place."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        return torch.stack((y1, y2), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


def mla_store_ref(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos_sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
) -> None:
    """Reference for `mla_store`: q_pe [T, N, R] rotated in place; latent_cache.flat[slot[t]] =
    [c_kv[t] | rot(k_pe[t])] for every t with slot[t] >= 0. c_kv [T, L], k_pe [T, R]."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, R/2] each
    q_pe.copy_(rotate_rope(q_pe, cos, sin, interleaved))
    k_rot = rotate_rope(k_pe[:, None, :], cos, sin, interleaved)[:, 0]
    rows = torch.cat([c_kv, k_rot], dim=-1).to(latent_cache.dtype)  # [T, L + R]
    valid = slot_mapping >= 0
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    flat.index_copy_(0, slot_mapping[valid].long(), rows[valid])


def visible_mask(
    q_len: int, seq_len: int, custom_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i may attend KV position j (rules above);
    custom_mask: this request's [>= q_len, W] mask."""
    seen = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if custom_mask is None:
        return seen.tril(diagonal=seq_len - q_len)
    width = custom_mask.shape[-1]
    assert q_len <= width <= seq_len, "mask width must cover the queries, within the KV"
    seen[:, seq_len - width :] = custom_mask[:q_len]
    return seen


def gather_latent(
    latent_cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """One request's cache rows of positions [0, seq_len): [seq_len, L + R]."""
    page_size = latent_cache.shape[1]
    pos = torch.arange(seq_len, device=latent_cache.device)
    return latent_cache[page_table_row[pos // page_size].long(), pos % page_size]


def mla_attention_ref(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `mla_attention` (absorbed form), dense per request in fp32.
    q_lat [T, N, L], q_pe [T, N, R] -> o_lat [T, N, L]; tokens past the last request stay 0."""
    rank = q_lat.shape[-1]
    out = q_lat.new_zeros(q_lat.shape)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if a == b:
            continue
        rows = gather_latent(latent_cache, page_table[r], seq_len).float()  # [S, L + R]
        c, pe = rows[:, :rank], rows[:, rank:]
        scores = (
            torch.einsum("qhl,sl->hqs", q_lat[a:b].float(), c)
            + torch.einsum("qhr,sr->hqs", q_pe[a:b].float(), pe)
        ) * scale
        mask = visible_mask(
            b - a, seq_len, None if custom_mask is None else custom_mask[r], q_lat.device
        )
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        out[a:b] = torch.einsum("hqs,sl->qhl", probs, c).to(out.dtype)
    return out


def latent_rows(
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """Every request's rows of positions [0, seq_len), request after request:
    [sum(seq_lens), L + R] (the compute form's input; host lengths size it, no sync)."""
    total, page_size = sum(seq_lens_cpu), latent_cache.shape[1]
    dev = latent_cache.device
    req = torch.repeat_interleave(
        torch.arange(len(seq_lens_cpu), device=dev), seq_lens.long(), output_size=total
    )
    starts = torch.cumsum(seq_lens.long(), 0) - seq_lens.long()
    pos = torch.arange(total, device=dev) - starts[req]
    pages = page_table[req, pos // page_size].long()
    return latent_cache[pages, pos % page_size]


def uncached_layout(
    num_tokens: int, query_start_loc: torch.Tensor, max_query_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_mapping, page_table) addressing the new tokens themselves as a cache of one-token
    pages: token t at slot t, page_table[r, i] = query_start_loc[r] + i. For forwards with no
    pool bound, where every request is a fresh prefill."""
    dev = query_start_loc.device
    offsets = torch.arange(max(max_query_len, 1), device=dev, dtype=torch.int32)
    page_table = query_start_loc[:-1, None].int() + offsets
    return torch.arange(num_tokens, device=dev), page_table


def _check_shapes(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> None:
    assert q_lat.shape[:2] == q_pe.shape[:2]
    assert latent_cache.shape[-1] == q_lat.shape[-1] + q_pe.shape[-1], "cache row != L + R"
    assert math.prod(latent_cache.shape[:2]) > 0
