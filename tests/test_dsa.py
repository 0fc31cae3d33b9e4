"""DeepSeek sparse attention (GLM-5): the selection and the sparse attention against naive
references, the Triton kernels against their torch references, the sparse path against the
dense one where every visible token is selected, and CUDA-graph capture.

Naive references: visibility against the reference backend's attention masks, scores and the
top-k choice as per-(token, position) Python loops over page lists, and dense absorbed MLA
(kernels/mla_attention.py) for sparse attention over every visible slot. Fresh random inputs,
NaN-poisoned outputs. Kernels run under the Triton interpreter on the CPU (one subprocess:
`TRITON_INTERPRET=1 python tests/test_dsa.py`; it also runs the tiny GLM-5 through the Triton
backend against transformers) and at GLM-5 dims in bf16 on a GPU (`gpu`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from interpreted import interpreter_test, report  # noqa: E402
from test_kernels import gpu_test, row_rel_error, tree_mask  # noqa: E402

from specserve.kernels import dsa_index as di  # noqa: E402
from specserve.kernels import mla_attention as ma  # noqa: E402
from specserve.kernels import sparse_mla as sm  # noqa: E402
from specserve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from specserve.layers.backends.torch_ref import attention_mask  # noqa: E402
from specserve.worker.forward_batch import build_attention_metadata  # noqa: E402


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    page_size: int,
    tree: bool,
    gen: torch.Generator,
    device: str = "cpu",
):  # noqa: ANN201
    """Attention metadata over shuffled pages (some pages nobody's), with a random tree mask
    of width max(q_lens) + 2 when `tree`; returns (md, page lists, num_pages)."""
    pages = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    lists, used = [], 0
    for n in pages:
        lists.append(order[used : used + n])
        used += n
    mask = None
    if tree:
        max_q = max(q_lens)
        mask = torch.zeros(len(q_lens), max_q, max_q + 2, dtype=torch.bool)
        for r, q in enumerate(q_lens):
            mask[r, :q, max_q - q :] = tree_mask(q, q + 2, gen)
    md = build_attention_metadata(q_lens, seq_lens, lists, page_size, device, mask)
    return md, lists, num_pages


def naive_visible(md, r: int, i: int, s: int) -> bool:  # noqa: ANN001
    q_len, seq_len = md.query_lens_cpu[r], md.seq_lens_cpu[r]
    custom = None if md.custom_mask is None else md.custom_mask[r].cpu()
    return s < seq_len and bool(attention_mask(q_len, seq_len, custom, torch.device("cpu"))[i, s])


CASES = [  # (seq_lens, q_lens, page_size, tree)
    ([9, 30, 4], [1, 1, 1], 4, False),  # decode
    ([12, 25, 7], [5, 3, 7], 4, False),  # causal extend after a cached prefix
    ([14, 20], [4, 4], 2, True),  # verify with a tree mask (wider than q_len)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_visible_matches_attention_masks(case: int) -> None:
    seq_lens, q_lens, page_size, tree = CASES[case]
    md, _, _ = make_batch(seq_lens, q_lens, page_size, tree, torch.Generator().manual_seed(case))
    width = md.page_table.shape[1] * page_size
    num_tokens = sum(q_lens) + 2  # two padding tokens past the last request
    token_req = di.token_requests(md.query_start_loc, num_tokens)
    got = di.visible(md.query_start_loc, md.seq_lens, md.custom_mask, token_req, width)
    t = 0
    for r, q_len in enumerate(q_lens):
        for i in range(q_len):
            want = [naive_visible(md, r, i, s) for s in range(width)]
            assert got[t].tolist() == want, (r, i)
            t += 1
    assert not got[t:].any()  # padding sees nothing


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sparse_over_every_visible_slot_is_dense(case: int) -> None:
    """Sparse attention over all visible slots (k >= every visible set) == dense absorbed
    MLA over the paged cache (causal or tree mask)."""
    seq_lens, q_lens, page_size, tree = CASES[case]
    gen = torch.Generator().manual_seed(20 + case)
    md, _, num_pages = make_batch(seq_lens, q_lens, page_size, tree, gen)
    heads, rank, rope = 4, 16, 8
    cache = torch.randn(num_pages, page_size, rank + rope, generator=gen)
    q_lat = torch.randn(sum(q_lens), heads, rank, generator=gen)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen)
    width = md.page_table.shape[1] * page_size
    scores = torch.randn(sum(q_lens), width, generator=gen)  # any order: all get selected
    token_req = di.token_requests(md.query_start_loc, sum(q_lens))
    seen = di.visible(md.query_start_loc, md.seq_lens, md.custom_mask, token_req, width)
    slots = di.select_slots(scores.masked_fill(~seen, float("-inf")), width, md.query_start_loc,
                            md.page_table, page_size)  # fmt: skip
    got = sm.sparse_mla_ref(q_lat, q_pe, cache, slots, 0.3)
    want = ma.mla_attention_ref(q_lat, q_pe, cache, md.query_start_loc, md.seq_lens,
                                md.page_table, 0.3, md.custom_mask)  # fmt: skip
    assert (got - want).abs().max().item() < 1e-5


def test_forced_sparse_layers_equal_dense_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny GLM-5 with index_topk above every length: its layers forced onto the sparse
    path (indexer, top-k, sparse attention) give the dense path's logits, prefill and decode;
    scoring the prefill one token at a time changes nothing."""
    from engine_drivers import PagedSession
    from tiny_models import make_tiny_checkpoint

    from specserve.config import ModelConfig
    from specserve.layers import dsa
    from specserve.layers.dsa import DSAAttention
    from specserve.models.loader import load_model

    path = make_tiny_checkpoint(tmp_path / "glm5", "glm_moe_dsa")
    model = load_model(ModelConfig.from_hf(path), path, torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, DSAAttention)]
    assert len(layers) == 3
    prompts = {0: [5, 17, 300, 2, 41, 7, 99, 12, 8], 1: [3, 4, 5]}
    runs = []
    for sparse, chunk in (
        (False, dsa.SCORE_CHUNK_VALUES),
        (True, dsa.SCORE_CHUNK_VALUES),
        (True, 3),
    ):  # 3 scores at a time: one token per chunk
        monkeypatch.setattr(dsa, "SCORE_CHUNK_VALUES", chunk)
        for m in layers:
            m.force_sparse = sparse
        session = PagedSession(model, num_pages=16, page_size=4)
        out = session.step(prompts)
        out += session.step({0: [11], 1: [77]})
        runs.append(torch.cat(out))
    assert (runs[0] - runs[1]).abs().max().item() < 1e-5
    assert torch.equal(runs[1], runs[2])


