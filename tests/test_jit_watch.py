"""bench/jit_watch.py: Triton compilations counted per kernel, through Triton's post-compile
hook (compile-only launches for sm_90 on the CPU, in a subprocess: the compile-only driver is
process-wide)."""

from __future__ import annotations

import importlib.util
import json
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
import triton
import triton.language as tl
from triton_compile import _install

compiled = _install("90")

@triton.jit
def _scale(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

from specserve.bench.jit_watch import triton_compiles
x = torch.empty(64)
seen = []
with triton_compiles() as counts:
    _scale[(1,)](x, 64, BLOCK=64)
    seen.append(dict(counts))
    _scale[(1,)](x, 64, BLOCK=64)  # the same specialization: cached
    seen.append(dict(counts))
    _scale[(1,)](x, 64, BLOCK=32)  # a new constexpr: compiles
    seen.append(dict(counts))
_scale[(1,)](x, 64, BLOCK=16)  # outside the block: not counted
seen.append(dict(counts))
with triton_compiles() as more:
    _scale[(1,)](x, 63, BLOCK=64)  # n no longer divisible by 16: compiles
    _scale[(1,)](x, 1, BLOCK=64)  # n == 1: a constant, compiles
    _scale[(1,)](x[1:], 64, BLOCK=64)  # a pointer off 16-byte alignment: compiles
seen.append(counts.details + more.details)
print(json.dumps(seen))
'''


def test_compilations_are_counted_per_kernel_inside_the_block_only(tmp_path) -> None:
    tests = Path(__file__).resolve().parent
    script = tmp_path / "watch.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tests)], capture_output=True,
                         text=True, timeout=300, cwd=tests.parent,
                         env={**__import__("os").environ,
                              "SPECSERVE_TRITON_COMPILE_ONLY": "90",
                              "PYTHONPATH": str(tests.parent)})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen[:4] == [{"_scale": 1}, {"_scale": 1}, {"_scale": 2}, {"_scale": 2}], seen
    # which specialization each compile was: the constexpr, the integer's class (D: divisible
    # by 16, absent: plain, 1: a constant), a pointer's only when unaligned
    assert seen[4] == ["_scale(n=D, BLOCK=64)", "_scale(n=D, BLOCK=32)", "_scale(BLOCK=64)",
                       "_scale(n=1, BLOCK=64)", "_scale(x_ptr=unaligned, n=D, BLOCK=64)"], seen[4]


def test_the_previous_hook_is_put_back() -> None:
    from triton import knobs

    from specserve.bench.jit_watch import triton_compiles

    before = knobs.runtime.jit_post_compile_hook
    with triton_compiles() as counts:
        assert knobs.runtime.jit_post_compile_hook is not before  # ours is installed
    assert knobs.runtime.jit_post_compile_hook is before and counts == {}
