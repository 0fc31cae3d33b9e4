"""DeepSeek sparse attention (DSA): the top-k choice over the indexer's scores as one Triton
launch whose work follows each request's length, not the page table's width.

The torch form (kernels/dsa_index.py: select_slots) ranks every column of the [T, width]
scores, and width is a captured graph's page-table width, i.e. the context limit (202752
positions for GLM-5): per layer and step it built int64 keys over the whole row and ran
torch.topk(2048) on them, a dozen launches whatever the context (~0.1 ms a layer on an H200,
the same at 1k and 8k). Here one program per query token reads its request's first seq_len
scores only (the scores kernel writes no further):

    pass 1      count the visible positions (score > -inf) and histogram the top byte of
                their order-preserving keys; if at most k are visible, take them all
    passes 2-4  radix select: each pass fixes one more byte of the k-th largest key, among the
                positions whose higher bytes equal the bytes fixed so far
    output      positions with a larger key, then the equal ones from the lowest position up,
                written in ascending position order; -1 after them

Keys are the float32 score bits made order-preserving as signed int32 (negative floats'
magnitude bits flipped; -0.0 first made +0.0), so equal scores tie exactly and the tie goes to
the lower position, as in select_slots. The selected set is select_slots's; the order is
canonical (ascending position), so a decode and a verify of the same token, or a row alone and
in a batch, attend over the same slots in the same order.

One program scans a token's row alone, so its time grows with the length (~0.6 ms at 128k
positions on an H100, 3x torch.topk's); past a 32k context limit `select_slots_split` spreads
each token's positions over up to 64 programs, the same passes as separate launches that add
their histograms atomically (below).
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, tl
from specserve.kernels.dsa_index import token_length

BLOCK = 2048  # positions per loop step (8 warps: 8 a thread)
BINS = 256  # one key byte per radix pass
# up to this page-table width (the context limit of a captured graph) one program a token
# selects in one launch (on an H100 ~4.5 us per 1k positions of the token's length: 0.6 ms at
# 128k, where torch.topk over the row takes 0.2); past it `select_slots_split` spreads each
# token's positions over programs (several launches; the work still follows the length)
ONE_PROGRAM_MAX_WIDTH = 32768
SPLIT_CHUNK = 4096  # the split form: one program per this many positions of the width
SPLIT_MAX_PROGRAMS = 64
PASSES = 4  # key bytes
# the same as kernel constants (a kernel reads module globals only as tl.constexpr)
_PASSES = tl.constexpr(PASSES) if tl is not None else PASSES
_INT32_MIN = tl.constexpr(-2147483647 - 1) if tl is not None else None


@jit
def _order_keys(row_ptr, pos, n):
    """Scores at `pos` (< n) -> (visible, signed order-preserving int32 keys)."""
    s = tl.load(row_ptr + pos, mask=pos < n, other=float("-inf"))
    vis = s > float("-inf")
    bits = (s + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0
    return vis, bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _pick_byte(hist, rem, bins):
    """The byte value d whose positions hold the rem-th largest key (counting down from the
    largest byte), and how many positions have a larger byte."""
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # positions with byte >= d
    d = tl.max(tl.where(ge >= rem, bins, -1), 0)
    above = tl.sum(tl.where(bins == d, ge - hist, 0), 0)
    return d, above


@jit
def _chunk_hist(row, lo, hi, thr, offs, bins, SHIFT: tl.constexpr, BLOCK_P: tl.constexpr,
                NUM_BINS: tl.constexpr):  # fmt: skip
    """Histogram of the key byte at SHIFT over the visible positions in [lo, hi) whose higher
    bytes equal thr's (SHIFT 24: every visible position, the top byte's sign flipped so that
    bins run in key order)."""
    hist = tl.zeros([NUM_BINS], tl.int32)
    for a in range(lo, hi, BLOCK_P):
        vis, key = _order_keys(row, a + offs, hi)
        if SHIFT == 24:
            match = vis
            byte = ((key >> 24) & 255) ^ 128
        else:
            match = vis & ((key >> (SHIFT + 8)) == (thr >> (SHIFT + 8)))
            byte = (key >> SHIFT) & 255
        hist += tl.histogram(tl.where(match, byte, 0), NUM_BINS)
        miss = tl.sum(tl.where(match, 0, 1), 0)
        hist -= tl.where(bins == 0, miss, 0)  # the lanes counted into bin 0 that are not keys
    return hist


@jit
def _replay(hist_row, k, bins, NUM: tl.constexpr, NUM_BINS: tl.constexpr):
    """The key bytes the first NUM passes' histograms (hist_row: [PASSES, NUM_BINS]) fix:
    (thr with those bytes, how many of the k are still to take among the keys that share
    them)."""
    d, above = _pick_byte(tl.load(hist_row + bins), k, bins)
    rem = k - above
    thr = (d ^ 128) << 24
    for i in tl.static_range(1, NUM):
        d, above = _pick_byte(tl.load(hist_row + i * NUM_BINS + bins), rem, bins)
        rem -= above
        thr = thr | (d << (24 - 8 * i))
    return thr, rem


@jit
def _write_chunk(row, out_row, table_row, lo, hi, k, thr, ties, written, tied, offs,
                 PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """Write the selected positions of [lo, hi) (keys above thr, and keys equal to it while
    fewer than `ties` equal ones precede) as cache slots from out_row[written] on, in
    ascending order; `tied`: the equal keys before lo. -> written after them."""
    for a in range(lo, hi, BLOCK_P):
        pos = a + offs
        vis, key = _order_keys(row, pos, hi)
        eq = (vis & (key == thr)).to(tl.int32)
        take_eq = (tied + tl.cumsum(eq, 0) - eq) < ties
        sel = (vis & (key > thr)) | ((eq != 0) & take_eq)
        sel32 = sel.to(tl.int32)
        at = written + tl.cumsum(sel32, 0) - sel32
        page = tl.load(table_row + pos // PAGE_SIZE, mask=sel, other=0).to(tl.int64)
        tl.store(out_row + at, page * PAGE_SIZE + pos % PAGE_SIZE, mask=sel & (at < k))
        written += tl.sum(sel32, 0)
        tied += tl.sum(eq, 0)
    return written


@jit
def _fill_tail(out_row, written, k, offs, BLOCK_P: tl.constexpr):
    for a in range(0, k, BLOCK_P):
        j = a + offs
        tl.store(out_row + j, tl.full([BLOCK_P], -1, tl.int64), mask=(j >= written) & (j < k))


@jit
def _select_kernel(
    scores_ptr, out_ptr, req_ptr, seq_lens_ptr, table_ptr, bs, k,
    stride_s, stride_o, stride_tab,
    PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    req, n = token_length(req_ptr, seq_lens_ptr, t, bs)  # nothing visible at or past n
    row = scores_ptr + t * stride_s
    offs = tl.arange(0, BLOCK_P)
    bins = tl.arange(0, NUM_BINS)
    # thr: the k-th largest key; ties: how many positions equal to it are taken (lowest first)
    thr = tl.full([], _INT32_MIN, tl.int32)  # every visible key is >= the smallest int32
    ties = tl.full([], 0, tl.int32) + k
    # pass 1: the histogram of the top byte, whose sum is the visible count
    hist = _chunk_hist(row, 0, n, thr, offs, bins, 24, BLOCK_P, NUM_BINS)
    if tl.sum(hist, 0) > k:
        d, above = _pick_byte(hist, k, bins)
        rem = k - above
        thr = (d ^ 128) << 24
        for i in tl.static_range(1, _PASSES):
            hist = _chunk_hist(row, 0, n, thr, offs, bins, 24 - 8 * i, BLOCK_P, NUM_BINS)
            d, above = _pick_byte(hist, rem, bins)
            rem -= above
            thr = thr | (d << (24 - 8 * i))
        ties = rem
    # output: selected positions in ascending order, as cache slots
    out_row = out_ptr + t * stride_o
    table_row = table_ptr + req.to(tl.int64) * stride_tab
    zero = tl.full([], 0, tl.int32)
    written = _write_chunk(row, out_row, table_row, 0, n, k, thr, ties, zero, zero, offs,
                           PAGE_SIZE, BLOCK_P)  # fmt: skip
    _fill_tail(out_row, written, k, offs, BLOCK_P)


def select_slots_fast(
    scores: torch.Tensor,
    k: int,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """select_slots's set of cache slots, in ascending position order: scores [T, width] fp32
    (-inf: not visible; read only below each token's request length seq_lens[token_req[t]]),
    token_req [T] (bs: a padding token) -> [T, k] int64, -1 after the selected ones. One
    launch, static shapes (CUDA-graph safe)."""
    num_tokens = scores.shape[0]
    assert k <= scores.shape[1] and scores.stride(-1) == 1, (k, scores.shape)
    out = torch.empty(num_tokens, k, dtype=torch.int64, device=scores.device)
    if num_tokens:
        _select_kernel[(num_tokens,)](
            scores, out, token_req, seq_lens, page_table, seq_lens.shape[0], k,
            scores.stride(0), out.stride(0), page_table.stride(0),
            PAGE_SIZE=page_size, BLOCK_P=BLOCK, NUM_BINS=BINS, num_warps=8,
        )  # fmt: skip
    return out


# -- the split form: a token's positions over several programs ------------------------------
#
#   pass launches 1-4   each program histograms one key byte over its chunk of the token's
#                       length into the token's [PASSES, BINS] counts (atomic adds); a pass
#                       first replays the bytes the earlier passes fixed (the same choice in
#                       every program), and stops if at most k positions are visible
#   count launch        each program counts its chunk's keys above and equal to the k-th
#   output launch       each program writes its chunk's selection at the offset the counts of
#                       the chunks before it give (equal keys: the lowest positions first);
#                       program 0 writes the -1 tail


@jit
def _split_program(req_ptr, seq_lens_ptr, bs, BLOCK_P: tl.constexpr):
    """This program's (token t, chunk p, request, positions [lo, hi)): the token's length cut
    into equal chunks of whole loop steps, one a program."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    req, n = token_length(req_ptr, seq_lens_ptr, t, bs)
    chunk = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK_P) * BLOCK_P
    lo = p * chunk
    return t, p, req, lo, tl.minimum(lo + chunk, n)