def test_uncached_prefill_matches_transformers(tmp_path: Path) -> None:
    """A forward before any KV pool is bound (every request a fresh prefill, its tokens their
    own scratch cache), sparse attention engaged (index_topk 4): transformers' logits."""
    from tiny_models import make_hf_model, make_tiny_checkpoint

    from specserve.config import ModelConfig
    from specserve.layers.attention_metadata import ForwardContext, set_forward_context
    from specserve.layers.backends.torch_ref import TorchRefBackend
    from specserve.models.loader import load_model
    from specserve.worker.forward_batch import build_positions

    kw = dict(index_topk=4, indexer_types=["full", "shared", "full"])
    path = make_tiny_checkpoint(tmp_path / "glm5", "glm_moe_dsa", **kw)
    model = load_model(ModelConfig.from_hf(path), path, torch.float32, torch.device("cpu"))
    prompts = [[5, 17, 300, 2, 41, 7, 99, 12, 8, 77, 31], [3, 4, 5, 6, 7, 8]]
    lens = [len(p) for p in prompts]
    md = build_attention_metadata(lens, lens, [[0, 1, 2], [3, 4]], 4, "cpu")
    set_forward_context(ForwardContext(md, TorchRefBackend()))
    try:
        with torch.no_grad():
            hidden = model(
                torch.tensor(prompts[0] + prompts[1]), build_positions(lens, lens, "cpu")
            )
            got = model.compute_logits(hidden).split(lens)
    finally:
        set_forward_context(None)
    hf = make_hf_model("glm_moe_dsa", **kw)
    with torch.no_grad():
        for p, logits in zip(prompts, got):
            assert (logits - hf(torch.tensor([p])).logits[0]).abs().max().item() < 1e-4


# -- kernels vs references (interpreter on the CPU, bf16 at GLM-5 dims on a GPU) -------------


