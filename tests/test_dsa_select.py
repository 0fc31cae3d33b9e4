"""DeepSeek sparse attention's top-k choice: select_slots (torch) against per-token Python
loops, and the Triton selection (kernels/dsa_select.py: one program a token, or the split form
over several) against select_slots.

The kernel reads each token's scores below its request's length only and writes the chosen
slots in ascending position order; select_slots ranks the whole row and sorts its choice the
same way, so the two agree element for element. Ties (ReLU's exact zeros, small integer
scores, -0.0 beside 0.0) go to the lower position. Kernel checks run under the Triton
interpreter on the CPU (one subprocess: `TRITON_INTERPRET=1 python tests/test_dsa_select.py`),
compile for sm_90 in tests/test_triton_compile.py, and run at GLM-5 widths on a GPU (`gpu`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from interpreted import compiling, interpreter_test, report  # noqa: E402
from test_dsa import CASES, make_batch, naive_visible  # noqa: E402
from test_kernels import gpu_test  # noqa: E402

from specserve.kernels import dsa_index as di  # noqa: E402
from specserve.kernels import dsa_select as ds  # noqa: E402

ONE_PROGRAM_MAX_WIDTH = ds.ONE_PROGRAM_MAX_WIDTH


@pytest.mark.parametrize("case", range(len(CASES)))
def test_scores_and_selection_against_loops(case: int) -> None:
    """index_scores_ref and select_slots against per-token Python loops over the page lists:
    score = sum_h w relu(q . k); the top k visible positions (any among equal scores: relu
    makes exact zeros) in ascending position order, -1 after them where fewer are visible."""
    seq_lens, q_lens, page_size, tree = CASES[case]
    gen = torch.Generator().manual_seed(10 + case)
    md, lists, num_pages = make_batch(seq_lens, q_lens, page_size, tree, gen)
    heads, dim, k = 3, 8, 6
    cache = torch.randn(num_pages, page_size, dim, generator=gen)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    w = torch.randn(sum(q_lens), heads, generator=gen)
    scores = di.index_scores_ref(q, w, cache, md.query_start_loc, md.seq_lens, md.page_table,
                                 md.custom_mask)  # fmt: skip
    slots = di.select_slots(scores, k, md.query_start_loc, md.page_table, page_size)
    t = 0
    for r, q_len in enumerate(q_lens):
        for i in range(q_len):
            seen = {}
            for s in range(scores.shape[1]):
                if naive_visible(md, r, i, s):
                    key = cache[lists[r][s // page_size], s % page_size]
                    seen[s] = sum(w[t, h] * max(float(q[t, h] @ key), 0.0) for h in range(heads))
                    assert abs(scores[t, s].item() - seen[s]) < 1e-4
                else:
                    assert scores[t, s].item() == float("-inf")
            # the selected positions: visible, ascending (so distinct), the k best scores
            pos_of = {lists[r][s // page_size] * page_size + s % page_size: s for s in seen}
            row = slots[t].tolist()
            n = min(k, len(seen))
            assert all(x >= 0 for x in row[:n]) and row[n:] == [-1] * (k - n)
            chosen = [pos_of[x] for x in row[:n]]
            assert chosen == sorted(set(chosen))
            best = sorted(seen.values(), reverse=True)[:k]
            got_best = sorted((seen[s] for s in chosen), reverse=True)
            assert max(abs(a - b) for a, b in zip(got_best, best)) < 1e-4
            t += 1


def test_selection_breaks_ties_toward_the_earlier_position() -> None:
    """Equal scores (ReLU's exact zeros, here small integers too) select the lowest positions,
    as a Python sort by (-score, position) does; -0.0 ties with 0.0."""
    gen = torch.Generator().manual_seed(3)
    t, width, page_size, k = 7, 40, 4, 9
    scores = torch.randint(-2, 3, (t, width), generator=gen).float()
    scores[scores == -2] = float("-inf")
    scores[0, :5] = -0.0  # signed zeros among the zeros
    table = torch.arange(width // page_size, dtype=torch.int32)[None, :]
    qsl = torch.tensor([0, t], dtype=torch.int32)
    slots = di.select_slots(scores, k, qsl, table, page_size)
    for row in range(t):
        seen = [p for p in range(width) if scores[row, p] > float("-inf")]
        want = sorted(seen, key=lambda p: (-(scores[row, p].item() + 0.0), p))[:k]
        got = [x for x in slots[row].tolist() if x >= 0]
        assert got == sorted(want), row


# -- the Triton selection against select_slots (interpreter; GLM-5 widths on a GPU) -----------


def random_rows(bs: int, max_len: int, page_size: int, kind: str, gen: torch.Generator,
                device: str = "cpu"):  # noqa: ANN201
    """One decode token per request (plus a padding token) over shuffled pages: scores -inf
    at or past each request's length and at ~20% of the positions before it (masked). kind
    "normal": N(0, 1); "ties": small integers, -0.0 among the zeros; "bytes": float bit
    patterns whose lower three bytes are 0, 1, 2, 254 or 255 (every radix pass decides
    between neighbouring and extreme byte values). Returns (scores, token_req, seq_lens,
    page_table, query_start_loc); seq_lens[0] = 37 (fewer visible than most k)."""
    seq = torch.randint(1, max_len, (bs,), generator=gen)
    seq[0] = min(37, max_len - 1)
    pages = max_len // page_size + 2
    table = torch.stack([torch.randperm(pages * bs, generator=gen)[:pages] for _ in range(bs)])
    t, width = bs + 1, pages * page_size
    if kind == "ties":
        scores = torch.randint(-3, 4, (t, width), generator=gen).float()
        scores[scores == 0] = -0.0
        scores[:, ::3] = 0.0
    elif kind == "bytes":
        # top bytes 0xFE / 0xFF: finite floats near -3e38, the first pass's lowest bins
        top = torch.tensor([0x3F, 0x40, 0xBF, 0xC0, 0xFE, 0xFF])
        top = top[torch.randint(0, 6, (t, width), generator=gen)]
        second = torch.tensor([0, 1, 2, 0x7E, 0x7F])[torch.randint(0, 5, (t, width), generator=gen)]
        low = torch.tensor([0, 1, 2, 254, 255])[torch.randint(0, 5, (2, t, width), generator=gen)]
        bits = (top << 24) | (second << 16) | (low[0] << 8) | low[1]
        scores = bits.to(torch.int32).view(torch.float32)
    else:
        scores = torch.randn(t, width, generator=gen)
    qsl = torch.arange(bs + 1, dtype=torch.int32)
    token_req = di.token_requests(qsl, t)
    lens = torch.cat([seq, torch.zeros(1, dtype=seq.dtype)])[token_req]
    scores[torch.arange(width)[None, :] >= lens[:, None]] = float("-inf")
    scores[torch.rand(t, width, generator=gen) < 0.2] = float("-inf")
    return tuple(x.to(device) for x in (scores, token_req, seq.int(), table.int(), qsl))


def check_select(bs: int, max_len: int, page_size: int, k: int, kind: str, device: str = "cpu",
                 seed: int = 0, split: int | None = None, block: int = 256) -> None:  # fmt: skip
    """The kernel (split: the split form over that many programs a token, chunks in steps of
    `block` positions) against select_slots, with the scores past each length poisoned."""
    gen = torch.Generator().manual_seed(seed)
    scores, token_req, seq, table, qsl = random_rows(bs, max_len, page_size, kind, gen, device)
    want = di.select_slots(scores, k, qsl, table, page_size)
    # past each row's length the kernel reads nothing: poison it
    poisoned = scores.clone()
    lens = torch.cat([seq.long(), torch.zeros(1, dtype=torch.long, device=seq.device)])
    past = torch.arange(scores.shape[1], device=scores.device)[None, :] >= lens[token_req][:, None]
    poisoned[past] = float("nan")
    if split:
        got = ds.select_slots_split(poisoned, k, token_req, seq, table, page_size, split, block)
    else:
        got = ds.select_slots_fast(poisoned, k, token_req, seq, table, page_size)
    if compiling():
        return
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()


def check_backend_select(case: int, k: int, one_program_max_width: int | None = None) -> None:
    """TritonDSA.select (scores kernel + selection kernel) == TorchDSA.select on a decode, an
    extend after a cached prefix and a tree-masked verify (float32: the same scores); with
    one_program_max_width below the table's width, the split form (kernels/dsa_select.py)."""
    from specserve.layers.backends.torch_ref import TorchDSA
    from specserve.layers.backends.triton_backend import TritonDSA

    if one_program_max_width is not None:
        ds.ONE_PROGRAM_MAX_WIDTH = one_program_max_width  # this interpreter process only

    seq_lens, q_lens, page_size, tree = CASES[case]
    gen = torch.Generator().manual_seed(30 + case)
    md, _, num_pages = make_batch(seq_lens, q_lens, page_size, tree, gen)
    t = sum(q_lens) + 1  # one padding token
    cache = torch.randint(-2, 3, (num_pages, page_size, 16), generator=gen).float()
    q = torch.randint(-2, 3, (t, 2, 16), generator=gen).float()  # integer scores: ties
    w = torch.randint(1, 3, (t, 2), generator=gen).float()
    got = TritonDSA().select(q, w, cache, md, k)
    ds.ONE_PROGRAM_MAX_WIDTH = ONE_PROGRAM_MAX_WIDTH
    if compiling():
        return
    want = TorchDSA().select(q, w, cache, md, k)
    assert torch.equal(got, want) and (got[-1] == -1).all()  # padding selects nothing
    assert (got[:-1] >= 0).any(dim=1).all()  # every real token selected something


INTERPRETER_CHECKS = {
    "select_random_k8": lambda: check_select(3, 3000, 16, 8, "normal"),
    "select_random_k100_page4": lambda: check_select(3, 3000, 4, 100, "normal", seed=1),
    "select_ties_k1000": lambda: check_select(3, 3000, 16, 1000, "ties", seed=2),
    "select_ties_k1": lambda: check_select(2, 500, 8, 1, "ties", seed=3),
    "select_bytes_k300": lambda: check_select(3, 3000, 16, 300, "bytes", seed=5),
    "select_bytes_k7": lambda: check_select(3, 2000, 16, 7, "bytes", seed=6),
    "select_bytes_k2048": lambda: check_select(3, 4000, 16, 2048, "bytes", seed=7),
    "select_all_visible": lambda: check_select(2, 40, 4, 45, "normal", seed=4),
    # the split form: up to 12 programs a token over 256-position steps (rows of 37 to ~3000
    # positions: one to all programs busy, empty ones past each length)
    "split_random_k100": lambda: check_select(3, 3000, 16, 100, "normal", seed=11, split=5),
    "split_ties_k1000": lambda: check_select(3, 3000, 16, 1000, "ties", seed=12, split=12),
    "split_ties_k1": lambda: check_select(2, 900, 8, 1, "ties", seed=13, split=3),
    "split_bytes_k300": lambda: check_select(3, 3000, 16, 300, "bytes", seed=15, split=7),
    "split_bytes_k2048": lambda: check_select(3, 4000, 16, 2048, "bytes", seed=17, split=4),
    "split_all_visible": lambda: check_select(2, 40, 4, 45, "normal", seed=14, split=2),
    **{f"backend_case{i}_k{k}": (lambda i=i, k=k: check_backend_select(i, k))
       for i in range(len(CASES)) for k in (3, 8)},
    **{f"backend_case{i}_long_limit": (lambda i=i: check_backend_select(i, 8, 0))
       for i in range(len(CASES))},
}  # fmt: skip

test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


@gpu_test
@pytest.mark.parametrize("max_len,kind", [(8192, "normal"), (65536, "ties"),
                                          (202752, "normal"), (32768, "bytes")])  # fmt: skip
def test_select_gpu(max_len: int, kind: str) -> None:
    """GLM-5's k (2048) over rows of thousands to 200k positions, 16 decode tokens: the
    one-program kernel and the split form (as many programs as it takes at that width)."""
    check_select(16, max_len, 64, 2048, kind, "cuda", seed=max_len)
    width = (max_len // 64 + 2) * 64
    check_select(16, max_len, 64, 2048, kind, "cuda", seed=max_len,
                 split=ds.split_programs(width), block=ds.BLOCK)


# compile-only (tests/triton_compile.py): GLM-5's k and page size
GPU_DIM_CHECKS = {
    "select_k2048_page64": lambda: check_select(4, 5000, 64, 2048, "normal"),
    "split_k2048_page64": lambda: check_select(4, 5000, 64, 2048, "normal", split=50,
                                               block=ds.BLOCK),
}


if __name__ == "__main__":
    report(INTERPRETER_CHECKS, GPU_DIM_CHECKS)
