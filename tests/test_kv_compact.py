"""The KV-compaction kernel (kernels/kv_compact.py) against its torch reference and a naive
per-pair loop: accepted-path patterns whose sources are other pairs' destinations, several
requests, padding rows (src == dst, sharing one spare page), W not a power of two, k and v of
different head dims, a single MLA latent cache ([pages, page_size, 576]-style rows), layers
past `layers` untouched. The kernel runs on CUDA (marker `gpu`) and
under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported): `TRITON_INTERPRET=1 python tests/test_kv_compact.py` prints "ok".
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from specserve.kernels.kv_compact import compact_kv, compact_kv_ref  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_paths(bs: int, w: int, page_size: int, num_pages: int, num_padding: int,
               gen: torch.Generator, reverse_row: bool = False) -> tuple[torch.Tensor, ...]:
    """src, dst [bs, w] int64 slots as SpecCycle.compact_kv builds them: request b's path at
    positions P_b + j on its own shuffled pages, src = P + accepted node (increasing, node 0
    first, -1 padded -> src = dst); the last `num_padding` rows are graph padding on one shared
    spare page (page num_pages - 1). reverse_row: row 0 reverses its path instead (sources
    below destinations: only gather-all-then-scatter-all gets it right)."""
    n = 2 * w + 3  # tree nodes per request
    per_req = (n + 2 * page_size) // page_size + 1
    order = torch.randperm(num_pages - 1, generator=gen)
    assert bs * per_req <= num_pages - 1
    page_table = torch.stack([order[b * per_req:(b + 1) * per_req] for b in range(bs)])
    page_table[bs - num_padding:] = num_pages - 1
    root = torch.randint(0, page_size * 2, (bs,), generator=gen)
    src_pos = root[:, None] + torch.arange(w).expand(bs, w).clone()
    for b in range(bs - num_padding):
        k = int(torch.randint(1, w + 1, (1,), generator=gen))
        nodes = torch.cat([torch.zeros(1, dtype=torch.long),
                           torch.randperm(n - 1, generator=gen)[:k - 1].sort().values + 1])
        src_pos[b, :k] = root[b] + nodes
    if w == 3 and bs > num_padding:
        src_pos[0] = root[0] + torch.tensor([0, 2, 5])  # the docstring's example
    if reverse_row:
        src_pos[0] = root[0] + torch.arange(w - 1, -1, -1)
    dst_pos = root[:, None] + torch.arange(w)

    def slots(pos: torch.Tensor) -> torch.Tensor:
        return page_table.gather(1, pos // page_size) * page_size + pos % page_size

    return slots(src_pos), slots(dst_pos)


def naive(cache: torch.Tensor, layers: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    old = cache.clone()
    for layer in range(layers):
        flat, old_flat = cache[layer].flatten(0, 1), old[layer].flatten(0, 1)
        for s, d in zip(src.flatten().tolist(), dst.flatten().tolist()):
            flat[d] = old_flat[s]


CASES = [  # bs, w, layers, total layers, pages, page_size, kv heads, head_dim k, v, padding
    (1, 3, 2, 3, 8, 4, 2, 8, 8, 0),
    (4, 5, 3, 4, 32, 4, 2, 16, 8, 1),
    (6, 7, 2, 2, 64, 8, 1, 32, 32, 2),
    (3, 4, 2, 3, 40, 2, 2, 160, 96, 1),  # 320 k features: two feature tiles
    (2, 1, 1, 2, 16, 4, 1, 8, 8, 0),
    # MLA: kv heads None = one latent cache [L, pages, page_size, head_dim k] (no v)
    (3, 5, 2, 3, 40, 4, None, 24, None, 1),
    (2, 4, 3, 3, 32, 8, None, 288, None, 0),  # two feature tiles
]


def make_caches(total: int, pages: int, ps: int, hk: int | None, dk: int, dv: int | None,
                gen: torch.Generator) -> list[torch.Tensor]:
    if hk is None:  # an MLA latent group: one tensor, rows of dk values
        return [torch.randn(total, pages, ps, dk, generator=gen)]
    return [torch.randn(total, pages, ps, hk, d, generator=gen) for d in (dk, dv)]


def check(device: str, dtypes: list[torch.dtype], scale: int = 1) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for i, (bs, w, layers, total, pages, ps, hk, dk, dv, pad) in enumerate(CASES):
            for reverse_row in (False, True):
                pages_s = pages * scale
                src, dst = make_paths(bs, w, ps, pages_s, pad, gen, reverse_row)
                caches = [c.to(dtype) for c in make_caches(total, pages_s, ps, hk, dk, dv, gen)]
                want_ref = [c.clone() for c in caches]
                compact_kv_ref(want_ref, layers, src, dst)
                want = [c.clone() for c in caches]
                for c in want:
                    naive(c, layers, src, dst)
                got = [c.to(device, copy=True) for c in caches]
                compact_kv(got, layers, src.to(device), dst.to(device))
                label = (dtype, i, reverse_row)
                for g, r, nv, c in zip(got, want_ref, want, caches):
                    assert torch.equal(r, nv), ("reference vs naive", *label)
                    assert torch.equal(g.cpu(), nv), ("kernel vs naive", *label)
                    assert torch.equal(g[layers:].cpu(), c[layers:]), ("later layers", *label)
                    assert not torch.equal(g.cpu(), c) or bool((src == dst).all()), label


def test_reference_cpu() -> None:
    """Without the interpreter a CPU cache takes the reference path."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter would run the kernel")
    check("cpu", [torch.float32, torch.bfloat16])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA, triton")
def test_kernel_gpu() -> None:
    check("cuda", [torch.float32, torch.bfloat16], scale=50)
    # realistic: 32 layers of 8 x 128, bs 8, W 6, feature-tiled, against the reference
    gen = torch.Generator().manual_seed(1)
    src, dst = make_paths(8, 6, 16, 2048, 2, gen)
    for dtype in (torch.bfloat16, torch.float32):
        caches = [torch.randn(33, 2048, 16, 8, 128, generator=gen).to(dtype).cuda()
                  for _ in range(2)]
        want = [c.clone() for c in caches]
        compact_kv_ref(want, 32, src.cuda(), dst.cuda())
        compact_kv(caches, 32, src.cuda(), dst.cuda())
        assert all(torch.equal(g, r) for g, r in zip(caches, want))
        # an MLA target: latent rows of 576 values, one tensor (8 of 9 layers compacted)
        latent = [torch.randn(9, 2048, 16, 576, device="cuda").to(dtype)]
        want = [latent[0].clone()]
        compact_kv_ref(want, 8, src.cuda(), dst.cuda())
        compact_kv(latent, 8, src.cuda(), dst.cuda())
        assert torch.equal(latent[0], want[0])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_kernel_interpreter"
    check("cpu", [torch.float32, torch.bfloat16])
    print("ok")
