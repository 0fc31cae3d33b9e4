"""Multi-head latent attention over the paged latent cache, absorbed form: a Triton kernel,
its torch reference, and the gathers the compute form (layers/mla.py) uses.

Cache layout (KVCacheSpec.mla): latent_cache [num_pages, page_size, L + R], one row per token
[c_kv (L = kv_lora_rank) | k_pe (R = qk_rope_head_dim, rotated)], shared by every head
(written by kernels/mla_store.py); logical position n of request r lives at page
page_table[r, n // page_size], offset n % page_size.

The absorbed form is MQA with one latent KV head, per (query, head):
    s_j   = (q_lat . c_j + q_pe . k_pe_j) * scale        q_lat = q_nope W_UK [L]
    o_lat = sum_j softmax(s)_j c_j                       [L]: V is the latent itself
for decode (one query per request), causal extend, or a custom mask (tree verify). A program
owns (request, BLOCK_M queries, BLOCK_H heads, KV split); its tile rows are queries x heads, so
a latent tile is loaded once for all of them and used twice (scores and values). The KV range
is cut into `num_splits` chunks (flash-decoding), merged by kernels/split_kv.py's combine.

Mask rules: the new tokens of request r are the last q_len of its KV. Causal: query i sees
[0, seq_len - q_len + i]. Custom mask of width W: query i sees [0, seq_len - W) plus position
seq_len - W + j iff custom_mask[r, i, j].
"""

from __future__ import annotations

import math

import torch

from specserve.kernels.attention_tiles import (
    _kv_range,
    _mask_scores,
    _normalize,
    _path_positions,
    _softmax_step,
    _tree_range,
)
from specserve.kernels.dispatch import EXACT, jit, next_power_of_2, tl, triton  # noqa: F401
from specserve.kernels.split_kv import combine_splits, default_num_splits, split_buffers

MIN_DOT = 16  # smallest tl.dot dimension on GPUs
LOG2E = 1.4426950408889634