def check_index_scores(seq_lens: list[int], q_lens: list[int], page_size: int, tree: bool,
                       heads: int, dim: int, dtype: torch.dtype, device: str, tol: float,
                       seed: int = 0) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    md, _, num_pages = make_batch(seq_lens, q_lens, page_size, tree, gen, device)
    t = sum(q_lens) + 1  # one padding token
    cache = torch.randn(num_pages, page_size, dim, generator=gen).to(device, dtype)
    q = torch.randn(t, heads, dim, generator=gen).to(device, dtype)
    w = torch.randn(t, heads, generator=gen).to(device)
    got = di.index_scores(q, w, cache, md.query_start_loc, md.seq_lens, md.page_table,
                          md.custom_mask, block_n=16)  # fmt: skip
    want = di.index_scores_ref(q, w, cache, md.query_start_loc, md.seq_lens, md.page_table,
                               md.custom_mask)  # fmt: skip
    # the kernel writes the columns below each token's request length only (the padding
    # token: none); the reference's -inf past them is never read
    written = written_columns(md, t, got.shape[1])
    assert not written[-1].any() and (want[~written] == float("-inf")).all()
    got, want = got[written], want[written]
    inf = want == float("-inf")
    assert torch.equal(got == float("-inf"), inf)
    scale = want[~inf].abs().max().item()
    assert (got[~inf] - want[~inf]).abs().max().item() <= tol * scale
    # scored in two chunks of tokens (a long prefill): the same rows
    a = t // 2
    parts = [di.index_scores(q[lo:hi], w[lo:hi], cache, md.query_start_loc, md.seq_lens,
                             md.page_table, md.custom_mask, first_token=lo, block_n=16)
             for lo, hi in ((0, a), (a, t))]  # fmt: skip
    assert torch.equal(torch.cat(parts)[written], got)


def written_columns(md: AttentionMetadata, num_tokens: int, width: int) -> torch.Tensor:
    """[T, width] bool: the columns below each token's request length (padding: none)."""
    token_req = di.token_requests(md.query_start_loc, num_tokens).cpu()
    lens = torch.cat([md.seq_lens.cpu().long(), torch.zeros(1, dtype=torch.long)])
    return torch.arange(width)[None, :] < lens[token_req.clamp(max=len(lens) - 1)][:, None]


def check_sparse_attention(num_tokens: int, heads: int, rank: int, rope: int, k: int,
                           page_size: int, num_splits: int | None, dtype: torch.dtype,
                           device: str, tol: float, seed: int = 0) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    num_pages = 3 + num_tokens * k // page_size
    cache = torch.randn(num_pages, page_size, rank + rope, generator=gen).to(device, dtype)
    slots = torch.stack([torch.randperm(num_pages * page_size, generator=gen)[:k]
                         for _ in range(num_tokens)])  # fmt: skip
    slots[torch.rand(num_tokens, k, generator=gen) < 0.3] = -1
    slots[-1] = -1  # a token that selected nothing outputs 0
    slots = slots.to(device)
    q_lat = torch.randn(num_tokens, heads, rank, generator=gen).to(device, dtype)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen).to(device, dtype)
    scale = (rank + rope) ** -0.5
    got = sm.sparse_mla_attention(q_lat, q_pe, cache, slots, scale, num_splits=num_splits)
    want = sm.sparse_mla_ref(q_lat, q_pe, cache, slots, scale)
    assert got.shape == want.shape and got[-1].abs().max().item() == 0.0
    if num_tokens > 1:  # the last row selects nothing; the others are compared
        assert row_rel_error(got[:-1], want[:-1]) < tol


def check_model_on_triton_backend() -> None:
    """The tiny GLM-5 (index_topk 4, a shared indexer layer) through the Triton backend's MLA
    and DSA kernels over a paged cache, prefill then decode: transformers' logits."""
    import tempfile

    from engine_drivers import PagedSession
    from tiny_models import make_hf_model, make_tiny_checkpoint

    from specserve.config import ModelConfig
    from specserve.layers.backends.triton_backend import TritonBackend
    from specserve.models.loader import load_model

    kw = dict(index_topk=4, indexer_types=["full", "shared", "full"])
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(tmp, "glm_moe_dsa", **kw)
        model = load_model(ModelConfig.from_hf(path), path, torch.float32, torch.device("cpu"))
    prompt = [5, 17, 300, 2, 41, 7, 99, 12, 8, 77, 31]
    session = PagedSession(model, num_pages=16, page_size=4)
    session.backend = TritonBackend()
    got = session.step({0: prompt[:8]}) + [session.step({0: [t]})[0] for t in prompt[8:]]
    with torch.no_grad():
        want = make_hf_model("glm_moe_dsa", **kw)(torch.tensor([prompt])).logits[0]
    assert (torch.cat(got) - want).abs().max().item() < 1e-4


INTERPRETER_CHECKS = {
    "glm5_model_on_triton_backend": check_model_on_triton_backend,
    "scores_decode": lambda: check_index_scores(*CASES[0], 3, 16, torch.float32, "cpu", 1e-5),
    "scores_extend": lambda: check_index_scores(*CASES[1], 2, 24, torch.float32, "cpu", 1e-5),
    "scores_tree": lambda: check_index_scores(*CASES[2], 4, 16, torch.float32, "cpu", 1e-5),
    "sparse_one_split": lambda: check_sparse_attention(
        5, 3, 16, 8, 40, 4, 1, torch.float32, "cpu", 1e-5
    ),
    "sparse_splits": lambda: check_sparse_attention(
        4, 20, 24, 8, 70, 16, 3, torch.float32, "cpu", 1e-5
    ),
}


