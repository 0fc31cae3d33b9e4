"""Triton kernels vs their torch references (paged attention, store_kv, fused ops, backend).

GPU tests (marker `gpu`) run the kernels in bf16 on realistic shapes. On the CPU the same checks
run on tiny fp32 shapes under the Triton interpreter, in one subprocess (TRITON_INTERPRET must be
set before triton is imported): `python tests/test_kernels.py` runs them all and prints a JSON
line of results that `test_interpreter` reads.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interpreted import interpreter_test, report  # noqa: E402

from specserve.kernels import fused_ops as fo  # noqa: E402
from specserve.kernels import kv_store, split_kv  # noqa: E402
from specserve.kernels import paged_attention as pa  # noqa: E402
from specserve.layers.attention_metadata import AttentionMetadata  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON


def gpu_test(fn: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")(fn))


@dataclass
class Case:
    """A batch of requests over a randomly paged KV cache (all tensors on one device)."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [bs + 1] int32
    seq_lens: torch.Tensor  # [bs] int32
    page_table: torch.Tensor  # [bs, max_pages] int32, shuffled pages, -1 past the end
    custom_mask: torch.Tensor | None  # [bs, max_query_len, W] bool
    max_query_len: int


def tree_mask(q_len: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[q_len, width] mask of a random tree over the last q_len columns (naive: each node sees
    its parent's row plus itself); the first width - q_len columns are random extra context."""
    mask = torch.zeros(q_len, width, dtype=torch.bool)
    extra = width - q_len
    for i in range(q_len):
        if i:
            mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        else:
            mask[0, :extra] = torch.rand(extra, generator=gen) < 0.5
        mask[i, extra + i] = True
    return mask


def make_case(
    seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, dtype: torch.dtype, device: str, seed: int, mask_extra: int | None = None,
) -> Case:  # fmt: skip
    """mask_extra: None = causal; else a tree mask of width max(q_lens) + mask_extra."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages) + 3  # some pages belong to nobody
    order = torch.randperm(num_pages, generator=gen).int()
    page_table = torch.full((len(seq_lens), max(pages) + 2), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        page_table[r, :n] = order[used : used + n]
        used += n
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    max_q = max(q_lens)
    mask = None
    if mask_extra is not None:
        mask = torch.zeros(len(q_lens), max_q, max_q + mask_extra, dtype=torch.bool)
        for r, q_len in enumerate(q_lens):
            mask[r, :q_len, max_q - q_len :] = tree_mask(q_len, q_len + mask_extra, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
        qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
        page_table.to(device), None if mask is None else mask.to(device), max_q,
    )  # fmt: skip


def row_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative L2 error over (token, head) rows; NaN anywhere counts as failure."""
    assert out.shape == ref.shape
    if not torch.isfinite(out).all():
        return float("inf")
    err = (out.float() - ref.float()).norm(dim=-1)
    return (err / ref.float().norm(dim=-1).clamp_min(1e-6)).max().item()


def check_attention(
    seq_lens: list[int], q_lens: list[int] | None, group: int, num_kv_heads: int, head_dim: int,
    page_size: int, dtype: torch.dtype, device: str, tol: float, seed: int = 0,
    mask_extra: int | None = None, num_splits: int | None = None, block_n: int = 64,
    fused_combine: bool = True,
) -> None:  # fmt: skip
    """q_lens None = decode (one query per request through `paged_decode_attention`)."""
    decode = q_lens is None
    c = make_case(
        seq_lens, q_lens or [1] * len(seq_lens), group * num_kv_heads, num_kv_heads, head_dim,
        page_size, dtype, device, seed, mask_extra,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = torch.full_like(c.q, float("nan"))  # poison: every real row must be written
    if decode:
        pa.paged_decode_attention(
            c.q, c.k_cache, c.v_cache, c.seq_lens, c.page_table, scale, out, num_splits,
            fused_combine,
        )  # fmt: skip
    else:
        pa.paged_attention(
            c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.page_table,
            c.max_query_len, scale, c.custom_mask, out, num_splits, block_n, fused_combine,
        )  # fmt: skip
    ref = pa.paged_attention_ref(
        c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.page_table, scale,
        c.custom_mask,
    )  # fmt: skip
    err = row_rel_error(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol} (seq_lens {seq_lens}, q_lens {q_lens})"
    check_counters_zeroed(out.device)


def check_block_table(num_splits: int | None, group: int = 2) -> None:
    """A launch over a token graph's fixed grid (worker/token_graphs.py): T tokens padded past
    the batch's, rows with no queries past its rows, programs from a block table (pads
    included). Real rows equal the reference; the attention launch writes no padded token."""
    from specserve.worker.token_graphs import block_table

    seq_lens, q_lens, rows, tokens = [9, 40, 70, 3, 5, 17], [9, 1, 40, 1, 1, 1], 8, 64
    c = make_case(seq_lens, q_lens, group * 2, 2, 16, 4, F32, CPU, 3)
    t = sum(q_lens)
    gen = torch.Generator().manual_seed(4)
    q = torch.cat([c.q, torch.randn(tokens - t, *c.q.shape[1:], generator=gen)])
    pad = rows - len(q_lens)
    qsl = torch.cat([c.query_start_loc, torch.full((pad,), t, dtype=torch.int32)])
    lens = torch.cat([c.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    table = torch.cat([c.page_table, torch.zeros(pad, c.page_table.shape[1], dtype=torch.int32)])
    block_m = pa.query_block_size(rows, tokens, group, 2)
    blocks = torch.from_numpy(block_table(torch.tensor(q_lens).numpy(), block_m,
                                          -(-tokens // block_m) + rows))
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(q, c.k_cache, c.v_cache, qsl, lens, table, tokens, 0.25, out=out,
                       num_splits=num_splits, block_table=blocks)
    ref = pa.paged_attention_ref(c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens,
                                 c.page_table, 0.25)
    err = row_rel_error(out[:t], ref)
    assert err < TOL32, f"relative error {err:.3g} over a block table"
    if num_splits == 1:  # (a second, combining launch writes every token: pads garbage)
        assert out[t:].isnan().all(), "a padded token was written"


def check_counters_zeroed(device: torch.device) -> None:
    """Every launch must leave the split arrival counters all zeros (CUDA-graph replays rely on
    it)."""
    counters = pa._split_counters.get(device)
    if counters is not None:
        nonzero = counters.nonzero().flatten()[:8].tolist()
        assert not nonzero, f"split counters left nonzero at {nonzero}"


class _NoCombineLaunch:
    def __getitem__(self, grid: object) -> None:
        raise AssertionError("the fused path launched _combine_splits_kernel")


def check_fused_combine_counters(dtype: torch.dtype, device: str, tol: float) -> None:
    """The fused path: no second launch, counters zeroed after decode and after extend (whose
    padding query blocks have no rows), reusable launch after launch, and it is the counter
    that gates the combine (a counter left nonzero: nobody combines, the output stays unset)."""
    combine = split_kv._combine_splits_kernel
    split_kv._combine_splits_kernel = _NoCombineLaunch()
    try:
        for seed in range(2):  # the second launch reuses the counters the first one reset
            check_attention([1, 9, 50], None, 2, 2, 16, 4, dtype, device, tol, seed, num_splits=3)
        check_attention(
            [30, 12, 70], [2, 12, 7], 2, 1, 16, 4, dtype, device, tol, num_splits=2, block_n=16
        )
    finally:
        split_kv._combine_splits_kernel = combine
    c = make_case([20, 40], [1, 1], 2, 1, 16, 4, dtype, device, 0)
    counters = pa.split_counters(2, torch.device(device))
    assert counters.dtype == torch.int32 and pa.split_counters(2, counters.device) is counters
    counters[:2] = 5  # past num_splits - 1: no split program ever sees itself last
    out = torch.full_like(c.q, float("nan"))
    try:
        pa.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.seq_lens, c.page_table, 0.25, out, 2,
                                  fused_combine=True)
        assert out.isnan().all() and counters[:2].tolist() == [7, 7]  # 2 splits each
    finally:
        counters.zero_()


def check_store_kv(dtype: torch.dtype, device: str, num_tokens: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_kv_heads, head_dim, num_pages = 3, 24, 2 + num_tokens // page_size
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # skipped tokens
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    k, v = kv.to(device, dtype).split(num_kv_heads, dim=1)  # strided views, as after a qkv split
    k_cache, v_cache = k_cache.to(device, dtype), v_cache.to(device, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store.store_kv(k, v, k_cache, v_cache, slots.to(device))
    kv_store.store_kv_ref(k, v, k_ref, v_ref, slots.to(device))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def check_backend(dtype: torch.dtype, device: str, tol: float, tree: bool, cached: bool) -> None:
    """TritonBackend.forward (store + dispatch) vs store_kv_ref + paged_attention_ref."""
    from specserve.layers.backends.triton_backend import TritonBackend

    q_lens = [3, 3, 3] if tree else ([1, 1, 1] if cached else [5, 9, 2])
    seq_lens = [20, 7, 35] if cached else q_lens
    c = make_case(seq_lens, q_lens, 8, 2, 32, 8, dtype, device, 7, 2 if tree else None)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(c.q.shape[0], 12, 32, generator=gen).to(device, dtype)
    q, k, v = qkv.split([8, 2, 2], dim=1)  # non-contiguous views, as the model passes them
    slots = [
        c.page_table[r, p // 8].item() * 8 + p % 8
        for r, (s, n) in enumerate(zip(seq_lens, q_lens))
        for p in range(s - n, s)
    ]  # fmt: skip
    md = AttentionMetadata(
        torch.tensor(slots, device=device), c.query_start_loc, c.seq_lens, c.page_table,
        max(q_lens), max(seq_lens), c.custom_mask,
    )  # fmt: skip
    k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
    kv_store.store_kv_ref(k, v, k_ref, v_ref, md.slot_mapping)
    ref = pa.paged_attention_ref(
        q, k_ref, v_ref, c.query_start_loc, c.seq_lens, c.page_table, 0.3, c.custom_mask
    )
    if cached:
        out = TritonBackend().forward(q, k, v, c.k_cache, c.v_cache, md, 0.3)
        assert torch.equal(c.k_cache, k_ref) and torch.equal(c.v_cache, v_ref)
    else:
        empty = torch.empty(0, device=device, dtype=dtype)
        out = TritonBackend().forward(q, k, v, empty, empty, md, 0.3)
    assert row_rel_error(out, ref) < tol


def check_fused_ops(dtype: torch.dtype, device: str, tol: float, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x, res = torch.randn(2, 5, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    out, res_out = fo.fused_add_rms_norm(x, res, w, 1e-6)
    ref, res_ref = fo.fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(res_out, res_ref)
    assert row_rel_error(out, ref) < tol
    assert row_rel_error(fo.rms_norm(x, w, 1e-6), fo.rms_norm_ref(x, w, 1e-6)) < tol
    gate_up = torch.randn(7, 2 * hidden, generator=gen).to(device, dtype)
    assert row_rel_error(fo.silu_and_mul(gate_up), fo.silu_and_mul_ref(gate_up)) < tol


# --------------------------------------------------------------------------------------------
# CPU: tiny fp32 shapes under the Triton interpreter

F32, CPU, TOL32 = torch.float32, "cpu", 1e-4
UNFUSED_SPLITS3 = {"num_splits": 3, "fused_combine": False}  # splits combined by a 2nd launch
INTERPRETER_CHECKS = {
    "store_kv": lambda: check_store_kv(F32, CPU, 13, 4),
    "decode_gqa4_splits3": lambda: check_attention(
        [1, 7, 33, 70], None, 4, 2, 16, 4, F32, CPU, TOL32, num_splits=3
    ),
    "decode_mha_odd_dim": lambda: check_attention([5, 40], None, 1, 3, 24, 16, F32, CPU, TOL32),
    # 24 splits of decode's KV blocks of 128, all non-empty at 3000 (the combine's loads take
    # 16 at a time)
    "decode_splits24_unfused": lambda: check_attention(
        [1, 7, 330, 3000], None, 4, 2, 16, 4, F32, CPU, TOL32, num_splits=24,
        fused_combine=False),
    "extend_causal": lambda: check_attention(
        [9, 40, 70], [9, 1, 21], 2, 2, 16, 4, F32, CPU, TOL32, num_splits=1, block_n=16
    ),
    "extend_causal_splits": lambda: check_attention(
        [9, 40, 70], [9, 1, 21], 3, 1, 16, 16, F32, CPU, TOL32, num_splits=2, block_n=16
    ),
    "extend_tree_mask": lambda: check_attention(
        [5, 20, 41], [5, 3, 5], 4, 2, 16, 4, F32, CPU, TOL32, mask_extra=0, num_splits=2
    ),
    "extend_wide_mask": lambda: check_attention(
        [6, 30], [2, 2], 2, 1, 16, 8, F32, CPU, TOL32, mask_extra=5, num_splits=1, block_n=16
    ),
    # splits combined in the attention launch (the default) vs by a second kernel
    "fused_decode_splits2": lambda: check_attention(
        [1, 7, 33, 70], None, 4, 2, 16, 4, F32, CPU, TOL32, seed=1, num_splits=2
    ),
    "fused_decode_splits3_mha": lambda: check_attention(
        [2, 5, 40], None, 1, 3, 24, 16, F32, CPU, TOL32, num_splits=3
    ),
    "fused_extend_causal_splits2": lambda: check_attention(
        [9, 40, 70], [9, 1, 21], 2, 2, 16, 4, F32, CPU, TOL32, num_splits=2, block_n=16
    ),
    "fused_extend_causal_splits3": lambda: check_attention(
        [9, 40, 70], [9, 1, 21], 3, 1, 16, 16, F32, CPU, TOL32, num_splits=3, block_n=16
    ),
    "fused_extend_tree_mask_splits2": lambda: check_attention(
        [5, 20, 41], [5, 3, 5], 4, 2, 16, 4, F32, CPU, TOL32, seed=2, mask_extra=0, num_splits=2
    ),
    "fused_extend_tree_mask_splits3": lambda: check_attention(
        [6, 30, 33], [2] * 3, 2, 1, 16, 8, F32, CPU, TOL32, mask_extra=5, num_splits=3, block_n=16
    ),
    "fused_counters": lambda: check_fused_combine_counters(F32, CPU, TOL32),
    "block_table_one_split": lambda: check_block_table(1),
    "block_table_splits2_gqa4": lambda: check_block_table(2, group=4),
    "unfused_decode_splits3": lambda: check_attention(
        [1, 7, 33, 70], None, 4, 2, 16, 4, F32, CPU, TOL32, **UNFUSED_SPLITS3
    ),
    "unfused_extend_tree_mask_splits3": lambda: check_attention(
        [5, 20, 41], [5, 3, 5], 4, 2, 16, 4, F32, CPU, TOL32, mask_extra=0, **UNFUSED_SPLITS3
    ),
    "backend_prefill_uncached": lambda: check_backend(F32, CPU, TOL32, tree=False, cached=False),
    "backend_decode": lambda: check_backend(F32, CPU, TOL32, tree=False, cached=True),
    "backend_verify": lambda: check_backend(F32, CPU, TOL32, tree=True, cached=True),
    "fused_ops": lambda: check_fused_ops(F32, CPU, 1e-5, 48),
}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


def test_backend_reports_availability() -> None:
    from specserve.layers.backends.triton_backend import available

    ok, reason = available()
    assert ok == HAS_CUDA and reason


# compile-only (tests/triton_compile.py): the Llama-3.1-8B launches of the GPU tests, in bf16
BF16, TOL16 = torch.bfloat16, 2e-2
GPU_DIM_CHECKS = {
    "bf16_store_kv_page16": lambda: check_store_kv(BF16, CPU, 13, 16),
    "bf16_decode_gqa4_page16": lambda: check_attention(
        [1, 300, 1000], None, 4, 8, 128, 16, BF16, CPU, TOL16
    ),
    "bf16_decode_page64_splits4": lambda: check_attention(
        [1, 300, 1000], None, 4, 8, 128, 64, BF16, CPU, TOL16, num_splits=4
    ),
    "bf16_decode_unfused_splits3": lambda: check_attention(
        [7, 700], None, 4, 8, 128, 16, BF16, CPU, TOL16, **UNFUSED_SPLITS3
    ),
    "bf16_extend_causal": lambda: check_attention(
        [90, 400], [90, 17], 4, 8, 128, 16, BF16, CPU, TOL16
    ),
    "bf16_verify_tree": lambda: check_attention(
        [40, 300], [16, 16], 4, 8, 128, 16, BF16, CPU, TOL16, mask_extra=0
    ),
    "bf16_backend_verify": lambda: check_backend(BF16, CPU, TOL16, tree=True, cached=True),
    "bf16_fused_ops_4096": lambda: check_fused_ops(BF16, CPU, TOL16, 4096),
}


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)


def test_split_counts_are_few_powers_of_two(monkeypatch) -> None:
    """Every grid gets a power of two within 2x of the two-wave count (at most MAX_SPLITS; the
    plans measured; the kernels take the count at run time: test_split_compiles.py)."""
    monkeypatch.setattr(split_kv, "_num_sms", lambda device: 132)
    seen = set()
    for programs in range(1, 700):
        want = max(1, min(split_kv.MAX_SPLITS, 2 * 132 // programs))
        got = split_kv.default_num_splits(programs, torch.device("cpu"))
        assert got & (got - 1) == 0 and got <= want < 2 * got, (programs, got, want)
        seen.add(got)
    assert seen == {1, 2, 4, 8, 16}
    # decode launches may split further: one more value
    assert split_kv.default_num_splits(1, torch.device("cpu"), 32) == 32
    assert split_kv.default_num_splits(8, torch.device("cpu"), 32) == 32  # bs 1 x 8 KV heads
    assert split_kv.default_num_splits(16, torch.device("cpu"), 32) == 16
