"""The attention kernels read their KV split count from the launch grid at run time: launches
that differ only in the split count (past one: a single split stores its output directly, its
own variant) share one compiled kernel (paged MHA fused and unfused, MLA, sparse MLA). The
combine launch, a small kernel, still compiles per count (one [splits, D] load). Before, every count compiled the kernel again, 1-2 s inside a
serving step. Compile-only launches for sm_90 on the CPU (tests/triton_compile.py), counted
through Triton's post-compile hook (bench/jit_watch.py), in a subprocess: the compile-only
driver is process-wide."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")

SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from triton_compile import _install

_install("90")
from specserve.bench.jit_watch import triton_compiles
from specserve.kernels.mla_attention import mla_attention
from specserve.kernels.paged_attention import paged_attention
from specserve.kernels.sparse_mla import sparse_mla_attention

bf = torch.bfloat16
bs, heads, kv_heads, dim, page, pages = 4, 32, 8, 128, 16, 64
q = torch.zeros(bs, heads, dim, dtype=bf)
k = torch.zeros(pages, page, kv_heads, dim, dtype=bf)
lens = torch.full((bs,), 300, dtype=torch.int32)
table = torch.arange(bs * 16, dtype=torch.int32).reshape(bs, 16) % pages
lat = torch.zeros(pages, page, 576, dtype=bf)
ql, qp = torch.zeros(bs, 16, 512, dtype=bf), torch.zeros(bs, 16, 64, dtype=bf)
slots = torch.zeros(bs, 64, dtype=torch.long)
seen = {}
with triton_compiles() as counts:
    for fused in (False, True):
        for splits in (1, 2, 4, 32):
            paged_attention(q, k, k, None, lens, table, 1, 0.1, num_splits=splits,
                            fused_combine=fused)
    seen["paged"] = dict(counts)
    for splits in (1, 2, 16):
        mla_attention(ql, qp, lat, None, lens, table, 1, 0.1, num_splits=splits)
        sparse_mla_attention(ql, qp, lat, slots, 0.1, num_splits=splits)
    seen["all"] = dict(counts)
print(json.dumps(seen))
'''


@pytest.mark.slow
def test_split_counts_share_one_compiled_kernel(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parent
    script = tmp_path / "splits.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tests)], capture_output=True,
                         text=True, timeout=600, cwd=tests.parent,
                         env={**os.environ, "SPECSERVE_TRITON_COMPILE_ONLY": "90",
                              "PYTHONPATH": str(tests.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # one split (fused or not), several splits unfused, several fused: three variants of the
    # attention kernel for 8 launches; the unfused launches' combine once per count
    assert seen["paged"] == {"_paged_attention_kernel": 3, "_combine_splits_kernel": 3}, seen
    # MLA and sparse MLA: one split and several (the combine for 2 and 16 at the latent rank)
    assert seen["all"] == {"_paged_attention_kernel": 3, "_combine_splits_kernel": 5,
                           "_mla_attention_kernel": 2, "_sparse_mla_kernel": 2}, seen
