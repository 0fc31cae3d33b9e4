"""Exact mode, Triton kernels (under the interpreter on the CPU, on CUDA where present): the
M-invariant GEMMs (dense, per head) and attention (paged and MLA: decode == extend == chain
and tree verify of the same token, and a decode row inside a batch), bitwise. The torch paths
and the engine are in test_exact.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import interpreter_test, report  # noqa: E402

from specserve.kernels import exact_gemm as eg  # noqa: E402
from specserve.kernels import mla_attention as mla  # noqa: E402
from specserve.kernels import paged_attention as pa  # noqa: E402
from specserve.kernels.dispatch import set_exact  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON


def _row_alone_vs_batched(fn, x: torch.Tensor, row: int) -> None:
    """fn(x)[row] == fn(x[row:row+1])[0] bitwise, for batches of several sizes."""
    alone = fn(x[row : row + 1].clone())[0]
    batched = fn(x)[row]
    assert torch.equal(alone, batched), (alone - batched).abs().max()


def _mla_case(dtype: torch.dtype, seed: int, device: str = "cpu"):
    """A paged latent cache (L 64 + R 16, 4 heads) with a 300-token request whose last 5
    positions are new queries."""
    g = torch.Generator().manual_seed(seed)
    page_size, pages, heads, rank, rope = 4, 128, 4, 64, 16
    cache = torch.randn(pages, page_size, rank + rope, generator=g).to(device, dtype)
    table = torch.randperm(pages, generator=g).to(device, torch.int32)[None, :]
    q_lat = torch.randn(5, heads, rank, generator=g).to(device, dtype)
    q_pe = torch.randn(5, heads, rope, generator=g).to(device, dtype)
    return cache, table, q_lat, q_pe, 300


def check_mla_decode_equals_extend_and_verify(fn, device: str, dtype: torch.dtype) -> None:
    """fn = mla_attention or mla_attention_ref: a query decoded alone == the same query inside
    an extend, a chain verify and a tree verify (its ancestors only), and the same decode row
    inside a batch of other requests, bitwise."""
    cache, table, q_lat, q_pe, seq_len = _mla_case(dtype, 4, device)
    n_new, scale = q_lat.shape[0], 0.125
    qsl = torch.tensor([0, n_new], dtype=torch.int32, device=device)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)

    def run(q, p, starts, seq_lens, tables, mask=None):
        if fn is mla.mla_attention:
            max_q = int((starts[1:] - starts[:-1]).max())
            return fn(q, p, cache, starts, seq_lens, tables, max_q, scale, custom_mask=mask)
        return fn(q, p, cache, starts, seq_lens, tables, scale, mask)

    extend = run(q_lat, q_pe, qsl, lens, table)
    chain = torch.tril(torch.ones(1, n_new, n_new, dtype=torch.bool, device=device))
    verify = run(q_lat, q_pe, qsl, lens, table, chain)
    tree = torch.eye(n_new, dtype=torch.bool, device=device)
    tree[1, 0] = tree[2, 0] = tree[2, 1] = tree[3, 0] = tree[4, 3] = True
    tree_out = run(q_lat, q_pe, qsl, lens, table, tree[None])
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for i in range(n_new):
        pos_len = torch.tensor([seq_len - n_new + i + 1], dtype=torch.int32, device=device)
        decode = run(q_lat[i : i + 1], q_pe[i : i + 1], one, pos_len, table)[0]
        assert torch.equal(decode, extend[i]), i
        assert torch.equal(decode, verify[i]), i
    # tree node 2 (ancestors 0, 1) at depth 2: its decode sees the prefix and nodes 0, 1
    assert torch.equal(tree_out[2], verify[2])
    g = torch.Generator().manual_seed(9)
    others_lat = torch.randn(3, *q_lat.shape[1:], generator=g).to(device, dtype)
    others_pe = torch.randn(3, *q_pe.shape[1:], generator=g).to(device, dtype)
    batch_lat = torch.cat([others_lat[:1], q_lat[2:3], others_lat[1:]])
    batch_pe = torch.cat([others_pe[:1], q_pe[2:3], others_pe[1:]])
    tables = torch.stack([torch.randperm(table.shape[1], generator=g) for _ in range(4)])
    tables[1] = table[0].cpu()
    blens = torch.tensor([37, seq_len - n_new + 3, 500, 1], dtype=torch.int32, device=device)
    starts = torch.arange(5, dtype=torch.int32, device=device)
    batched = run(batch_lat, batch_pe, starts, blens, tables.to(device, torch.int32))
    assert torch.equal(batched[1], extend[2])


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter


def check_exact_gemm() -> None:
    g = torch.Generator().manual_seed(0)
    # K 150: one chunk; K 1100: split into chunks (few column tiles), bias on the first
    for k, splits in ((150, 1), (1100, 2)):
        assert eg.exact_splits(80, k, torch.device("cpu")) == splits
        w = torch.randn(80, k, generator=g)
        b = torch.randn(80, generator=g)
        x = torch.randn(70, k, generator=g)
        torch.testing.assert_close(
            eg.exact_gemm(x, w, b), eg.exact_gemm_ref(x, w, b), atol=1e-4, rtol=1e-4
        )
        for m in (1, 5, 70):
            _row_alone_vs_batched(lambda t, w=w, b=b: eg.exact_gemm(t, w, b), x[:m], m - 1)


def _paged_kv(g: torch.Generator, pages: int, device: str, dtype: torch.dtype) -> tuple:
    """Random K and V caches of `pages` pages of 4 tokens, 2 KV heads of dim 16."""
    return tuple(torch.randn(pages, 4, 2, 16, generator=g).to(device, dtype) for _ in range(2))


def check_exact_attention(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Exact mode: a token decoded alone == the same token inside a chain verify / extend."""
    set_exact(True, max_positions=512)
    try:
        g = torch.Generator().manual_seed(1)
        pages, heads, d = 128, 4, 16
        kc, vc = _paged_kv(g, pages, device, dtype)
        table = torch.randperm(pages, generator=g).to(device, torch.int32)[None, :]
        seq_len, n_new = 300, 5  # past the first 256-token split
        q = torch.randn(n_new, heads, d, generator=g).to(device, dtype)
        qsl = torch.tensor([0, n_new], dtype=torch.int32, device=device)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        extend = pa.paged_attention(q, kc, vc, qsl, lens, table, n_new, 0.25)
        mask = torch.tril(torch.ones(1, n_new, n_new, dtype=torch.bool, device=device))
        verify = pa.paged_attention(q, kc, vc, qsl, lens, table, n_new, 0.25, custom_mask=mask)
        for i in range(n_new):
            pos_len = seq_len - n_new + i + 1
            decode = pa.paged_decode_attention(
                q[i : i + 1],
                kc,
                vc,
                torch.tensor([pos_len], dtype=torch.int32, device=device),
                table,
                0.25,
            )
            assert torch.equal(decode[0], extend[i]), i
            assert torch.equal(decode[0], verify[i]), i
        # the same decode row inside a batch of other requests (other lengths and pages)
        others = torch.randn(3, heads, d, generator=g).to(device, dtype)
        batch_q = torch.cat([others[:1], q[2:3], others[1:]])
        tables = torch.stack([torch.randperm(pages, generator=g) for _ in range(4)])
        tables[1] = table[0].cpu()
        lens = torch.tensor([37, seq_len - n_new + 3, 500, 1], dtype=torch.int32)
        batched = pa.paged_decode_attention(
            batch_q, kc, vc, lens.to(device), tables.to(device, torch.int32), 0.25
        )
        assert torch.equal(batched[1], extend[2])
    finally:
        set_exact(False)


