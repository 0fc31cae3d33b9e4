"""The n-gram lookup kernel (kernels/ngram_lookup.py) through TokenHistory.lookup, against the
naive Python rule and the torch matcher over the gathered history: paged histories with
shuffled pages, rows spanning several kernel chunks, planted repeats, short rows, skipped rows
and the root token outside the history. Under the interpreter on the CPU (one subprocess:
`python tests/test_ngram_kernel.py` prints a JSON line), on CUDA with the gpu marker.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from interpreted import interpreter_test, report  # noqa: E402
from test_drafter_matchers import naive_ngram  # noqa: E402

from specserve.speculative.ngram import TokenHistory, ngram_match  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def check_lookup(device: str, page_size: int, width: int, lo: int, hi: int, vocab: int,
                 seed: int) -> None:
    rng = random.Random(seed)
    bs, k = 12, 4
    limit = width * page_size
    rows = []
    for r in range(bs):  # rows 1, 2: too short to match; then short and long rows in turn
        n = r if r in (1, 2) else (rng.randint(3, 40) if r % 2 else rng.randint(limit // 2, limit))
        row = [rng.randrange(vocab) for _ in range(n)]
        if r % 2 and n > 4:  # an earlier span copied to the end
            a = rng.randrange(n - 1)
            row = (row + row[a : a + rng.randint(hi, hi + 6)])[:limit]
        rows.append(row)
    rows[0] = list(range(limit))[: limit - 3]  # distinct tokens: no match
    num_pages = bs * width + 1
    runner = SimpleNamespace(page_size=page_size, num_pages=num_pages, device=torch.device(device))
    history = TokenHistory(runner)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    tables = [pages[r * width : (r + 1) * width] for r in range(bs)]
    # position i holds t_{i+1}: the history covers all but the root (the last token)
    history.write_host([0] * bs, tables, [row[:-1] for row in rows])
    page_table = torch.tensor(tables, dtype=torch.int32, device=device)
    root_pos = torch.tensor([len(row) for row in rows], device=device)
    root_tokens = torch.tensor([row[-1] for row in rows], device=device)
    valid = torch.ones(bs, dtype=torch.bool, device=device)
    valid[3] = False  # a padding row: no draft
    length = torch.where(valid, root_pos, 0)
    got = history.lookup(page_table, root_pos, root_tokens, length, k, lo, hi).cpu()
    seq = history.read(page_table, root_pos, root_tokens)
    torch_drafts, _ = ngram_match(seq.cpu(), length.cpu(), k, lo, hi)
    assert torch.equal(got, torch_drafts), (got, torch_drafts)
    matched = 0
    for r, row in enumerate(rows):
        want = naive_ngram(row, k, lo, hi) if valid[r] else []
        matched += bool(want)
        assert got[r, : len(want)].tolist() == want, (r, len(row))
        assert (got[r, len(want) :] == -1).all(), r
    assert matched >= bs // 3, "too few rows matched to test the rule"


CHECKS = {
    "page16_two_chunks": lambda: check_lookup("cpu", 16, 80, 1, 3, 4, 0),
    "page64_three_chunks_lo2": lambda: check_lookup("cpu", 64, 40, 2, 5, 3, 1),
    "page1_bigram_only": lambda: check_lookup("cpu", 1, 300, 2, 2, 6, 2),
}
test_interpreter = interpreter_test(__file__, CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("page_size,width", [(16, 512), (64, 128), (64, 2048)])
def test_lookup_cuda(page_size: int, width: int) -> None:
    for seed in range(3):
        check_lookup("cuda", page_size, width, 1, 4, 5, seed)


if __name__ == "__main__":
    report(CHECKS)
