"""DeepSeek sparse attention (DSA), the selection half: the lightning indexer's scores over the
paged index-key cache and the top-k choice, as a Triton kernel with its torch reference.

Per query token t of request r and cached position s (layers/dsa.py computes q, k and w):

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])        h < index_n_heads
    w[t, h]     = weights_proj(x_t)[h] * index_n_heads^-0.5 * index_head_dim^-0.5
    selected    = the index_topk visible positions of highest score (all of them when fewer
                  are visible), as cache slots in ascending position order, then -1

(relu(a) * c = relu(a * c) for c > 0: the head_dim^-0.5 of the reference sits in w.)

Index-key cache: index_k_cache [num_pages, page_size, index_head_dim], one row per token
written by kernels/mla_store.py as [k pass dims | rotated k rope dims]; the query is handed
over in the same order. Visibility is attention's (layers/attention_metadata.py): causal, or a
custom mask of width W over the last W positions; positions >= seq_len are never visible.

Shapes never depend on sequence lengths: scores are [T, width] with width = the page table's
columns * page_size (a captured graph's fixed table), so every function here is CUDA-graph
safe (no host sync, no data-dependent shape). The Triton kernels' work still follows the
requests' lengths: the scores kernel loops over each token's own positions and leaves the
columns past its request's length unwritten, and the selection (kernels/dsa_select.py) reads
no further; the torch forms fill them with -inf and rank the whole row. A long prefill is
scored in chunks of its tokens (`first_token`), keeping [chunk, width] bounded. The batch
layout comes as attention metadata's tensors: query_start_loc [bs + 1], seq_lens [bs],
page_table [bs, pages], custom_mask [bs, max_q, W] bool or None.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl

MIN_DOT = 16
# the torch path gathers [tokens, width, index_head_dim] keys per chunk of tokens: at most this
# many values at once
REF_CHUNK_VALUES = 1 << 24
# the scores kernel's programs in all (each loops over blocks of its token's positions)
SCORE_PROGRAMS = 1024


def token_requests(
    query_start_loc: torch.Tensor, num_tokens: int, first_token: int = 0
) -> torch.Tensor:
    """[T] int64: the request of tokens first_token .. first_token + T - 1 of the batch (bs
    for tokens past the last request: padding)."""
    t = torch.arange(first_token, first_token + num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].long(), t, right=True)


def visible(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    custom_mask: torch.Tensor | None,
    token_req: torch.Tensor,
    width: int,
    first_token: int = 0,
) -> torch.Tensor:
    """[T, width] bool: True where token first_token + t may attend position s (the attention
    mask rules; padding tokens see nothing)."""
    bs, dev = seq_lens.shape[0], token_req.device
    ok = token_req < bs
    r = token_req.clamp(max=bs - 1)
    qsl = query_start_loc.long()
    t = torch.arange(first_token, first_token + token_req.shape[0], device=dev)
    i = t - qsl[r]  # query index in its request
    q_len, seq = qsl[r + 1] - qsl[r], seq_lens.long()[r]
    s = torch.arange(width, device=dev)[None, :]
    if custom_mask is None:
        seen = s <= (seq - q_len + i)[:, None]
    else:
        mask = custom_mask  # [bs, max_q, W]
        w = mask.shape[-1]
        j = s - (seq - w)[:, None]  # column of the mask (< 0: the visible prefix)
        rows = mask[r, i.clamp(0, mask.shape[1] - 1)]  # [T, W]
        tree = rows.gather(1, j.clamp(0, w - 1))
        seen = (j < 0) | tree
    return seen & (s < seq[:, None]) & ok[:, None]


def gather_rows(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Every request's cache rows of positions [0, width): [bs, width, *row]. Table entries
    past a request's pages (-1, the padding page, or past the cache: a scratch cache's table)
    read some page of the cache; mask those rows."""
    page_size = cache.shape[1]
    pos = torch.arange(page_table.shape[1] * page_size, device=cache.device)
    pages = page_table[:, pos // page_size].long().clamp(0, cache.shape[0] - 1)
    return cache[pages, pos % page_size]


def index_scores_ref(
    q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, page_table: torch.Tensor, custom_mask: torch.Tensor | None = None,
    first_token: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Torch form of `index_scores`: q [T, nI, dI], w [T, nI] fp32 -> [T, width] fp32."""
    width = page_table.shape[1] * index_cache.shape[1]
    token_req = token_requests(query_start_loc, q.shape[0], first_token)
    keys = gather_rows(index_cache, page_table).float()  # [bs, width, dI]
    r = token_req.clamp(max=keys.shape[0] - 1)
    out = torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
    chunk = max(1, REF_CHUNK_VALUES // (width * q.shape[-1]))
    for a in range(0, q.shape[0], chunk):  # host ints only: the same launches every replay
        logits = torch.einsum("thd,tsd->ths", q[a : a + chunk].float(), keys[r[a : a + chunk]])
        out[a : a + chunk] = torch.einsum("ths,th->ts", logits.relu(), w[a : a + chunk].float())
    seen = visible(query_start_loc, seq_lens, custom_mask, token_req, width, first_token)
    return out.masked_fill(~seen, float("-inf"))


@jit
def token_length(req_ptr, seq_lens_ptr, t, bs):
    """(request, sequence length) of the batch's token t; a padding token (request bs, past
    the last one) gets the last request and length 0: it sees nothing."""
    req = tl.load(req_ptr + t)
    live = tl.where(req < bs, 1, 0)
    req = tl.minimum(req, bs - 1)
    return req, tl.load(seq_lens_ptr + req) * live


@jit
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, out_ptr, req_ptr, qsl_ptr, seq_lens_ptr, page_table_ptr, mask_ptr,
    num_heads, head_dim, bs, mask_width, first_token, num_programs,
    stride_qt, stride_qh, stride_wt, stride_cp, stride_cs, stride_ot, stride_tab,
    stride_mr, stride_mi, stride_mj,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # program (token, p) scores blocks p, p + num_programs, ... of BLOCK_N positions below the
    # token's request length (none past it: those columns are not written): all heads in one
    # dot, relu, weighted sum over heads, the attention mask; -inf where not visible
    t = tl.program_id(0).to(tl.int64)
    req, seq_len = token_length(req_ptr, seq_lens_ptr, t, bs)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    qi = first_token + t - q_start
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < num_heads) & (d[None, :] < head_dim),
        other=0.0,
    )
    wt = tl.load(w_ptr + t * stride_wt + h, mask=h < num_heads, other=0.0).to(tl.float32)
    for blk in range(tl.program_id(1), tl.cdiv(seq_len, BLOCK_N), num_programs):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        in_kv = n < seq_len
        if HAS_MASK:
            j = n - (seq_len - mask_width)
            tree = tl.load(
                mask_ptr + req * stride_mr + qi * stride_mi + j * stride_mj,
                mask=in_kv & (j >= 0) & (j < mask_width),
                other=0,
            )
            seen = (j < 0) | (tree != 0)
        else:
            seen = n <= seq_len - q_len + qi
        seen = seen & in_kv
        page = tl.load(page_table_ptr + req * stride_tab + n // PAGE_SIZE, mask=seen, other=0)
        base = page.to(tl.int64) * stride_cp + (n % PAGE_SIZE) * stride_cs
        k = tl.load(
            cache_ptr + base[:, None] + d[None, :],
            mask=seen[:, None] & (d[None, :] < head_dim),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        score = tl.sum(tl.maximum(logits, 0.0) * wt[:, None], 0)
        score = tl.where(seen, score, float("-inf"))
        tl.store(out_ptr + t * stride_ot + n, score, mask=in_kv)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, page_table: torch.Tensor, custom_mask: torch.Tensor | None = None,
    first_token: int = 0, block_n: int = 64, token_req: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """score[t, s] (module docstring) of each token's request's positions s < seq_len: q
    [T, nI, dI] (the cache's dim order), w [T, nI] fp32, index_cache [pages, page_size, dI]
    -> [T, width] fp32, -inf where not visible below seq_len; columns at or past seq_len are
    not written (a captured graph's width is the context limit: the work follows the
    requests' lengths). Row t is the batch's token first_token + t (a chunk of the tokens);
    token_req: token_requests' answer if the caller has it. One launch."""
    num_tokens, num_heads, head_dim = q.shape
    assert q.stride(-1) == 1 and index_cache.stride(-1) == 1 and index_cache.shape[-1] == head_dim
    page_size = index_cache.shape[1]
    width = page_table.shape[1] * page_size
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out
    if token_req is None:
        token_req = token_requests(query_start_loc, num_tokens, first_token)
    mask = custom_mask
    mask_arg = mask.view(torch.uint8) if mask is not None else page_table
    mask_strides = mask.stride() if mask is not None else (0, 0, 0)
    # programs per token: the blocks of the widest row at most, ~SCORE_PROGRAMS in all
    num_programs = max(1, min(-(-width // block_n), -(-SCORE_PROGRAMS // num_tokens)))
    _index_scores_kernel[(num_tokens, num_programs)](
        q, w, index_cache, out, token_req, query_start_loc, seq_lens, page_table,
        mask_arg, num_heads, head_dim, seq_lens.shape[0],
        mask.shape[-1] if mask is not None else 0, first_token, num_programs,
        q.stride(0), q.stride(1), w.stride(0), index_cache.stride(0), index_cache.stride(1),
        out.stride(0), page_table.stride(0), *mask_strides,
        PAGE_SIZE=page_size, BLOCK_H=max(next_power_of_2(num_heads), MIN_DOT),
        BLOCK_D=max(next_power_of_2(head_dim), MIN_DOT), BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def selection_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (score, -position): the float32 score's bits made order-preserving
    as a signed int (negative floats' magnitude bits flipped; -0.0 first made +0.0) in the high
    half, width - 1 - position in the low half. topk over them is topk over the scores with ties
    to the lower position, whatever the kernel's own tie order."""
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    width = scores.shape[-1]
    low = width - 1 - torch.arange(width, device=scores.device)
    return (ordered << 32) | low


def select_slots(
    scores: torch.Tensor,
    k: int,
    query_start_loc: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    first_token: int = 0,
) -> torch.Tensor:
    """The cache slots of each token's top-k visible positions, in ascending position order:
    scores [T, width] (-inf: not visible; row t: the batch's token first_token + t) -> [T, k]
    int64, -1 after them where fewer than k positions are visible. Needs k <= width (the
    caller attends densely while every visible set fits in k). Equal scores go to the earlier
    position (`selection_keys`), so a decode and a verify of the same token select the same
    tokens where their scores tie exactly (ReLU makes exact zeros common); the order is
    canonical, so they attend over them in the same order. The torch form of
    kernels/dsa_select.py."""
    assert k <= scores.shape[1], (k, scores.shape)
    width = scores.shape[1]
    _, pos = selection_keys(scores).topk(k, dim=-1)  # [T, k]
    chosen = scores.gather(1, pos) > float("-inf")
    pos = torch.where(chosen, pos, width).sort(dim=-1).values  # ascending, the unchosen last
    bs = page_table.shape[0]
    r = token_requests(query_start_loc, scores.shape[0], first_token).clamp(max=bs - 1)
    real = pos < width
    pos = pos.clamp(max=width - 1)
    pages = page_table[r[:, None], pos // page_size].long()
    slots = pages * page_size + pos % page_size
    return torch.where(real, slots, -1)
