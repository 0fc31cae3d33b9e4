"""Exact mode: a row's result does not depend on the rows computed with it.

Per kernel (torch paths on the CPU, Triton under the interpreter, both on CUDA): the same row
alone and inside a batch of random others, bitwise. Per engine: with exact on, greedy
speculative output == plain greedy == the same request alone, under batching, chunked prefill
and preemption, in bf16.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import report, run_interpreted  # noqa: E402

from specserve.kernels import exact_gemm as eg  # noqa: E402
from specserve.kernels import mla_attention as mla  # noqa: E402
from specserve.kernels import paged_attention as pa  # noqa: E402
from specserve.kernels.dispatch import EXACT, set_exact  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON


@pytest.fixture
def exact_on():
    set_exact(True, max_positions=1024)
    yield
    set_exact(False)


def _row_alone_vs_batched(fn, x: torch.Tensor, row: int) -> None:
    """fn(x)[row] == fn(x[row:row+1])[0] bitwise, for batches of several sizes."""
    alone = fn(x[row : row + 1].clone())[0]
    batched = fn(x)[row]
    assert torch.equal(alone, batched), (alone - batched).abs().max()


# --------------------------------------------------------------------------------------------
# torch paths (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 7, 64])
def test_rowwise_linear_is_row_invariant(dtype: torch.dtype, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(dtype)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    _row_alone_vs_batched(lambda t: eg.rowwise_linear(t, w, b), x, m // 2)
    # and it computes x W^T + b
    torch.testing.assert_close(
        eg.rowwise_linear(x, w, b).float(),
        (x.float() @ w.float().T + b.float()),
        atol=0.1,
        rtol=0.02,
    )


def test_exact_gemm_ref_is_row_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 200, generator=g)
    w = torch.randn(48, 200, generator=g)
    torch.testing.assert_close(eg.exact_gemm_ref(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_linear_layer_uses_the_exact_path(exact_on) -> None:
    from specserve.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 40, bias=True)
    g = torch.Generator().manual_seed(1)
    layer.weight.data.normal_(generator=g)
    layer.bias.data.normal_(generator=g)
    x = torch.randn(9, 64, generator=g)
    with torch.no_grad():
        _row_alone_vs_batched(layer, x, 4)
        assert torch.equal(layer(x), eg.rowwise_linear(x, layer.weight, layer.bias))


def test_quantized_and_moe_torch_paths_are_row_invariant(exact_on) -> None:
    from specserve.kernels.fp8_gemm import fp8_mm_torch, quant_fp8_torch
    from specserve.kernels.fused_moe import fused_moe_ref

    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(128, 256, generator=g).to(torch.float8_e4m3fn)
    ws = torch.rand(1, 2, generator=g) + 0.5

    def fp8(t: torch.Tensor) -> torch.Tensor:
        xq, xs = quant_fp8_torch(t, 128)
        return fp8_mm_torch(xq, xs, 128, w, ws, 128, 128, torch.bfloat16)

    _row_alone_vs_batched(fp8, x, 6)
    experts, top_k, inter = 4, 2, 32
    w13 = torch.randn(experts, 2 * inter, 256, generator=g).to(torch.bfloat16)
    w2 = torch.randn(experts, 256, inter, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts, (11, top_k), generator=g)
    weights = torch.rand(11, top_k, generator=g)
    r = 6
    alone = fused_moe_ref(x[r : r + 1].clone(), w13, w2, weights[r : r + 1], ids[r : r + 1])
    assert torch.equal(alone[0], fused_moe_ref(x, w13, w2, weights, ids)[r])


def _attend_case(dtype: torch.dtype, seed: int):
    from specserve.layers.backends.torch_ref import attention_mask

    g = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, d = 37, 4, 2, 16
    k = torch.randn(seq_len, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(seq_len, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(6, heads, d, generator=g).to(dtype)
    return q, k, v, attention_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_decode_equals_extend_and_verify(exact_on, dtype: torch.dtype) -> None:
    from specserve.layers.backends.torch_ref import attend

    q, k, v, attention_mask = _attend_case(dtype, 3)
    seq_len, scale = k.shape[0], 0.25
    # extend: the 6 queries are the last 6 positions; query 2 sits at position seq_len - 4
    pos = seq_len - 4
    extend = attend(q, k, v, attention_mask(6, seq_len, None, q.device), scale)[2]
    # decode of the same query at the same position, its context only
    decode = attend(
        q[2:3], k[: pos + 1], v[: pos + 1], attention_mask(1, pos + 1, None, q.device), scale
    )[0]
    assert torch.equal(extend, decode)
    # tree verify: query 2's ancestors are queries 0 and 1 (a chain), its siblings 3..5 are not
    tree = torch.zeros(6, 6, dtype=torch.bool)
    tree[torch.arange(6), torch.arange(6)] = True
    tree[1, 0] = tree[2, :2] = True
    tree[3, 0] = tree[4, 3] = tree[5, 0] = True
    verify = attend(q, k, v, attention_mask(6, seq_len, tree, q.device), scale)[2]
    assert torch.equal(verify, decode)


def test_sampler_argmax_is_per_row() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 300, generator=g).to(torch.bfloat16)
    _row_alone_vs_batched(lambda t: t.float().argmax(-1), logits, 7)


def test_rms_norm_is_row_invariant() -> None:
    from specserve.layers.norm import RMSNorm

    norm = RMSNorm(96)
    g = torch.Generator().manual_seed(6)
    norm.weight.data.normal_(generator=g)
    x = torch.randn(17, 96, generator=g).to(torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    with torch.no_grad():
        _row_alone_vs_batched(lambda t: norm(t), x, 11)


def test_exact_attention_plan_is_fixed(exact_on) -> None:
    plans = {
        pa.launch_plan(bs, q, 4, 2, masked, torch.device("cpu"))[2:]
        for bs in (1, 16, 64)
        for q in (1, 4, 300)
        for masked in (False, True)
    }
    assert plans == {(EXACT.kv_splits, pa.EXACT_BLOCK_N, 4, 2)}
    assert EXACT.kv_splits * EXACT.kv_split_tokens >= 1024
    block_ms = {
        pa.launch_plan(bs, q, 4, 2, False, torch.device("cpu"))[0]
        for bs in (1, 64)
        for q in (1, 4, 300)
    }
    assert len(block_ms) == 1


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_torch_path_decode_equals_extend_and_verify(exact_on, dtype: torch.dtype) -> None:
    check_mla_decode_equals_extend_and_verify(mla.mla_attention_ref, "cpu", dtype)


def test_mla_absorption_and_router_are_row_invariant(exact_on) -> None:
    """W_UK / W_UV per head (exact_bmm: one row at a time on the CPU) and the MoE router."""
    from specserve.config import MoEConfig
    from specserve.layers.moe import MoEGate

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 4, 48, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 64, 48, generator=g).to(torch.bfloat16)
    _row_alone_vs_batched(lambda t: eg.exact_bmm(t, w), x, 5)
    ref = torch.bmm(x.float().transpose(0, 1), w.float().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(eg.exact_bmm(x, w).float(), ref, atol=0.1, rtol=0.02)
    gate = MoEGate(48, MoEConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8,
                                 n_group=4, topk_group=2))
    gate.weight.data.normal_(generator=g)
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.data.normal_(generator=g)
    h = torch.randn(11, 48, generator=g)
    with torch.no_grad():
        for part in (0, 1):
            _row_alone_vs_batched(lambda t, part=part: gate(t)[part], h, 6)


def test_exact_mla_takes_the_absorbed_form(exact_on) -> None:
    from specserve.config import MLAConfig
    from specserve.layers.attention_metadata import AttentionMetadata
    from specserve.layers.mla import choose_form

    mla_cfg = MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128)
    md = AttentionMetadata.__new__(AttentionMetadata)
    md.custom_mask, md.query_lens_cpu, md.seq_lens_cpu = None, [2048], [2048]
    assert choose_form(md, 16, mla_cfg) == "absorbed"  # a long prefill: compute when not exact
    set_exact(False)
    assert choose_form(md, 16, mla_cfg) == "compute"


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter


def check_exact_gemm() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 150, generator=g)
    b = torch.randn(80, generator=g)
    x = torch.randn(70, 150, generator=g)
    torch.testing.assert_close(
        eg.exact_gemm(x, w, b), eg.exact_gemm_ref(x, w, b), atol=1e-4, rtol=1e-4
    )
    for m in (1, 5, 70):
        _row_alone_vs_batched(lambda t: eg.exact_gemm(t, w, b), x[:m], m - 1)


def check_exact_attention(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Exact mode: a token decoded alone == the same token inside a chain verify / extend."""
    set_exact(True, max_positions=512)
    try:
        g = torch.Generator().manual_seed(1)
        page_size, pages, kv_heads, heads, d = 4, 128, 2, 4, 16
        kc = torch.randn(pages, page_size, kv_heads, d, generator=g).to(device, dtype)
        vc = torch.randn(pages, page_size, kv_heads, d, generator=g).to(device, dtype)
        table = torch.randperm(pages, generator=g).to(device, torch.int32)[None, :]
        seq_len, n_new = 300, 5  # past the first 256-token split
        q = torch.randn(n_new, heads, d, generator=g).to(device, dtype)
        qsl = torch.tensor([0, n_new], dtype=torch.int32, device=device)
        extend = pa.paged_attention(
            q,
            kc,
            vc,
            qsl,
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            table,
            n_new,
            0.25,
        )
        mask = torch.tril(torch.ones(1, n_new, n_new, dtype=torch.bool, device=device))
        verify = pa.paged_attention(
            q,
            kc,
            vc,
            qsl,
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            table,
            n_new,
            0.25,
            custom_mask=mask,
        )
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