TREE_PARENTS = [-1, 0, 0, 1, 3, 2, 4]  # node 0 the root; parents precede children


def _tree_mask(parents: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """[n, n] mask (ancestors and self) and each node's path, root first."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    paths = []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
        mask[i, path] = True
    return mask, paths


def _paged(rows: torch.Tensor, page_size: int, g: torch.Generator) -> tuple:
    """rows [S, ...] laid out in pages of a random order: (cache [pages, page_size, ...],
    page_table [1, pages] int32)."""
    pages = -(-rows.shape[0] // page_size) + 3
    cache = rows.new_zeros(pages * page_size, *rows.shape[1:])
    perm = torch.randperm(pages, generator=g)
    pos = torch.arange(rows.shape[0])
    cache[perm[pos // page_size] * page_size + pos % page_size] = rows
    table = perm.to(rows.device, torch.int32)[None, :]
    return cache.view(pages, page_size, *rows.shape[1:]), table


def _attend_rows(kind: str, kv: tuple, rows: list[int], queries: list[torch.Tensor],
                 tree: torch.Tensor | None = None, ref: bool = False) -> torch.Tensor:
    """Attention (paged or MLA, kernel or reference) of one request whose KV holds the given
    rows of kv = (k_rows, v_rows or None) in order, in pages of 4 laid out at random."""
    idx, q_len, dev, scale = torch.tensor(rows), queries[0].shape[0], queries[0].device, 0.25
    cache, table = _paged(kv[0][idx], 4, torch.Generator().manual_seed(1))
    lens = torch.tensor([len(rows)], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    if kind == "mla":
        if ref:
            return mla.mla_attention_ref(*queries, cache, qsl, lens, table, scale, tree)
        return mla.mla_attention(*queries, cache, qsl, lens, table, q_len, scale,
                                 custom_mask=tree)
    vc, _ = _paged(kv[1][idx], 4, torch.Generator().manual_seed(1))
    if ref:
        return pa.paged_attention_ref(*queries, cache, vc, qsl, lens, table, scale, tree)
    return pa.paged_attention(*queries, cache, vc, qsl, lens, table, q_len, scale,
                              custom_mask=tree)


def check_exact_tree_attention(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Exact mode: each node of a tree verify == a decode of its token whose context is the
    prefix then its path (what the accepted path's compacted KV holds), for paged attention and
    MLA; the tree verify still equals the reference attention."""
    set_exact(True, max_positions=512)
    try:
        g = torch.Generator().manual_seed(11)
        mask, paths = _tree_mask(TREE_PARENTS)
        n, prefix = len(TREE_PARENTS), 250  # the nodes past the first 256-token split
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        tree = mask[None].to(device)
        for kind in ("paged", "mla"):
            if kind == "paged":
                kv = (torch.randn(prefix + n, 2, 16, generator=g).to(device, dtype),
                      torch.randn(prefix + n, 2, 16, generator=g).to(device, dtype))
                q = [torch.randn(n, 4, 16, generator=g).to(device, dtype)]
            else:
                kv = (torch.randn(prefix + n, 64 + 16, generator=g).to(device, dtype), None)
                q = [torch.randn(n, 4, 64, generator=g).to(device, dtype),
                     torch.randn(n, 4, 16, generator=g).to(device, dtype)]
            everything = list(range(prefix + n))
            verify = _attend_rows(kind, kv, everything, q, tree)
            for i, path in enumerate(paths):
                rows_i = list(range(prefix)) + [prefix + a for a in path]
                decode = _attend_rows(kind, kv, rows_i, [t[i : i + 1] for t in q])
                assert torch.equal(decode[0], verify[i]), (kind, i)
            ref = _attend_rows(kind, kv, everything, q, tree, ref=True)
            torch.testing.assert_close(verify.float(), ref.float(), atol=tol, rtol=tol)
    finally:
        set_exact(False)


def check_exact_bmm(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(3)
    w_uk = torch.randn(4, 40, 96, generator=g).to(device, dtype)  # [N, P, L] as in MLA
    x = torch.randn(33, 4, 40, generator=g).to(device, dtype)
    w = w_uk.transpose(1, 2)  # [N, L, P], strided: the layer passes this view
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(eg.exact_bgemm(x, w).float(), eg.exact_bmm_ref(x, w).float(),
                               atol=tol, rtol=tol)
    for m in (1, 6, 33):
        _row_alone_vs_batched(lambda t: eg.exact_bgemm(t, w), x[:m], m - 1)


def check_exact_mla(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    set_exact(True, max_positions=512)
    try:
        check_mla_decode_equals_extend_and_verify(mla.mla_attention, device, dtype)
        cache, table, q_lat, q_pe, seq_len = _mla_case(dtype, 4, device)
        qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(  # the exact plan still computes the attention
            mla.mla_attention(q_lat, q_pe, cache, qsl, lens, table, 5, 0.125).float(),
            mla.mla_attention_ref(q_lat, q_pe, cache, qsl, lens, table, 0.125).float(),
            atol=tol, rtol=tol)
    finally:
        set_exact(False)


def check_exact_block_table(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Exact mode through a token graph's launch (worker/token_graphs.py: tokens and rows
    padded, programs from a block table): every real row has the bits of the plain launch over
    the batch and of a decode of its token."""
    from specserve.worker.token_graphs import block_table

    set_exact(True, max_positions=512)
    try:
        g = torch.Generator().manual_seed(5)
        pages, kv_heads, heads, d = 160, 2, 4, 16
        kc, vc = _paged_kv(g, pages, device, dtype)
        seq_lens, q_lens, rows, tokens = [300, 40, 9, 270], [1, 37, 9, 2], 8, 64
        t = sum(q_lens)
        tables = torch.stack([torch.randperm(pages, generator=g) for _ in range(rows)])
        tables = tables.to(device, torch.int32)
        q = torch.randn(tokens, heads, d, generator=g).to(device, dtype)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        plain = pa.paged_attention(q[:t], kc, vc, qsl.to(device), lens.to(device),
                                   tables[: len(q_lens)], max(q_lens), 0.25)
        pad = rows - len(q_lens)
        qsl_p = torch.cat([qsl, torch.full((pad,), t, dtype=torch.int32)]).to(device)
        lens_p = torch.cat([lens, torch.zeros(pad, dtype=torch.int32)]).to(device)
        block_m = pa.query_block_size(rows, tokens, heads // kv_heads, kv_heads)
        blocks = torch.from_numpy(block_table(torch.tensor(q_lens).numpy(), block_m,
                                              -(-tokens // block_m) + rows)).to(device)
        graphed = pa.paged_attention(q, kc, vc, qsl_p, lens_p, tables, tokens, 0.25,
                                     block_table=blocks)
        assert torch.equal(graphed[:t], plain)
        last = t - 1  # row 3's last query: a decode of its token at position 269
        decode = pa.paged_decode_attention(q[last : last + 1], kc, vc,
                                           lens[3:].to(device), tables[3:4], 0.25)
        assert torch.equal(decode[0], graphed[last])
    finally:
        set_exact(False)


INTERPRETER_CHECKS = {"exact_gemm": check_exact_gemm, "exact_attention": check_exact_attention,
                      "exact_bmm": check_exact_bmm, "exact_mla": check_exact_mla,
                      "exact_tree_attention": check_exact_tree_attention,
                      "exact_block_table": check_exact_block_table}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_exact_gemm_cuda_bf16() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(64, 4096, generator=g, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(
        eg.exact_gemm(x, w).float(), eg.exact_gemm_ref(x, w).float(), atol=0.5, rtol=0.02
    )
    for m in (1, 4, 16, 64):
        _row_alone_vs_batched(lambda t: eg.exact_gemm(t, w), x[:m], m - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_exact_attention_cuda_bf16() -> None:
    check_exact_attention("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_exact_block_table_cuda_bf16() -> None:
    check_exact_block_table("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_exact_mla_cuda_bf16() -> None:
    check_exact_bmm("cuda", torch.bfloat16)
    check_exact_mla("cuda", torch.bfloat16)
    check_exact_tree_attention("cuda", torch.bfloat16)


def _exact_gemm_8b() -> None:
    w = torch.randn(4096, 4096).to(torch.bfloat16)
    eg.exact_gemm(torch.randn(64, 4096).to(torch.bfloat16), w)


# compile-only (tests/triton_compile.py): the GPU tests' bf16 launches
GPU_DIM_CHECKS = {
    "bf16_exact_gemm_4096": _exact_gemm_8b,
    "bf16_exact_attention": lambda: check_exact_attention("cpu", torch.bfloat16),
    "bf16_exact_bmm": lambda: check_exact_bmm("cpu", torch.bfloat16),
    "bf16_exact_mla": lambda: check_exact_mla("cpu", torch.bfloat16),
    "bf16_exact_tree_attention": lambda: check_exact_tree_attention("cpu", torch.bfloat16),
}


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