@jit
def _threshold(hist_row, k, bins, NUM_BINS: tl.constexpr):
    """(k-th largest key, equal keys to take) from all passes' counts; every visible
    position (thr the smallest int32) where at most k are visible."""
    thr = tl.full([], _INT32_MIN, tl.int32)
    ties = tl.full([], 0, tl.int32) + k
    if tl.sum(tl.load(hist_row + bins), 0) > k:
        thr, ties = _replay(hist_row, k, bins, _PASSES, NUM_BINS)
    return thr, ties


@jit
def _split_pass_kernel(
    scores_ptr, hist_ptr, req_ptr, seq_lens_ptr, bs, k, stride_s, stride_h,
    PASS: tl.constexpr, BLOCK_P: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    t, p, req, lo, hi = _split_program(req_ptr, seq_lens_ptr, bs, BLOCK_P)
    hist_row = hist_ptr + t * stride_h
    bins = tl.arange(0, NUM_BINS)
    thr = tl.full([], 0, tl.int32)
    go = lo < hi
    if PASS > 0:  # nothing to refine where every visible position is taken
        go = go & (tl.sum(tl.load(hist_row + bins), 0) > k)
        thr, _ = _replay(hist_row, k, bins, PASS, NUM_BINS)
    if go:
        hist = _chunk_hist(scores_ptr + t * stride_s, lo, hi, thr, tl.arange(0, BLOCK_P), bins,
                           24 - 8 * PASS, BLOCK_P, NUM_BINS)  # fmt: skip
        tl.atomic_add(hist_row + PASS * NUM_BINS + bins, hist)


@jit
def _split_count_kernel(
    scores_ptr, hist_ptr, counts_ptr, req_ptr, seq_lens_ptr, bs, k, stride_s, stride_h,
    stride_c, BLOCK_P: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    t, p, req, lo, hi = _split_program(req_ptr, seq_lens_ptr, bs, BLOCK_P)
    thr, _ = _threshold(hist_ptr + t * stride_h, k, tl.arange(0, NUM_BINS), NUM_BINS)
    row = scores_ptr + t * stride_s
    offs = tl.arange(0, BLOCK_P)
    above = tl.full([], 0, tl.int32)
    equal = tl.full([], 0, tl.int32)
    for a in range(lo, hi, BLOCK_P):
        vis, key = _order_keys(row, a + offs, hi)
        above += tl.sum((vis & (key > thr)).to(tl.int32), 0)
        equal += tl.sum((vis & (key == thr)).to(tl.int32), 0)
    tl.store(counts_ptr + t * stride_c + 2 * p, above)
    tl.store(counts_ptr + t * stride_c + 2 * p + 1, equal)


@jit
def _split_out_kernel(
    scores_ptr, hist_ptr, counts_ptr, out_ptr, req_ptr, seq_lens_ptr, table_ptr, bs, k,
    stride_s, stride_h, stride_c, stride_o, stride_tab,
    PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, NUM_BINS: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr,
):  # fmt: skip
    t, p, req, lo, hi = _split_program(req_ptr, seq_lens_ptr, bs, BLOCK_P)
    thr, ties = _threshold(hist_ptr + t * stride_h, k, tl.arange(0, NUM_BINS), NUM_BINS)
    progs = tl.arange(0, MAX_PROGRAMS)
    live = progs < tl.num_programs(1)
    counts = counts_ptr + t * stride_c + 2 * progs
    above = tl.load(counts, mask=live, other=0)
    equal = tl.load(counts + 1, mask=live, other=0)
    tied = tl.sum(tl.where(progs < p, equal, 0), 0)  # equal keys in the chunks before
    written = tl.sum(tl.where(progs < p, above, 0), 0) + tl.minimum(tied, ties)
    out_row = out_ptr + t * stride_o
    offs = tl.arange(0, BLOCK_P)
    table_row = table_ptr + req.to(tl.int64) * stride_tab
    _write_chunk(scores_ptr + t * stride_s, out_row, table_row, lo, hi, k, thr, ties, written,
                 tied, offs, PAGE_SIZE, BLOCK_P)  # fmt: skip
    if p == 0:
        total = tl.sum(above, 0) + tl.minimum(tl.sum(equal, 0), ties)
        _fill_tail(out_row, total, k, offs, BLOCK_P)


def split_programs(width: int) -> int:
    """Programs a token for the split form at this page-table width."""
    return max(1, min(SPLIT_MAX_PROGRAMS, -(-width // SPLIT_CHUNK)))


def select_slots_split(
    scores: torch.Tensor,
    k: int,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    programs: int | None = None,
    block: int = BLOCK,
) -> torch.Tensor:
    """select_slots_fast's answer with each token's positions spread over `programs`
    programs (split_programs(width) by default): six launches and a zero fill, static shapes
    (CUDA-graph safe); a program's chunk follows its token's length."""
    num_tokens, width = scores.shape
    assert k <= width and scores.stride(-1) == 1, (k, scores.shape)
    programs = programs or split_programs(width)
    out = torch.empty(num_tokens, k, dtype=torch.int64, device=scores.device)
    if not num_tokens:
        return out
    hist = torch.zeros(num_tokens, PASSES, BINS, dtype=torch.int32, device=scores.device)
    counts = torch.empty(num_tokens, programs, 2, dtype=torch.int32, device=scores.device)
    grid = (num_tokens, programs)
    bs = seq_lens.shape[0]
    for i in range(PASSES):
        _split_pass_kernel[grid](
            scores, hist, token_req, seq_lens, bs, k, scores.stride(0), hist.stride(0),
            PASS=i, BLOCK_P=block, NUM_BINS=BINS, num_warps=8,
        )  # fmt: skip
    _split_count_kernel[grid](
        scores, hist, counts, token_req, seq_lens, bs, k, scores.stride(0), hist.stride(0),
        counts.stride(0), BLOCK_P=block, NUM_BINS=BINS, num_warps=8,
    )  # fmt: skip
    _split_out_kernel[grid](
        scores, hist, counts, out, token_req, seq_lens, page_table, bs, k, scores.stride(0),
        hist.stride(0), counts.stride(0), out.stride(0), page_table.stride(0),
        PAGE_SIZE=page_size, BLOCK_P=block, NUM_BINS=BINS,
        MAX_PROGRAMS=max(2, 1 << (programs - 1).bit_length()), num_warps=8,
    )  # fmt: skip
    return out
