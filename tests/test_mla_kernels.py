"""MLA Triton kernels vs their torch references: the latent write with rope (interleaved and
rotate-half, skipped slots, strided inputs), the absorbed attention (decode, causal extend
after a cached prefix, tree masks of width q_len and wider, KV splits, page sizes 1..64,
latent widths that are not powers of two), and the Triton MLA backend's compute and absorbed
forms against the torch backend's. Fresh random inputs, NaN-poisoned outputs.

GPU tests (marker `gpu`) run bf16 at DeepSeek-V3 / Kimi dims (L 512, R 64, 16..128 heads). On
the CPU the same checks run on tiny fp32 shapes under the Triton interpreter in one
subprocess (TRITON_INTERPRET must be set before triton is imported):
`TRITON_INTERPRET=1 python tests/test_mla_kernels.py [kernels|layer]` prints a JSON line of
results ("layer": the MLA layer on the interpreted Triton backend against transformers).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from interpreted import interpreter_test, report, run_shards  # noqa: E402
from test_kernels import gpu_test, row_rel_error, tree_mask  # noqa: E402

from specserve.kernels import mla_attention as ma  # noqa: E402
from specserve.kernels import mla_store as ms  # noqa: E402
from specserve.layers.attention_metadata import AttentionMetadata  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None


def paged_latent(
    seq_lens: list[int], width: int, page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent cache [pages, page_size, width] and shuffled page tables [bs, max + 2]
    (-1 past each request's pages; some pages belong to nobody)."""
    pages = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages) + 3
    order = torch.randperm(num_pages, generator=gen).int()
    table = torch.full((len(seq_lens), max(pages) + 2), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        table[r, :n] = order[used : used + n]
        used += n
    return torch.randn(num_pages, page_size, width, generator=gen), table


def check_store(
    dtype: torch.dtype,
    device: str,
    num_tokens: int,
    heads: int,
    rank: int,
    rope: int,
    page_size: int,
    interleaved: bool,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + rank)
    num_pages = 2 + num_tokens // page_size
    cache = torch.randn(num_pages, page_size, rank + rope, generator=gen).to(device, dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # skipped tokens
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    angles = torch.rand(60, rope // 2, generator=gen) * 6.3
    cos_sin = (1.1 * torch.cat([angles.cos(), angles.sin()], dim=-1)).to(device)
    # strided views, as the layer passes them: q_pe of q [T, N, P + R], c / k_pe of [T, L + R]
    q = torch.randn(num_tokens, heads, 5 + rope, generator=gen).to(device, dtype)
    kv = torch.randn(num_tokens, rank + rope, generator=gen).to(device, dtype)
    c_kv, k_pe = kv[:, :rank].contiguous(), kv[:, rank:]
    q_ref, cache_ref = q.clone(), cache.clone()
    ms.mla_store(
        positions.to(device), q[..., 5:], c_kv, k_pe, cos_sin, cache, slots.to(device), interleaved
    )
    ms.mla_store_ref(
        positions.to(device),
        q_ref[..., 5:],
        c_kv,
        k_pe,
        cos_sin,
        cache_ref,
        slots.to(device),
        interleaved,
    )
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.equal(q[..., :5], q_ref[..., :5])
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, cache_ref, atol=tol, rtol=tol)
    assert torch.equal(cache[..., :rank], cache_ref[..., :rank])  # c_kv copied, not rounded
    if interleaved:  # a pair's two values moved together: the halves layout would differ
        other = q.clone()
        ms.mla_store_ref(
            positions.to(device),
            other[..., 5:],
            c_kv,
            k_pe,
            cos_sin,
            cache_ref.clone(),
            slots.to(device),
            False,
        )
        assert not torch.allclose(other, q_ref, atol=tol, rtol=tol)


def check_attention(
    seq_lens: list[int],
    q_lens: list[int] | None,
    heads: int,
    rank: int,
    rope: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    tol: float,
    seed: int = 0,
    mask_extra: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> None:
    """q_lens None = decode (query_start_loc None). mask_extra: None = causal; else a tree
    mask of width max(q_lens) + mask_extra."""
    gen = torch.Generator().manual_seed(seed)
    decode = q_lens is None
    q_lens = q_lens or [1] * len(seq_lens)
    cache, table = paged_latent(seq_lens, rank + rope, page_size, gen)
    t, max_q = sum(q_lens), max(q_lens)
    # q_lat as the absorption bmm leaves it: [N, T, L] transposed to [T, N, L]
    q_lat = torch.randn(heads, t, rank, generator=gen).transpose(0, 1)
    q_pe = torch.randn(t, heads, 3 + rope, generator=gen)[..., 3:]
    mask = None
    if mask_extra is not None:
        mask = torch.zeros(len(q_lens), max_q, max_q + mask_extra, dtype=torch.bool)
        for r, q_len in enumerate(q_lens):
            mask[r, :q_len, max_q - q_len :] = tree_mask(q_len, q_len + mask_extra, gen)
        mask = mask.to(device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_lat, q_pe, cache = q_lat.to(device, dtype), q_pe.to(device, dtype), cache.to(device, dtype)
    qsl, table = qsl.to(device), table.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full((t, heads, rank), float("nan"), dtype=dtype, device=device)
    ma.mla_attention(
        q_lat,
        q_pe,
        cache,
        None if decode else qsl,
        lens,
        table,
        max_q,
        0.3,
        mask,
        out,
        num_splits,
        block_n,
    )
    ref = ma.mla_attention_ref(q_lat, q_pe, cache, qsl, lens, table, 0.3, mask)
    err = row_rel_error(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol} (seq_lens {seq_lens}, q_lens {q_lens})"


def check_backend(
    dtype: torch.dtype, device: str, tol: float, heads: int, dims: tuple, page_size: int, tree: bool
) -> None:
    """TritonMLA.compute and .absorbed vs TorchMLA's (a different implementation: gathers,
    expansion, and softmax in torch), causal after a cached prefix or under a tree mask."""
    from specserve.layers.backends.torch_ref import TorchMLA
    from specserve.layers.backends.triton_backend import TritonMLA

    rank, nope, rope, v_dim = dims
    gen = torch.Generator().manual_seed(heads)
    q_lens, seq_lens = ([4, 4, 4], [9, 4, 30]) if tree else ([5, 1, 12], [5, 20, 40])
    cache, table = paged_latent(seq_lens, rank + rope, page_size, gen)
    mask = None
    if tree:
        mask = torch.stack([tree_mask(4, 4, gen) for _ in q_lens]).to(device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    md = AttentionMetadata(
        torch.zeros(sum(q_lens), dtype=torch.long, device=device), qsl.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device), max(q_lens),
        max(seq_lens), mask, q_lens, seq_lens,
    )  # fmt: skip
    w_kv = (torch.randn(heads * (nope + v_dim), rank, generator=gen) / rank**0.5).to(device, dtype)

    def expand(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = (c @ w_kv.T).view(c.shape[0], heads, nope + v_dim)
        return kv[..., :nope], kv[..., nope:]

    cache = cache.to(device, dtype)
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=gen).to(device, dtype)
    got = TritonMLA().compute(q, cache, md, 0.25, rank, expand)
    want = TorchMLA().compute(q, cache, md, 0.25, rank, expand)
    assert row_rel_error(got, want) < tol, "compute form"
    q_lat = torch.randn(sum(q_lens), heads, rank, generator=gen).to(device, dtype)
    got = TritonMLA().absorbed(q_lat, q[..., nope:], cache, md, 0.25)
    want = TorchMLA().absorbed(q_lat, q[..., nope:], cache, md, 0.25)
    assert row_rel_error(got, want) < tol, "absorbed form"


def check_layer(name: str, form: str, cases: tuple[int, ...]) -> None:
    """The MLA layer on the Triton backend against transformers (tests/mla_reference.py's
    checks: CASES[i] for i in `cases`, then a tree verify)."""
    from mla_reference import CASES, Pair, check_schedule, tree_verify

    from specserve.layers.backends.triton_backend import TritonBackend

    pair = Pair(name, form)
    for i in cases:
        kind, lens, page_size = CASES[i]
        check_schedule(pair, kind, lens, page_size, CPU, TritonBackend(), seed=i)
    tree_verify(pair, CPU, TritonBackend())


# --------------------------------------------------------------------------------------------
# CPU: tiny fp32 shapes under the Triton interpreter

F32, CPU, TOL32 = torch.float32, "cpu", 1e-4
INTERPRETER_CHECKS = {
    "store_interleaved": lambda: check_store(F32, CPU, 13, 3, 16, 8, 4, True),
    "store_halves_page1": lambda: check_store(F32, CPU, 9, 5, 24, 6, 1, False),
    "decode_splits3": lambda: check_attention(
        [1, 7, 33, 70], None, 4, 16, 8, 4, F32, CPU, TOL32, num_splits=3
    ),
    "decode_one_split_page16": lambda: check_attention(
        [5, 40], None, 8, 16, 8, 16, F32, CPU, TOL32, num_splits=1
    ),
    "decode_odd_rank_heads": lambda: check_attention(
        [3, 29], None, 5, 24, 6, 4, F32, CPU, TOL32, num_splits=2
    ),
    "extend_causal": lambda: check_attention(
        [9, 40, 70], [9, 1, 21], 4, 16, 8, 4, F32, CPU, TOL32, num_splits=1
    ),
    "extend_causal_splits_page1": lambda: check_attention(
        [9, 30], [9, 13], 2, 16, 8, 1, F32, CPU, TOL32, num_splits=2
    ),
    "extend_tree_mask": lambda: check_attention(
        [5, 20, 41], [5, 3, 5], 4, 16, 8, 4, F32, CPU, TOL32, mask_extra=0, num_splits=2
    ),
    "extend_wide_mask": lambda: check_attention(
        [6, 30], [2, 2], 8, 16, 8, 8, F32, CPU, TOL32, mask_extra=5, num_splits=3
    ),
    "backend_causal": lambda: check_backend(F32, CPU, TOL32, 4, (16, 8, 8, 16), 4, False),
    "backend_tree_page1": lambda: check_backend(F32, CPU, TOL32, 2, (16, 16, 8, 8), 1, True),
}
LAYER_CHECKS = {  # the whole layer on the interpreted kernels (~10 s on 2 idle cores)
    # auto: prefill chunks in the compute form, decode and verify absorbed
    "layer_vs_hf_auto": lambda: check_layer("yarn_interleaved", "auto", (0, 3)),
    "layer_vs_hf_absorbed": lambda: check_layer("qproj_neox_bias", "absorbed", (1,)),
}
GROUPS = {"kernels": INTERPRETER_CHECKS, "layer": LAYER_CHECKS}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS,
                                    run=lambda path: run_shards(path, "kernels"))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_layer_interpreter() -> None:
    results = run_shards(__file__, "layer")
    assert all(v == "ok" for v in results.values()), results


def test_reference_against_naive_loop() -> None:
    """The attention reference against a per-(query, head) Python loop (plain softmax)."""
    gen = torch.Generator().manual_seed(0)
    seq_lens, q_lens, heads, rank, rope = [6, 11], [2, 3], 3, 8, 4
    cache, table = paged_latent(seq_lens, rank + rope, 4, gen)
    q_lat = torch.randn(5, heads, rank, generator=gen)
    q_pe = torch.randn(5, heads, rope, generator=gen)
    mask = torch.zeros(2, 3, 4, dtype=torch.bool)
    mask[0, :2, 2:] = tree_mask(2, 2, gen)
    mask[1, :3, 1:] = tree_mask(3, 3, gen)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    for custom in (None, mask):
        ref = ma.mla_attention_ref(q_lat, q_pe, cache, qsl, lens, table, 0.5, custom)
        for r, (start, q_len, s) in enumerate(zip([0, 2], q_lens, seq_lens)):
            rows = [cache[table[r, p // 4], p % 4] for p in range(s)]
            for i in range(q_len):
                visible = [
                    j <= s - q_len + i
                    if custom is None
                    else (j < s - 4 or bool(custom[r, i, j - (s - 4)]))
                    for j in range(s)
                ]
                for h in range(heads):
                    q = torch.cat([q_lat[start + i, h], q_pe[start + i, h]])
                    scores = [(q @ rows[j]).item() * 0.5 for j in range(s) if visible[j]]
                    w = torch.tensor(scores).softmax(0)
                    seen = [rows[j][:rank] for j in range(s) if visible[j]]
                    want = sum(wj * c for wj, c in zip(w, seen))
                    torch.testing.assert_close(ref[start + i, h], want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# GPU: bf16 at the real dims

BF16, CUDA, TOL16 = torch.bfloat16, "cuda", 2e-2
_gen = torch.Generator().manual_seed(3)
SEQ_LENS = {
    "mixed": [1, 7, 100, 1000, 4097],
    "many": torch.randint(1, 3000, (40,), generator=_gen).tolist(),
}


@gpu_test
@pytest.mark.parametrize("num_splits", [None, 7])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("lens", sorted(SEQ_LENS))
def test_decode_gpu(lens: str, heads: int, page_size: int, num_splits: int | None) -> None:
    check_attention(
        SEQ_LENS[lens], None, heads, 512, 64, page_size, BF16, CUDA, TOL16, num_splits=num_splits
    )


@gpu_test
@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [([100, 1000, 4097], [37, 256, 1000]), ([9, 300, 4097, 64], [1, 1, 1, 1])],
)
def test_extend_causal_gpu(
    seq_lens: list[int], q_lens: list[int], heads: int, num_splits: int | None
) -> None:
    check_attention(seq_lens, q_lens, heads, 512, 64, 64, BF16, CUDA, TOL16, num_splits=num_splits)


@gpu_test
@pytest.mark.parametrize("mask_extra", [0, 6])
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("bs,num_draft", [(1, 8), (8, 16), (33, 4)])
def test_verify_tree_mask_gpu(bs: int, num_draft: int, heads: int, mask_extra: int) -> None:
    seq_lens = [num_draft + mask_extra + n for n in SEQ_LENS["many"][:bs]]
    check_attention(
        seq_lens,
        [num_draft] * bs,
        heads,
        512,
        64,
        16,
        BF16,
        CUDA,
        TOL16,
        seed=bs,
        mask_extra=mask_extra,
    )


@gpu_test
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("page_size", [16, 64])
def test_store_gpu(page_size: int, interleaved: bool) -> None:
    check_store(BF16, CUDA, 1000, 64, 512, 64, page_size, interleaved)


@gpu_test
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("heads", [16, 64])
def test_backend_gpu(heads: int, tree: bool) -> None:
    check_backend(BF16, CUDA, TOL16, heads, (512, 128, 64, 128), 64, tree)


# compile-only (tests/triton_compile.py): Kimi K2 / DeepSeek-V3 dims (rank 512, rope 64), bf16
GPU_DIM_CHECKS = {
    "bf16_store_page64": lambda: check_store(BF16, CPU, 100, 64, 512, 64, 64, True),
    "bf16_decode_h16_page16": lambda: check_attention(
        [1, 7, 100, 1000], None, 16, 512, 64, 16, BF16, CPU, TOL16
    ),
    "bf16_decode_h128_page64_splits7": lambda: check_attention(
        [1, 100, 1000], None, 128, 512, 64, 64, BF16, CPU, TOL16, num_splits=7
    ),
    "bf16_extend_causal_h16": lambda: check_attention(
        [90, 400], [90, 17], 16, 512, 64, 64, BF16, CPU, TOL16
    ),
    "bf16_verify_tree_h64": lambda: check_attention(
        [40, 300], [8, 8], 64, 512, 64, 16, BF16, CPU, TOL16, mask_extra=6
    ),
    "bf16_backend_tree": lambda: check_backend(BF16, CPU, TOL16, 16, (512, 128, 64, 128), 64, True),
}


if __name__ == "__main__":
    torch.manual_seed(0)
    group = sys.argv[1] if len(sys.argv) > 1 else "kernels"
    report(GROUPS[group], GPU_DIM_CHECKS if group == "kernels" else None)