test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


@gpu_test
@pytest.mark.parametrize("case", range(len(CASES)))
def test_index_scores_gpu(case: int) -> None:
    seq_lens, q_lens, page_size, tree = CASES[case]
    long = [s * 97 for s in seq_lens]  # thousands of positions
    check_index_scores(long, q_lens, 64, tree, 32, 128, torch.bfloat16, "cuda", 2e-2, case)


@gpu_test
@pytest.mark.parametrize("num_tokens,heads,num_splits", [(1, 64, None), (8, 64, 4),
                                                         (33, 16, 1)])  # fmt: skip
def test_sparse_attention_gpu(num_tokens: int, heads: int, num_splits: int | None) -> None:
    check_sparse_attention(num_tokens, heads, 512, 64, 2048, 64, num_splits, torch.bfloat16,
                           "cuda", 2e-2)  # fmt: skip


@gpu_test
@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_selection_and_attention_capture_in_a_graph(backend: str) -> None:
    """Scores, top-k and sparse attention of a decode batch captured in one CUDA graph, then
    replayed with other lengths and inputs: the replay equals an eager run (both paths are
    graph-safe: no host sync, no length-dependent shape)."""
    from specserve.layers.backends.torch_ref import TorchDSA
    from specserve.layers.backends.triton_backend import TritonDSA

    ops = TorchDSA() if backend == "torch_ref" else TritonDSA()
    gen = torch.Generator().manual_seed(0)
    bs, page_size, pages_per_req, k = 4, 64, 40, 512
    num_pages = bs * pages_per_req + 1
    dev, dt = "cuda", torch.bfloat16
    index_cache = torch.randn(num_pages, page_size, 128, generator=gen).to(dev, dt)
    latent = torch.randn(num_pages, page_size, 576, generator=gen).to(dev, dt)
    static = {
        "q": torch.zeros(bs, 32, 128, device=dev, dtype=dt),
        "w": torch.zeros(bs, 32, device=dev),
        "q_lat": torch.zeros(bs, 16, 512, device=dev, dtype=dt),
        "q_pe": torch.zeros(bs, 16, 64, device=dev, dtype=dt),
        "seq_lens": torch.ones(bs, dtype=torch.int32, device=dev),
        "page_table": torch.arange(bs * pages_per_req, dtype=torch.int32, device=dev).view(
            bs, -1
        ),  # fmt: skip
    }
    qsl = torch.arange(bs + 1, dtype=torch.int32, device=dev)

    def step(s: dict) -> torch.Tensor:
        md = AttentionMetadata(torch.zeros(bs, dtype=torch.long, device=dev), qsl, s["seq_lens"],
                               s["page_table"], 1, pages_per_req * page_size)  # fmt: skip
        slots = ops.select(s["q"], s["w"], index_cache, md, k)
        return ops.sparse_absorbed(s["q_lat"], s["q_pe"], latent, slots, 0.0625)

    def fill(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in ("q", "w", "q_lat", "q_pe"):
            static[name].copy_(torch.randn(static[name].shape, generator=g))
        lens = torch.randint(1, pages_per_req * page_size, (bs,), generator=g)
        lens[0] = 300  # below k: every position selected
        static["seq_lens"].copy_(lens)

    fill(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(static)  # warm-up (kernel compilation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)
    for seed in (2, 3):
        fill(seed)
        graph.replay()
        want = step({n: t.clone() for n, t in static.items()})
        assert row_rel_error(out, want) < 1e-3


# compile-only (tests/triton_compile.py): GLM-5 dims (indexer 32 x 128, rank 512, rope 64), bf16
GPU_DIM_CHECKS = {
    **{f"bf16_scores_case{i}": (lambda i=i: check_index_scores(
        [s * 9 for s in CASES[i][0]], CASES[i][1], 64, CASES[i][3], 32, 128, torch.bfloat16,
        "cpu", 2e-2, i)) for i in range(len(CASES))},
    "bf16_sparse_h64": lambda: check_sparse_attention(
        1, 64, 512, 64, 2048, 64, None, torch.bfloat16, "cpu", 2e-2
    ),
    "bf16_sparse_h16_splits4": lambda: check_sparse_attention(
        8, 16, 512, 64, 2048, 64, 4, torch.bfloat16, "cpu", 2e-2
    ),
}  # fmt: skip


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
