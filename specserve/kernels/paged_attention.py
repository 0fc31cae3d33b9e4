"""Triton kernels for attention over the paged KV cache, with their torch references.

Cache layout: k_cache / v_cache [num_pages, page_size, num_kv_heads, head_dim]; logical position
n of request r lives in page page_table[r, n // page_size] at offset n % page_size
(slot = page * page_size + offset).

One attention kernel serves decode (one query per request), extend/prefill (causal) and tree
verify (custom mask). A program owns (request, block of BLOCK_M queries, kv head, KV split). Its
tile rows are the BLOCK_M queries x the GROUP query heads sharing that kv head (GQA), so a K/V
tile is loaded once for the whole group. The KV range is cut into `num_splits` chunks
(flash-decoding): each split writes a partial output with its log-sum-exp and a second kernel
combines them; with `fused_combine=True` the last split program of each tile to finish
combines them instead (an arrival counter per tile, the split-K semaphore pattern), in one
launch. The fused form is not the default: on the H200 it measured slower at batch 1 (its
combining program reads the splits one after another; experiments/2026-11-30-h200-624f8f1.md).
Launch grids depend only on (batch size, heads, max_query_len, num_splits), never on sequence
lengths, which the kernels read from device memory: decode and verify launches are CUDA-graph
capturable. The combine kernel and the split count live in kernels/split_kv.py.

The arrival counters live in one zero-filled int32 buffer per device (`split_counters`), reused
by every launch; each launch leaves it all zeros again (the combining program resets its
counter), which is what a CUDA-graph replay relies on. Launches sharing the buffer must
therefore not run concurrently: the attention kernels are issued on one stream at a time.
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
from specserve.kernels.split_kv import (  # noqa: F401  (MAX_SPLITS, _split_counters: API/tests)
    MAX_SPLITS,
    _split_counters,
    combine_splits,
    default_num_splits,
    split_block,
    split_buffers,
    split_counters,
)

TARGET_ROWS = 64  # tile rows (queries x grouped heads) per extend program
MIN_DOT = 16  # smallest tl.dot dimension on GPUs
DECODE_MAX_SPLITS = 32  # decode launches may split KV further (bs 1 at 8k: 25.9 -> 21.2 us)
SMALL_GRID = 16  # masked launches of at most this many (request, query block, kv head) tiles
LOG2E = 1.4426950408889634
EXACT_BLOCK_N = 64  # KV block of every exact-mode launch (divides EXACT.kv_split_tokens)
PAD_BLOCK = 1 << 20  # a block table's query block past every request: the program does nothing


# --------------------------------------------------------------------------------------------
# attention


# per-step integers (page table and mask widths too) aren't specialized on 1 / multiples of 16
@jit(do_not_specialize=["num_m_blocks", "mask_width", "stride_pt", "stride_mr", "stride_mi"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    query_start_loc_ptr, seq_lens_ptr, page_table_ptr, mask_ptr, block_table_ptr,
    scale_log2, num_m_blocks, mask_width,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_pt, stride_mr, stride_mi, stride_mj,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr, FUSED_COMBINE: tl.constexpr,
    IS_DECODE: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, EXACT_TREE: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_TABLE: tl.constexpr,
):  # fmt: skip
    if BLOCK_TABLE:  # (request, query block) from a table: a grid fixed for a CUDA graph
        req = tl.load(block_table_ptr + 2 * tl.program_id(0))
        m_block = tl.load(block_table_ptr + 2 * tl.program_id(0) + 1)
    else:
        req = tl.program_id(0) // num_m_blocks
        m_block = tl.program_id(0) % num_m_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2) if SPLIT else 1  # at run time: a new count compiles nothing
    if IS_DECODE:
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)

    # tile row i <-> (query qi, head g of the group): i = (qi - m_block * BLOCK_M) * BLOCK_G + g
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    if EXACT_TREE:  # one query per program, in tile slot 0 as a decode's (exact mode)
        qi = m_block + 0 * rows
        row_ok = (rows < BLOCK_G) & (rows % BLOCK_G < GROUP) & (qi < q_len)
    else:
        qi = m_block * BLOCK_M + rows // BLOCK_G  # [ROWS] query index within the request
        row_ok = (qi < q_len) & (rows % BLOCK_G < GROUP)
    head = kv_head * GROUP + rows % BLOCK_G  # [ROWS]
    token = (q_start + qi).to(tl.int64)  # [ROWS] row of q / out
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [ROWS, BLOCK_D]

    # KV positions this query block can see (kernels/attention_tiles.py)
    if EXACT_TREE:  # the query's context in a decode's order: prefix, then its path
        lo, hi, mask_start, on, depth = _tree_range(
            mask_ptr, req, m_block, q_len, seq_len, split, mask_width, stride_mr, stride_mi,
            stride_mj, BLOCK_N, num_splits, SPLIT_TOKENS, BLOCK_W)
    else:
        lo, hi, mask_start = _kv_range(seq_len, q_len, m_block, split, mask_width, BLOCK_M,
                                       BLOCK_N, num_splits, HAS_MASK, SPLIT_TOKENS)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical KV positions
        n_ok = n < hi
        if EXACT_TREE:
            pos = _path_positions(n, mask_start, on, depth, BLOCK_W)
        else:
            pos = n
        page = tl.load(page_table_ptr + req * stride_pt + pos // PAGE_SIZE, mask=n_ok, other=0)
        base = page.to(tl.int64) * stride_kp + (pos % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(
            k_cache_ptr + base[:, None] + d[None, :],
            mask=n_ok[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        # V is issued before the scores are computed: both loads are in flight together
        base_v = page.to(tl.int64) * stride_vp + (pos % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(
            v_cache_ptr + base_v[:, None] + dv[None, :],
            mask=n_ok[:, None] & (dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
        if EXACT_TREE:  # every virtual position below hi is on the path
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
        else:
            qk = _mask_scores(qk, n, n_ok, qi, row_ok, mask_start, mask_ptr, req, stride_mr,
                              stride_mi, stride_mj, HAS_MASK)
        p, alpha, l_i, m_i = _softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    o, lse = _normalize(acc, m_i, l_i)  # a row that saw nothing outputs 0
    o_mask = row_ok[:, None] & (dv[None, :] < HEAD_DIM_V)
    if not SPLIT:
        dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        mid = token * stride_mot + head * stride_moh  # [ROWS]
        lse_row = token * stride_mlt + head * stride_mlh  # [ROWS]
        tl.store(mid_o_ptr + mid[:, None] + split * stride_mos + dv[None, :], o, mask=o_mask)
        tl.store(mid_lse_ptr + lse_row + split, lse, mask=row_ok)
        if FUSED_COMBINE:
            # Every split of the tile (an empty KV range included) counts its arrival; the last
            # one combines all the splits. A scalar atomic is issued by one thread: the barrier
            # orders the whole CTA's stores above before that thread's release, and its acquire
            # reaches the other threads through the barrier that broadcasts the atomic's result.
            tl.debug_barrier()
            counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                # as _combine_splits_kernel: out = sum_s w_s * o_s / sum_s w_s with
                # w_s = 2^(lse_s - max lse); rows whose lse are all -inf output 0. Loads skip
                # L1 (.cg): the other splits' data was written by other SMs during this launch.
                s = tl.arange(0, BLOCK_S)
                lse_all = tl.load(
                    mid_lse_ptr + lse_row[:, None] + s[None, :],
                    mask=row_ok[:, None] & (s[None, :] < num_splits),
                    other=float("-inf"),
                    cache_modifier=".cg",
                )  # [ROWS, BLOCK_S]
                lse_max = tl.max(lse_all, 1)
                w_all = tl.exp2(lse_all - tl.where(lse_max == float("-inf"), 0.0, lse_max)[:, None])
                total = tl.sum(w_all, 1)  # [ROWS]
                o_sum = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
                for si in range(num_splits):
                    w = tl.sum(tl.where(s[None, :] == si, w_all, 0.0), 1)  # [ROWS]
                    o_s = tl.load(
                        mid_o_ptr + mid[:, None] + si * stride_mos + dv[None, :],
                        mask=o_mask & (w[:, None] > 0),
                        other=0.0,
                        cache_modifier=".cg",
                    )  # [ROWS, BLOCK_DV]
                    o_sum += o_s * w[:, None]
                o_sum = o_sum / tl.where(total > 0, total, 1.0)[:, None]
                dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
                tl.store(dst, o_sum.to(out_ptr.dtype.element_ty), mask=o_mask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch


def launch_plan(bs: int, max_query_len: int, group: int, num_kv_heads: int, masked: bool,
                device: torch.device, num_splits: int | None = None, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> tuple:
    """(block_m, num_m_blocks, num_splits, block_n, num_warps, num_stages) of an attention
    launch, each None argument replaced by its default (num_warps / num_stages may stay None:
    Triton's own). Tile rows are queries x grouped heads: at least MIN_DOT, about TARGET_ROWS
    for longer queries. Decode launches (one query, no mask) read KV blocks of 128 and split up
    to DECODE_MAX_SPLITS ways (H100, 8k context: bs 64 843 -> 717 us, bs 1 25.9 -> 21.2 us;
    experiments/2026-12-06-decode-attention-policy-exact.md). Under a custom mask (tree or
    chain verify) KV blocks of 128 without software pipelining, and 8 warps over at most
    SMALL_GRID tiles, measured fastest on the H200 (q_len 16 tree at batch 1: 23.3 -> 13.8
    us, batch 16: 94 -> 56 us; q_len 4: 12.0 -> 9.0 us; scripts/bench_attention.py,
    experiments/2026-11-30-attention-sweep.json)."""
    block_g = next_power_of_2(group)
    if EXACT.attention:
        return exact_launch_plan(bs, max_query_len, group, num_kv_heads, masked)
    block_m = min(next_power_of_2(max_query_len), max(1, TARGET_ROWS // block_g))
    block_m = max(block_m, MIN_DOT // block_g, 1)
    num_m_blocks = math.ceil(max_query_len / block_m)
    tiles = bs * num_m_blocks * num_kv_heads
    decode = max_query_len == 1 and not masked
    if num_splits is None:
        num_splits = default_num_splits(tiles, device, DECODE_MAX_SPLITS if decode else MAX_SPLITS)
    if block_n is None:
        block_n = 128 if masked or decode else 64
    if num_stages is None and masked:
        num_stages = 1
    if num_warps is None and masked and tiles <= SMALL_GRID:
        num_warps = 8
    return block_m, num_m_blocks, num_splits, block_n, num_warps, num_stages


def query_block_size(bs: int, max_query_len: int, group: int, num_kv_heads: int) -> int:
    """Queries per program of an unmasked launch (a block table's unit)."""
    return launch_plan(bs, max_query_len, group, num_kv_heads, False, None, 1)[0]


def exact_launch_plan(bs: int, max_query_len: int, group: int, num_kv_heads: int,
                      masked: bool = False) -> tuple:
    """The exact-mode plan: one tile shape (TARGET_ROWS rows, KV blocks of EXACT_BLOCK_N, 4
    warps, 2 stages) for decode, extend and verify alike, and a split count fixed by the engine
    (each split EXACT.kv_split_tokens long, enough of them for the longest context): a query
    row's KV blocks, their reduction order and the combine's are those of the same row in any
    other launch. The tile is an extend's (a prefill chunk keeps the default plan's tile rows;
    MIN_DOT-row tiles re-read a chunk's KV 4x as often on small MMAs); a decode fills a
    group's rows of it, still bound by the KV it reads. Under a custom mask (tree verify) each
    program takes one query, which reads its path at the positions a decode of the same token
    would (EXACT_TREE)."""
    block_m = max(TARGET_ROWS // next_power_of_2(group), 1)
    num_m_blocks = max_query_len if masked else math.ceil(max_query_len / block_m)
    return block_m, num_m_blocks, EXACT.kv_splits, EXACT_BLOCK_N, 4, 2


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim_v]
    query_start_loc: torch.Tensor | None,  # [bs + 1] int32; None: decode (one query each)
    seq_lens: torch.Tensor,  # [bs] int32, KV length including the new tokens
    page_table: torch.Tensor,  # [bs, max_pages] int32
    max_query_len: int,
    scale: float,
    custom_mask: torch.Tensor | None = None,  # [bs, max_query_len, W] bool, W >= max_query_len
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim_v]
    num_splits: int | None = None,
    block_n: int | None = None,
    fused_combine: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_table: torch.Tensor | None = None,  # [NB, 2] int32 (request, query block)
) -> torch.Tensor:
    """Attention of T new query tokens over the paged KV (already holding their K/V).

    The new tokens are the last q_len of each request's KV. Causal: query i sees KV
    [0, seq_len - q_len + i]. With `custom_mask` of width W: query i sees [0, seq_len - W) plus
    KV position seq_len - W + j iff custom_mask[r, i, j]. `query_start_loc=None` means decode:
    request r owns token r. Tokens outside every request's query range are not written.
    With num_splits > 1 the splits are merged by a second launch, or with `fused_combine` inside
    the attention launch (the last split of each tile to finish does it).
    `block_n` / `num_warps` / `num_stages` tune the attention launch (defaults: launch_plan);
    the combine launch keeps its defaults. `block_table` (no custom mask): the launch has one
    program per entry (request r, query block m of `query_block_size` queries; PAD_BLOCK as m:
    nothing) instead of one per (request, query block up to max_query_len): a CUDA graph
    captured for T tokens over R rows launches T / block + R programs, not R * T / block.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads, head_dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    bs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    is_decode = query_start_loc is None
    assert not is_decode or (max_query_len == 1 and num_tokens == bs and custom_mask is None)
    group = num_heads // num_kv_heads
    plan = launch_plan(bs, max_query_len, group, num_kv_heads, custom_mask is not None, q.device,
                       num_splits, block_n, num_warps, num_stages)
    block_m, num_m_blocks, num_splits, block_n, num_warps, num_stages = plan
    assert block_table is None or (custom_mask is None and not is_decode)
    grid_m = bs * num_m_blocks if block_table is None else block_table.shape[0]
    grid_programs = grid_m * num_kv_heads
    assert block_n >= MIN_DOT and block_n == next_power_of_2(block_n)
    if out is None:
        out = q.new_empty(num_tokens, num_heads, head_dim_v)
    if num_tokens == 0:
        return out
    mid_o, mid_lse, mid_strides = split_buffers(out, num_splits)
    counters = seq_lens  # unused unless the splits are combined in the attention launch
    fused = fused_combine and num_splits > 1
    if fused:
        counters = split_counters(grid_programs, q.device)
    assert custom_mask is None or custom_mask.dtype == torch.bool
    mask = custom_mask.view(torch.uint8) if custom_mask is not None else page_table
    mask_strides = custom_mask.stride() if custom_mask is not None else (0, 0, 0)
    mask_width = custom_mask.shape[-1] if custom_mask is not None else 0
    exact_tree = EXACT.attention and custom_mask is not None
    launch: dict[str, int] = {}  # only what was asked: None keeps Triton's defaults
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    _paged_attention_kernel[(grid_m, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, counters,
        seq_lens if is_decode else query_start_loc, seq_lens, page_table, mask,
        page_table if block_table is None else block_table,
        scale * LOG2E, num_m_blocks, mask_width,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        page_table.stride(0), *mask_strides,
        *mid_strides,
        GROUP=group, BLOCK_G=next_power_of_2(group), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=max(next_power_of_2(head_dim), MIN_DOT),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=next_power_of_2(head_dim_v),
        SPLIT=num_splits > 1, BLOCK_S=split_block(num_splits), FUSED_COMBINE=fused,
        IS_DECODE=is_decode, HAS_MASK=custom_mask is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # keep fp32 exact
        SPLIT_TOKENS=EXACT.kv_split_tokens if EXACT.attention else 0,
        EXACT_TREE=exact_tree, BLOCK_W=next_power_of_2(mask_width) if exact_tree else 1,
        BLOCK_TABLE=block_table is not None, **launch,
    )  # fmt: skip
    if num_splits > 1 and not fused:
        combine_splits(mid_o, mid_lse, out)
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [bs, num_heads, head_dim], one query per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [bs] int32
    page_table: torch.Tensor,  # [bs, max_pages] int32
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    fused_combine: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Flash-decoding: one query token per request over its paged KV."""
    return paged_attention(
        q, k_cache, v_cache, None, seq_lens, page_table, 1, scale, out=out, num_splits=num_splits,
        fused_combine=fused_combine, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [bs + 1]
    seq_lens: torch.Tensor,  # [bs]
    page_table: torch.Tensor,  # [bs, max_pages]
    scale: float,
    custom_mask: torch.Tensor | None = None,  # [bs, max_query_len, W] bool
) -> torch.Tensor:
    """Reference: per request, gather its pages, build the mask densely, softmax in fp32."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[3])
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_r = q[starts[r] : starts[r + 1]].float()  # [q_len, H, D]
        q_len = q_r.shape[0]
        pages = page_table[r, : math.ceil(seq_len / page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        seen = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        if custom_mask is None:  # query i sits at position seq_len - q_len + i
            seen = seen.tril(diagonal=seq_len - q_len)
        else:  # the mask's W columns govern the last W positions
            cols = min(custom_mask.shape[-1], seq_len)
            seen[:, seq_len - cols :] = custom_mask[r, :q_len, custom_mask.shape[-1] - cols :]
        scores = torch.einsum("qhd,khd->hqk", q_r, k) * scale
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
