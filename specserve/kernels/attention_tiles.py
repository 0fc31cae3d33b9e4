"""Pieces of one flash-attention program shared by the paged MHA kernel
(kernels/paged_attention.py) and the MLA kernel (kernels/mla_attention.py): which KV positions
a (query block, KV split) program reads, the causal or custom mask on a score tile, the online
softmax step, and the final normalisation. Triton inlines them: each kernel compiles as if
written out.

Masking (layers/attention_metadata.py): the new tokens of a request are the last q_len of its
KV. Causal: query i sees [0, seq_len - q_len + i]. Custom mask of width W: query i sees
[0, seq_len - W) plus position seq_len - W + j iff mask[req, i, j].
"""

from __future__ import annotations

from specserve.kernels.dispatch import jit, tl


@jit
def _kv_range(
    seq_len,
    q_len,
    m_block,
    split,
    mask_width,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    HAS_MASK: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
):
    """(lo, hi, mask_start): the KV positions [lo, hi) of this program's split, and the first
    position the mask governs (the causal diagonal's origin without a custom mask). Causal
    ranges stop at the query block's last query; a block past q_len reads nothing. SPLIT_TOKENS
    > 0 (exact mode) fixes each split's length, so a KV position falls in the same split and
    the same BLOCK_N block whatever the batch, the query length and the query block."""
    if HAS_MASK:
        kv_end = seq_len
        mask_start = seq_len - mask_width
    else:
        kv_end = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)
        mask_start = seq_len - q_len
    kv_end = tl.where(m_block * BLOCK_M < q_len, kv_end, 0)
    lo, hi = _split_range(kv_end, split, BLOCK_N, num_splits, SPLIT_TOKENS)
    return lo, hi, mask_start


@jit
def _split_range(
    kv_end,
    split,
    BLOCK_N: tl.constexpr,
    num_splits,
    SPLIT_TOKENS: tl.constexpr,
):
    """[lo, hi): split `split` of the KV positions [0, kv_end), num_splits equal splits in
    whole BLOCK_N blocks, or splits of SPLIT_TOKENS each (exact mode). The split count is a
    runtime value (the launch grid's third axis): a new count compiles nothing."""
    if SPLIT_TOKENS > 0:
        split_len = SPLIT_TOKENS
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    return lo, tl.minimum(lo + split_len, kv_end)


@jit
def _tree_range(
    mask_ptr, req, m_block, q_len, seq_len, split, mask_width, stride_mr, stride_mi, stride_mj,
    BLOCK_N: tl.constexpr, num_splits, SPLIT_TOKENS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Exact-mode tree verify, one query (m_block) per program: (lo, hi, mask_start, on,
    depth). The query reads its context as a decode of its token would: the prefix [0,
    mask_start), then its path (the set nodes of its mask row, its ancestors and itself:
    parents precede children, so node order is depth order) at virtual positions mask_start +
    depth; [lo, hi) is this split of that virtual range, `on` / `depth` [BLOCK_W] the path."""
    mask_start = seq_len - mask_width
    w = tl.arange(0, BLOCK_W)
    on = tl.load(mask_ptr + req * stride_mr + m_block * stride_mi + w * stride_mj,
                 mask=w < mask_width, other=0) != 0
    ones = on.to(tl.int32)
    kv_end = tl.where(m_block < q_len, mask_start + tl.sum(ones, 0), 0)
    lo, hi = _split_range(kv_end, split, BLOCK_N, num_splits, SPLIT_TOKENS)
    return lo, hi, mask_start, on, tl.cumsum(ones, 0) - 1


@jit
def _path_positions(n, mask_start, on, depth, BLOCK_W: tl.constexpr):
    """Physical KV positions of the virtual positions n [BLOCK_N] of a tree query that reads
    its context as a decode of the same token would: the prefix [0, mask_start) as it is, then
    its path in depth order at mask_start + depth (the nodes sit at mask_start + node)."""
    w = tl.arange(0, BLOCK_W)
    k = n - mask_start  # depth along the path (< 0: the prefix)
    hit = on[None, :] & (depth[None, :] == k[:, None])  # [BLOCK_N, BLOCK_W]
    node = tl.sum(tl.where(hit, w[None, :], 0), 1)
    return tl.where(k < 0, n, mask_start + node)


@jit
def _mask_scores(
    qk,
    n,
    n_ok,
    qi,
    row_ok,
    mask_start,
    mask_ptr,
    req,
    stride_mr,
    stride_mi,
    stride_mj,
    HAS_MASK: tl.constexpr,
):
    """qk [ROWS, BLOCK_N] with -inf where tile row (query qi) may not see KV position n."""
    j = n[None, :] - mask_start  # column in the mask (< 0: always visible)
    if HAS_MASK:
        tree = tl.load(
            mask_ptr + req * stride_mr + qi[:, None] * stride_mi + j * stride_mj,
            mask=row_ok[:, None] & n_ok[None, :] & (j >= 0),
            other=0,
        )
        seen = n_ok[None, :] & ((j < 0) | (tree != 0))
    else:
        seen = n_ok[None, :] & (j <= qi[:, None])
    return tl.where(seen, qk, float("-inf"))


@jit
def _softmax_step(qk, m_i, l_i):
    """One online-softmax step over a masked score tile (log2 units): (p, alpha, l_i, m_i)
    with p = 2^(qk - new max), alpha = the factor rescaling what was accumulated so far."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])  # [ROWS, BLOCK_N]
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@jit
def _normalize(acc, m_i, l_i):
    """(out, lse): acc / l (rows that saw nothing output 0) and the rows' log2-sum-exp
    (-inf for those rows), what a split hands to the combine."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
