"""The in-place rotary kernel, and its fusion with the KV-cache write, against the torch
references (GPU; Triton interpreter on CPU); full and partial rotary (the first r of d dims
rotate, GLM-4.5's r = d / 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

CHECK = textwrap.dedent("""
    import torch
    from specserve.kernels.kv_store import store_kv_ref
    from specserve.kernels.rotary import rotary_inplace, rotary_ref, rotary_store_kv
    from specserve.layers.rotary import RotaryEmbedding

    dev = DEVICE
    for dtype, tol in TOLS:
        for t, hq, hk, d, r in [(1, 4, 1, 64, 64), (7, 8, 2, 128, 128), (33, 5, 5, 32, 32),
                                (7, 8, 2, 128, 64), (5, 3, 1, 40, 16)]:
            rope = RotaryEmbedding(d, 4096, 10000.0, rotary_dim=r).to(dev)
            assert rope.cos_sin_cache.shape[1] == r
            qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev).to(dtype)
            q = qkv[:, : hq * d].view(t, hq, d)  # strided views, as the model makes them
            k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            pos = torch.randint(0, 4000, (t,), device=dev)
            if t > 1:  # a stride-0 view, as expand(1, k).reshape(-1) produces
                pos = pos[:1].expand(t)
            want_q, want_k = rotary_ref(pos, q.clone(), k.clone(), rope.cos_sin_cache)
            untouched = qkv[:, (hq + hk) * d :].clone()
            rotary_inplace(pos, q, k, rope.cos_sin_cache)
            for got, want in ((q, want_q), (k, want_k)):
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < tol, (dtype, t, hq, hk, d, r, err)
                assert torch.equal(got[..., r:], want[..., r:])  # pass-through: bitwise
            assert torch.equal(qkv[:, (hq + hk) * d :], untouched)  # v is not touched

            # fused: rotate, then write k and v at their slots (-1: skip), in one launch
            for page_size in (4, 16):
                qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev).to(dtype)
                q = qkv[:, : hq * d].view(t, hq, d)
                k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
                v = qkv[:, (hq + hk) * d :].view(t, hk, d)
                pages = t // page_size + 3
                slots = torch.randperm(pages * page_size, device=dev)[:t]
                slots[::3] = -1
                caches = [torch.randn(pages, page_size, hk, d, device=dev).to(dtype)
                          for _ in range(2)]
                want_q, want_k = rotary_ref(pos, q.clone(), k.clone(), rope.cos_sin_cache)
                want_caches = [c.clone() for c in caches]
                store_kv_ref(want_k, v.clone(), *want_caches, slots)
                v_before = v.clone()
                rotary_store_kv(pos, q, k, v, rope.cos_sin_cache, *caches, slots)
                for got, want in ((q, want_q), (k, want_k), *zip(caches, want_caches)):
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert err < tol, ("fused", dtype, t, hq, hk, d, r, page_size, err)
                assert torch.equal(v, v_before)
                untouched = torch.ones(pages * page_size, dtype=torch.bool, device=dev)
                untouched[slots[slots >= 0]] = False
                for got, want in zip(caches, want_caches):  # slots not written stay bitwise
                    assert torch.equal(got.flatten(0, 1)[untouched], want.flatten(0, 1)[untouched])
    print("ok")
""")


@pytest.mark.gpu
def test_rotary_kernel_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code = CHECK.replace("DEVICE", "'cuda'").replace(
        "TOLS", "[(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]")
    exec(compile(code, "rotary_check", "exec"), {})


def test_rotary_kernel_interpreter() -> None:
    pytest.importorskip("triton")
    code = CHECK.replace("DEVICE", "'cpu'").replace("TOLS", "[(torch.float32, 1e-6)]")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
