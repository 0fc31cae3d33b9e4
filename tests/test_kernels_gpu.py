"""Paged attention, KV store, fused ops and the attention backend on the GPU: bf16 on realistic
shapes (contexts up to 32k, page sizes, GQA ratios, tree masks, CUDA-graph replay) against the
torch references; the checks and their CPU (interpreter) runs are in test_kernels.py."""

from __future__ import annotations

import math

import pytest
import torch
from test_fused_fp8_rows import check_fused_fp8_rows
from test_kernels import (
    check_attention,
    check_backend,
    check_counters_zeroed,
    check_fused_ops,
    check_store_kv,
    gpu_test,
    make_case,
    row_rel_error,
    tree_mask,
)

from specserve.kernels import paged_attention as pa

BF16, CUDA, TOL16 = torch.bfloat16, "cuda", 1e-2
_lens_gen = torch.Generator().manual_seed(3)
SEQ_LENS = {
    "mixed": [1, 7, 100, 1000, 4097],
    "single": [2049],
    "many": torch.randint(1, 3000, (40,), generator=_lens_gen).tolist(),
}


@gpu_test
@pytest.mark.parametrize("fused_combine", [True, False])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lens", sorted(SEQ_LENS))
def test_decode_gpu(lens: str, group: int, head_dim: int, page_size: int, fused_combine: bool
                    ) -> None:  # fmt: skip
    check_attention(
        SEQ_LENS[lens], None, group, 4, head_dim, page_size, BF16, CUDA, TOL16,
        fused_combine=fused_combine,
    )  # fmt: skip


@gpu_test
@pytest.mark.parametrize("fused_combine", [True, False])
@pytest.mark.parametrize("num_splits", [None, 7])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([1, 7, 100, 1000, 2500], [1, 7, 100, 1000, 2500]),  # fresh prefill
        ([100, 1000, 4097], [37, 256, 1000]),  # chunked prefill after a cached prefix
        ([9, 300, 4097, 64], [1, 1, 1, 1]),  # one-token extends through the extend kernel
    ],
)
def test_extend_causal_gpu(
    seq_lens: list[int], q_lens: list[int], group: int, head_dim: int, page_size: int,
    num_splits: int | None, fused_combine: bool,
) -> None:  # fmt: skip
    check_attention(
        seq_lens, q_lens, group, 2, head_dim, page_size, BF16, CUDA, TOL16,
        num_splits=num_splits, fused_combine=fused_combine,
    )  # fmt: skip


@gpu_test
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_context_decode_and_verify_gpu(group: int, page_size: int, verify: bool,
                                            exact: bool) -> None:
    """Contexts 1 .. 32k in one batch (decode, or a 6-node tree verify past each context), the
    default and the exact-mode launch plans, against the reference."""
    from specserve.kernels.dispatch import set_exact

    lens = [1, 1000, 8192, 32768]
    set_exact(exact, max_positions=32768 + 256, max_splits=32)
    try:
        if verify:
            check_attention([n + 6 for n in lens], [6] * len(lens), group, 4, 128, page_size,
                            BF16, CUDA, TOL16, seed=group, mask_extra=0)
        else:
            check_attention(lens, None, group, 4, 128, page_size, BF16, CUDA, TOL16)
    finally:
        set_exact(False)


@gpu_test
@pytest.mark.parametrize("fused_combine", [True, False])
@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("mask_extra", [0, 6])  # 0: verify (W = q_len); 6: draft-step width
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("bs,num_draft", [(1, 8), (8, 16), (33, 4)])
def test_extend_tree_mask_gpu(
    bs: int, num_draft: int, group: int, mask_extra: int, num_splits: int | None,
    fused_combine: bool,
) -> None:  # fmt: skip
    seq_lens = [num_draft + n for n in SEQ_LENS["many"][:bs]]
    check_attention(
        seq_lens, [num_draft] * bs, group, 4, 128, 16, BF16, CUDA, TOL16, seed=bs,
        mask_extra=mask_extra, num_splits=num_splits, fused_combine=fused_combine,
    )  # fmt: skip


@gpu_test
@pytest.mark.parametrize("page_size", [16, 64])
def test_store_kv_gpu(page_size: int) -> None:
    check_store_kv(BF16, CUDA, 1000, page_size)


@gpu_test
@pytest.mark.parametrize("tree,cached", [(False, False), (False, True), (True, True)])
def test_backend_gpu(tree: bool, cached: bool) -> None:
    check_backend(BF16, CUDA, TOL16, tree, cached)


@gpu_test
@pytest.mark.parametrize("hidden", [1000, 4096])
def test_fused_ops_gpu(hidden: int) -> None:
    check_fused_ops(BF16, CUDA, TOL16, hidden)


@gpu_test
@pytest.mark.parametrize("group, silu_fits", [(128, True), (4096, False)])
def test_fused_fp8_rows_gpu(group: int, silu_fits: bool) -> None:
    """Llama-3.1-8B's norm and SiLU-and-mul widths (4096, 14336: blocks of 1024) writing their
    FP8 rows in bf16: bitwise quant_fp8_torch of their outputs (per 128-group, or per row
    where a program holds the row)."""
    check_fused_fp8_rows(BF16, CUDA, 4096, 14336, group, silu_fits=silu_fits)


@gpu_test
@pytest.mark.parametrize("fused_combine", [True, False])
@pytest.mark.parametrize("tree", [False, True])
def test_cuda_graph_replay_gpu(tree: bool, fused_combine: bool) -> None:
    """Capture with one batch, replay after rewriting seq_lens / page_table / q in place (twice:
    the second replay finds the split counters the first one reset)."""
    q_len, page_size = (6 if tree else 1), 16
    c = make_case(
        [300, 50, 4097, 9], [q_len] * 4, 16, 4, 128, page_size, BF16, CUDA, 1,
        0 if tree else None,
    )  # fmt: skip
    out = torch.full_like(c.q, float("nan"))

    def step() -> None:
        if tree:
            pa.paged_attention(
                c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.page_table,
                q_len, 0.1, c.custom_mask, out, fused_combine=fused_combine,
            )  # fmt: skip
        else:
            pa.paged_decode_attention(
                c.q, c.k_cache, c.v_cache, c.seq_lens, c.page_table, 0.1, out,
                fused_combine=fused_combine,
            )  # fmt: skip

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [17, 4000, 300, 6]  # needs 272 of the 284 pages, at most 250 per request
    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(c.k_cache.shape[0], generator=gen).int()
    c.page_table.fill_(-1)
    used = 0
    for r, n in enumerate(math.ceil(s / page_size) for s in new_lens):
        c.page_table[r, :n] = order[used : used + n].to(CUDA)
        used += n
    c.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    c.q.copy_(torch.randn(c.q.shape, generator=gen))
    if tree:
        c.custom_mask.copy_(torch.stack([tree_mask(q_len, q_len, gen) for _ in new_lens]))
    ref = pa.paged_attention_ref(
        c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.page_table, 0.1,
        c.custom_mask,
    )  # fmt: skip
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        assert row_rel_error(out, ref) < TOL16
        check_counters_zeroed(out.device)
