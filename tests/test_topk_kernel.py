"""The draft top-k kernels (kernels/topk.py) against log_softmax + torch.topk, under the
Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported):
`TRITON_INTERPRET=1 python tests/test_topk_kernel.py` prints "ok". Marked gpu: on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# (rows, columns, k): one partial chunk, several chunks with a partial last one, a draft
# vocabulary, the largest k
SHAPES = [(3, 37, 4), (4, 3000, 4), (4, 32000, 4), (2, 2100, 1), (5, 1500, 16)]


def check(device: str, dtype: torch.dtype) -> None:
    from specserve.kernels.topk import top_log_probs

    for rows, cols, k in SHAPES:
        # distinct values, so the top-k set and its order are unique
        perm = torch.randperm(rows * cols, generator=torch.Generator().manual_seed(cols))
        logits = (perm.float() * (20.0 / (rows * cols))).view(rows, cols).to(device, dtype)
        want_logp, want_ids = logits.float().log_softmax(-1).topk(k, dim=-1)
        logp, ids = top_log_probs(logits, k)
        assert ids.dtype == torch.int64 and logp.dtype == torch.float32
        assert torch.equal(ids, want_ids), (rows, cols, k)
        torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    # an all -inf chunk (a masked stretch of the vocabulary) does not poison the lse
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0)).to(device)
    logits[:, 1024:2048] = float("-inf")
    want_logp, want_ids = logits.log_softmax(-1).topk(3, dim=-1)
    logp, ids = top_log_probs(logits, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)


def test_kernel_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


@pytest.mark.gpu
def test_kernel_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check("cuda", torch.float32)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_kernel_interpreter"
    check("cpu", torch.float32)
    print("ok")
