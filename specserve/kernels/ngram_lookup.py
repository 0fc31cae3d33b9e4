"""Prompt-lookup matching on the GPU over a paged token history, reading only each request's
own tokens.

The torch form (speculative/ngram.py: ngram_match over a gathered [bs, page_table width *
page_size] copy) has static shapes for CUDA graphs, so every cycle reads and compares the whole
context limit of every row, whatever the requests' lengths: at a 128k limit and batch 64 that
is ~8M tokens gathered and compared prompt_lookup_max times per cycle. This kernel keeps the
static grid (rows x chunks of the limit) but a chunk past its row's length does no memory
traffic, and inside a chunk a position stops loading once its n-gram stopped matching: the
work follows the requests' real lengths (vLLM's CPU matcher is O(length) the same way).

Rule (the same as ngram_match): for each row, the end e < length - 1 of the most recent
occurrence of its last n tokens, for each n in [lo, hi]; the caller takes the largest n with
one. The sequence is t_1 .. t_P, position j at history[slot(j)], except position P - 1 (the
cycle's root token, not yet in the history), given by root_tokens.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, tl, triton

CHUNK = 1024  # end positions per program


@jit
def _token_at(hist_ptr, table_row, pos, ok, PAGE_SIZE: tl.constexpr):
    """Tokens at sequence positions `pos` (all below the root's, P - 1) where `ok`, else -1."""
    safe = tl.where(ok, pos, 0)
    page = tl.load(table_row + safe // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return tl.load(hist_ptr + page * PAGE_SIZE + safe % PAGE_SIZE, mask=ok, other=-1)


# the page-table width (stride_t, num_chunks) changes from step to step in eager cycles:
# specialized on it, each new value class (1, a multiple of 16, other) would compile anew
@jit(do_not_specialize=["stride_t", "num_chunks"])
def _ngram_ends_kernel(
    hist_ptr, table_ptr, stride_t, root_pos_ptr, root_tok_ptr, length_ptr, out_ptr, num_chunks,
    PAGE_SIZE: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, CHUNK_ENDS: tl.constexpr,
):  # fmt: skip
    # out[row, chunk, n - LO]: the largest end in this chunk whose last n tokens match the
    # row's last n tokens (-1: none)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    table_row = table_ptr + row.to(tl.int64) * stride_t
    length = tl.load(length_ptr + row)
    root_at = tl.load(root_pos_ptr + row) - 1
    root_tok = tl.load(root_tok_ptr + row)
    ends = chunk * CHUNK_ENDS + tl.arange(0, CHUNK_ENDS)
    match = ends < length - 1  # at least one token follows the occurrence
    out = out_ptr + (row * num_chunks + chunk) * (HI - LO + 1)
    for i in tl.static_range(HI):
        at = length - 1 - i  # the suffix's token i from the end
        # a scalar load, unmasked: position max(at, 0) is within the row's pages (a skipped
        # row's table still points at a page)
        at_ok = tl.maximum(at, 0)
        page = tl.load(table_row + at_ok // PAGE_SIZE).to(tl.int64)
        tail = tl.load(hist_ptr + page * PAGE_SIZE + at_ok % PAGE_SIZE)
        tail = tl.where(at == root_at, root_tok, tail)
        tail = tl.where(at >= 0, tail, -3)  # the row is shorter than i + 1: no token equals -3
        pos = ends - i
        match = match & (pos >= 0)
        tok = _token_at(hist_ptr, table_row, pos, match, PAGE_SIZE)  # pos <= ends < P - 1
        match = match & (tok == tail)
        if i + 1 >= LO:
            tl.store(out + (i + 1 - LO), tl.max(tl.where(match, ends, -1), 0))


def ngram_ends(history: torch.Tensor, page_table: torch.Tensor, page_size: int,
               root_pos: torch.Tensor, root_tokens: torch.Tensor, length: torch.Tensor,
               lo: int, hi: int) -> torch.Tensor:
    """[bs] end index of the chosen occurrence (largest n in [lo, hi] with one, then the most
    recent), -1 without one. history [slots] int64 (the token after each position's slot);
    page_table [bs, W] int32; root_pos [bs] (P), root_tokens [bs]; length [bs] <= P (0 for a
    row to skip). Static shapes: graph-capturable."""
    bs, width = page_table.shape
    num_chunks = triton.cdiv(width * page_size, CHUNK)
    ends = torch.empty(bs, num_chunks, hi - lo + 1, dtype=torch.int32, device=history.device)
    if bs:
        _ngram_ends_kernel[(bs, num_chunks)](
            history, page_table, page_table.stride(0), root_pos.to(torch.int32).contiguous(),
            root_tokens.long().contiguous(), length.to(torch.int32).contiguous(), ends,
            num_chunks, PAGE_SIZE=page_size, LO=lo, HI=hi, CHUNK_ENDS=CHUNK,
        )  # fmt: skip
    per_n = ends.amax(dim=1).long()  # [bs, n] most recent end for each n
    best = torch.full((bs,), -1, dtype=torch.long, device=history.device)
    for j in range(hi - lo + 1):  # longer n overrides shorter
        best = torch.where(per_n[:, j] >= 0, per_n[:, j], best)
    return best