INTERPRETER_CHECKS = {"exact_gemm": check_exact_gemm, "exact_attention": check_exact_attention,
                      "exact_bmm": check_exact_bmm, "exact_mla": check_exact_mla,
                      "exact_tree_attention": check_exact_tree_attention}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    return run_interpreted(__file__)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", sorted(INTERPRETER_CHECKS))
def test_interpreter(name: str, interpreter_results: dict[str, str]) -> None:
    assert interpreter_results[name] == "ok", interpreter_results[name]


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
def test_exact_mla_cuda_bf16() -> None:
    check_exact_bmm("cuda", torch.bfloat16)
    check_exact_mla("cuda", torch.bfloat16)
    check_exact_tree_attention("cuda", torch.bfloat16)


# --------------------------------------------------------------------------------------------
# engine


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def pair(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny target of each attention kind (GQA; MLA + MoE) with a random EAGLE-3 head."""
    from tiny_eagle import make_tiny_eagle3_head
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("exact")
    layers = {"num_hidden_layers": 4} if request.param == "llama" else {}
    target = make_tiny_checkpoint(root / "target", family=request.param, tokenizer=True, **layers)
    return target, make_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=128)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_exact_engine_greedy_identical(pair, device: str) -> None:
    from tiny_models import record_preemptions

    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA and triton")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(6, seed=2)

    def run(spec: dict | None, batched: bool, **kw) -> list[list[int]]:
        kw.setdefault("cache", CacheConfig(page_size=4, num_pages=512))
        llm = LLM(
            pair[0], device=device, dtype="bfloat16", exact=True, speculative_config=spec, **kw
        )
        try:
            if batched:
                return [o.token_ids for o in llm.generate(prompts, params)]
            return [llm.generate([p], params)[0].token_ids for p in prompts]
        finally:
            llm.close()
            set_exact(False)  # the mode is per process: leave it off for other tests

    alone = run(None, batched=False)
    assert run(None, batched=True, scheduler=SchedulerConfig(max_num_batched_tokens=16)) == alone
    chain = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=1)
    assert run(chain, batched=True) == alone
    tree = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3, topk=2, num_draft_tokens=6)
    # a pool far smaller than the batch: preemption and recompute
    small = dict(
        cache=CacheConfig(page_size=4, num_pages=24),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    llm_check = LLM(
        pair[0], device=device, dtype="bfloat16", exact=True, speculative_config=tree, **small
    )
    try:
        preempted = record_preemptions(llm_check.engine.scheduler)
        out = [o.token_ids for o in llm_check.generate(prompts, params)]
        assert preempted, "the small pool was meant to force a preemption"
    finally:
        llm_check.close()
        set_exact(False)
    assert out == alone


if __name__ == "__main__":
    report(INTERPRETER_CHECKS)
