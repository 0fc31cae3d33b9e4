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
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, tl
from specserve.kernels.dsa_index import token_length

BLOCK = 2048  # positions per loop step (8 warps: 8 a thread)
BINS = 256  # one key byte per radix pass
# up to this page-table width (the context limit of a captured graph) the one-program-a-token
# kernel selects; past it a token's scan of up to five passes over its own length runs on one
# SM alone (at 128k, ~320 loop steps), and TritonDSA.select takes torch.topk's multi-block
# radix select over the whole row instead (the work then follows the limit, not the length)
ONE_PROGRAM_MAX_WIDTH = 32768


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
    # pass 1: visible count and the histogram of the top byte (signed -> unsigned order: ^ 128)
    hist = tl.zeros([NUM_BINS], tl.int32)
    num_vis = tl.full([], 0, tl.int32)
    for a in range(0, n, BLOCK_P):
        vis, key = _order_keys(row, a + offs, n)
        byte = ((key >> 24) & 255) ^ 128
        hist += tl.histogram(tl.where(vis, byte, 0), NUM_BINS)
        miss = tl.sum(tl.where(vis, 0, 1), 0)
        hist -= tl.where(bins == 0, miss, 0)  # the lanes counted into bin 0 that are not keys
        num_vis += tl.sum(vis.to(tl.int32), 0)
    # thr: the k-th largest key; ties: how many positions equal to it are taken (lowest first)
    thr = tl.full([], -2147483647 - 1, tl.int32)  # every visible key is >= the smallest int32
    ties = tl.full([], 0, tl.int32) + k
    if num_vis > k:
        d, above = _pick_byte(hist, k, bins)
        rem = k - above
        thr = (d ^ 128) << 24
        for i in tl.static_range(3):
            shift = 16 - 8 * i
            hist = tl.zeros([NUM_BINS], tl.int32)
            for a in range(0, n, BLOCK_P):
                vis, key = _order_keys(row, a + offs, n)
                match = vis & ((key >> (shift + 8)) == (thr >> (shift + 8)))
                hist += tl.histogram(tl.where(match, (key >> shift) & 255, 0), NUM_BINS)
                miss = tl.sum(tl.where(match, 0, 1), 0)
                hist -= tl.where(bins == 0, miss, 0)
            d, above = _pick_byte(hist, rem, bins)
            rem -= above
            thr = thr | (d << shift)
        ties = rem
    # output: selected positions in ascending order, as cache slots
    out_row = out_ptr + t * stride_o
    table_row = table_ptr + req.to(tl.int64) * stride_tab
    written = tl.full([], 0, tl.int32)
    tied = tl.full([], 0, tl.int32)
    for a in range(0, n, BLOCK_P):
        pos = a + offs
        vis, key = _order_keys(row, pos, n)
        eq = (vis & (key == thr)).to(tl.int32)
        take_eq = (tied + tl.cumsum(eq, 0) - eq) < ties
        sel = (vis & (key > thr)) | ((eq != 0) & take_eq)
        sel32 = sel.to(tl.int32)
        at = written + tl.cumsum(sel32, 0) - sel32
        page = tl.load(table_row + pos // PAGE_SIZE, mask=sel, other=0).to(tl.int64)
        tl.store(out_row + at, page * PAGE_SIZE + pos % PAGE_SIZE, mask=sel & (at < k))
        written += tl.sum(sel32, 0)
        tied += tl.sum(eq, 0)
    for a in range(0, k, BLOCK_P):
        j = a + offs
        tl.store(out_row + j, tl.full([BLOCK_P], -1, tl.int64), mask=(j >= written) & (j < k))


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