# per-step integers (page table and mask widths too) aren't specialized on 1 / multiples of 16
@jit(do_not_specialize=["num_m_blocks", "mask_width", "stride_tab", "stride_mr", "stride_mi"])
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, page_table_ptr, mask_ptr,
    scale_log2, num_m_blocks, num_heads, rank, rope, mask_width,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_cp, stride_cs, stride_ot, stride_oh,
    stride_tab, stride_mr, stride_mi, stride_mj,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, IS_DECODE: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_TOKENS: tl.constexpr, EXACT_TREE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    # a program owns (request, block of BLOCK_M queries, block of BLOCK_H heads, KV split);
    # its tile rows are those queries x heads, all reading the same latent rows
    req = tl.program_id(0) // num_m_blocks
    m_block = tl.program_id(0) % num_m_blocks
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2) if SPLIT else 1  # at run time: a new count compiles nothing
    if IS_DECODE:
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)

    # tile row i <-> (query qi, head): i = (qi - m_block * BLOCK_M) * BLOCK_H + head % BLOCK_H
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    head = head_block * BLOCK_H + rows % BLOCK_H
    if EXACT_TREE:  # one query per program, in tile slot 0 as a decode's (exact mode)
        qi = m_block + 0 * rows
        row_ok = (rows < BLOCK_H) & (qi < q_len) & (head < num_heads)
    else:
        qi = m_block * BLOCK_M + rows // BLOCK_H
        row_ok = (qi < q_len) & (head < num_heads)
    token = (q_start + qi).to(tl.int64)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    q_lat = tl.load(
        q_lat_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dl[None, :],
        mask=row_ok[:, None] & (dl[None, :] < rank),
        other=0.0,
    )  # [ROWS, BLOCK_L]
    q_pe = tl.load(
        q_pe_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + dr[None, :],
        mask=row_ok[:, None] & (dr[None, :] < rope),
        other=0.0,
    )  # [ROWS, BLOCK_R]

    # KV positions this query block can see (kernels/attention_tiles.py)
    if EXACT_TREE:  # the query's context in a decode's order: prefix, then its path
        lo, hi, mask_start, on, depth = _tree_range(
            mask_ptr, req, m_block, q_len, seq_len, split, mask_width, stride_mr, stride_mi,
            stride_mj, BLOCK_N, num_splits, SPLIT_TOKENS, BLOCK_W)
    else:
        lo, hi, mask_start = _kv_range(seq_len, q_len, m_block, split, mask_width, BLOCK_M,
                                       BLOCK_N, num_splits, HAS_MASK, SPLIT_TOKENS)

    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if EXACT_TREE:
            pos = _path_positions(n, mask_start, on, depth, BLOCK_W)
        else:
            pos = n
        page = tl.load(page_table_ptr + req * stride_tab + pos // PAGE_SIZE, mask=n_ok, other=0)
        base = page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cs  # [BLOCK_N]
        c = tl.load(
            cache_ptr + base[:, None] + dl[None, :],
            mask=n_ok[:, None] & (dl[None, :] < rank),
            other=0.0,
        )  # [BLOCK_N, BLOCK_L]
        pe = tl.load(
            cache_ptr + base[:, None] + rank + dr[None, :],
            mask=n_ok[:, None] & (dr[None, :] < rope),
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        qk += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        qk = qk * scale_log2  # [ROWS, BLOCK_N]
        if EXACT_TREE:  # every virtual position below hi is on the path
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
        else:
            qk = _mask_scores(qk, n, n_ok, qi, row_ok, mask_start, mask_ptr, req, stride_mr,
                              stride_mi, stride_mj, HAS_MASK)  # fmt: skip
        p, alpha, l_i, m_i = _softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)

    o, lse = _normalize(acc, m_i, l_i)  # a row that saw nothing outputs 0
    o_mask = row_ok[:, None] & (dl[None, :] < rank)
    if not SPLIT:
        dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dl[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        mid = token * stride_mot + head * stride_moh
        tl.store(mid_o_ptr + mid[:, None] + split * stride_mos + dl[None, :], o, mask=o_mask)
        tl.store(mid_lse_ptr + token * stride_mlt + head * stride_mlh + split, lse,
                 mask=row_ok)  # fmt: skip


def mla_launch_plan(
    bs: int,
    max_query_len: int,
    num_heads: int,
    rank: int,
    device: torch.device,
    num_splits: int | None = None,
    block_n: int | None = None,
    max_rows: int | None = None,
    masked: bool = False,
) -> tuple:
    """(block_m, block_h, num_m_blocks, num_head_blocks, num_splits, block_n) of an attention
    launch, None arguments replaced by defaults. Tile rows = queries x heads, heads first (they
    share every latent row): at most `max_rows` (16 at the real latent width, whose fp32
    accumulator is [rows, 512]; 64 for narrow latents) and at least MIN_DOT. Exact mode: the
    same tile rows for every query length and EXACT.kv_splits splits of EXACT.kv_split_tokens
    (a row's KV blocks and their order are those of the same row in any other launch); under a
    custom mask one query per program, reading its path as a decode would (EXACT_TREE)."""
    if max_rows is None:
        max_rows = 16 if rank >= 256 else 64
    block_h = min(next_power_of_2(num_heads), max_rows)
    if EXACT.attention:  # one tile shape whatever the query length, a fixed split count (and length)
        block_m = max(1, MIN_DOT // block_h)
        num_splits = EXACT.kv_splits
    else:
        block_m = max(1, min(next_power_of_2(max_query_len), max_rows // block_h))
        block_m = max(block_m, MIN_DOT // block_h)
    num_m_blocks = math.ceil(max_query_len / block_m)
    if EXACT.attention and masked:
        num_m_blocks = max_query_len
    num_head_blocks = math.ceil(num_heads / block_h)
    if num_splits is None:
        num_splits = default_num_splits(bs * num_m_blocks * num_head_blocks, device)
    if block_n is None:
        block_n = 32 if rank >= 256 else 16  # divides EXACT.kv_split_tokens (256 * 2^i)
    return block_m, block_h, num_m_blocks, num_head_blocks, num_splits, block_n


def mla_attention(
    q_lat: torch.Tensor,  # [T, N, L]
    q_pe: torch.Tensor,  # [T, N, R] (rotated)
    latent_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    query_start_loc: torch.Tensor | None,  # [bs + 1] int32; None: decode (one query each)
    seq_lens: torch.Tensor,  # [bs] int32, KV length including the new tokens
    page_table: torch.Tensor,  # [bs, max_pages] int32
    max_query_len: int,
    scale: float,
    custom_mask: torch.Tensor | None = None,  # [bs, max_query_len, W] bool, W >= max_query_len
    out: torch.Tensor | None = None,  # [T, N, L]
    num_splits: int | None = None,
    block_n: int | None = None,
    max_rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Absorbed-form attention of T new queries over the paged latent cache (already holding
    their rows): decode, causal extend or a custom mask (module docstring). Launch shapes
    depend only on (bs, N, max_query_len, num_splits), never on sequence lengths, which the
    kernel reads from device memory: decode and verify launches are CUDA-graph capturable.
    num_splits > 1: flash-decoding splits merged by kernels/split_kv.py's combine launch.
    Tokens outside every request are not written."""
    _check_shapes(q_lat, q_pe, latent_cache)
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    bs = seq_lens.shape[0]
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.stride(-1) == 1
    is_decode = query_start_loc is None
    assert not is_decode or (max_query_len == 1 and num_tokens == bs and custom_mask is None)
    plan = mla_launch_plan(bs, max_query_len, num_heads, rank, q_lat.device, num_splits,
                           block_n, max_rows, masked=custom_mask is not None)
    exact_tree = EXACT.attention and custom_mask is not None
    block_m, block_h, num_m_blocks, num_head_blocks, num_splits, block_n = plan
    assert block_n >= MIN_DOT and block_n == next_power_of_2(block_n)
    if out is None:
        out = q_lat.new_empty(num_tokens, num_heads, rank)
    if num_tokens == 0:
        return out
    mid_o, mid_lse, mid_strides = split_buffers(out, num_splits)
    assert custom_mask is None or custom_mask.dtype == torch.bool
    mask = custom_mask.view(torch.uint8) if custom_mask is not None else page_table
    mask_strides = custom_mask.stride() if custom_mask is not None else (0, 0, 0)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
    _mla_attention_kernel[(bs * num_m_blocks, num_head_blocks, num_splits)](
        q_lat, q_pe, latent_cache, out, mid_o, mid_lse,
        seq_lens if is_decode else query_start_loc, seq_lens, page_table, mask,
        scale * LOG2E, num_m_blocks, num_heads, rank, rope,
        custom_mask.shape[-1] if custom_mask is not None else 0,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), *mask_strides,
        *mid_strides,
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=max(next_power_of_2(rank), MIN_DOT), BLOCK_R=max(next_power_of_2(rope), MIN_DOT),
        PAGE_SIZE=latent_cache.shape[1], SPLIT=num_splits > 1, IS_DECODE=is_decode,
        HAS_MASK=custom_mask is not None,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else None,  # keep fp32 exact
        SPLIT_TOKENS=EXACT.kv_split_tokens if EXACT.attention else 0, EXACT_TREE=exact_tree,
        BLOCK_W=next_power_of_2(custom_mask.shape[-1]) if exact_tree else 1,
        **launch,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits(mid_o, mid_lse, out)
    return out


# --------------------------------------------------------------------------------------------
# torch references


def visible_mask(
    q_len: int, seq_len: int, custom_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i may attend KV position j (rules above);
    custom_mask: this request's [>= q_len, W] mask (W > seq_len: its last seq_len columns
    govern the whole KV, as in the kernel)."""
    seen = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if custom_mask is None:
        return seen.tril(diagonal=seq_len - q_len)
    width = custom_mask.shape[-1]
    cols = min(width, seq_len)
    seen[:, seq_len - cols :] = custom_mask[:q_len, width - cols :]
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
    q_lat [T, N, L], q_pe [T, N, R] -> o_lat [T, N, L]; tokens past the last request stay 0.
    Exact mode: each query attends alone over exactly the rows it sees (as
    backends/torch_ref.attend_rowwise), so decode, extend and verify agree bitwise."""
    rank = q_lat.shape[-1]
    out = q_lat.new_zeros(q_lat.shape)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if a == b:
            continue
        rows = gather_latent(latent_cache, page_table[r], seq_len).float()  # [S, L + R]
        c, pe = rows[:, :rank], rows[:, rank:]
        mask = visible_mask(
            b - a, seq_len, None if custom_mask is None else custom_mask[r], q_lat.device
        )
        if EXACT.attention:  # each query alone over the rows it sees, in position order
            for i in range(b - a):
                seen = mask[i].nonzero().squeeze(1)
                s_i = (torch.einsum("hl,sl->hs", q_lat[a + i].float(), c[seen])
                       + torch.einsum("hr,sr->hs", q_pe[a + i].float(), pe[seen])) * scale
                out[a + i] = (s_i.softmax(-1) @ c[seen]).to(out.dtype)
            continue
        scores = (
            torch.einsum("qhl,sl->hqs", q_lat[a:b].float(), c)
            + torch.einsum("qhr,sr->hqs", q_pe[a:b].float(), pe)
        ) * scale
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
