"""The quantized GEMM kernels on a GPU: bf16 at Llama-3.1-8B shapes against the dequantized
fp32 references of tests/test_quant_kernels.py (its checks, its interpreter and compile-only
runs), and a split-K launch replayed in a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_quant_kernels import (  # noqa: E402
    BF16,
    FP8,
    HAS_CUDA,
    TOL16,
    check_fp8_linear,
    check_fp8_mm,
    check_quant,
    check_w4,
    ref_w4,
)

# -- CUDA: bf16 at Llama-3.1-8B shapes (hidden 4096, qkv 6144, gate_up 28672, inter 14336) --------

gpu = pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton"))
SHAPES = [(6144, 4096), (4096, 14336), (1000, 1000)]  # (N, K); the last one ragged


@gpu
@pytest.mark.parametrize("m", [1, 16, 200])
def test_cuda_quant(m: int) -> None:
    check_quant(m, 4096, 128, BF16, "cuda")
    check_quant(m, 1000, 1000, BF16, "cuda")


@gpu
@pytest.mark.parametrize("m", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_cuda_fp8_mm(m: int, n: int, k: int, strategy: str) -> None:
    check_fp8_mm(m, n, k, strategy, None, BF16, "cuda", TOL16)


@gpu
@pytest.mark.parametrize("m", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_cuda_fp8_linear(m: int, n: int, k: int, static: bool) -> None:
    check_fp8_linear(m, n, k, static, None, BF16, "cuda", TOL16)


@gpu
@pytest.mark.parametrize("m", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("n, k", [(1000, 1000), (4096, 4096)])
@pytest.mark.parametrize("group, fp4", [(32, False), (128, False), (16, True)])
def test_cuda_w4(m: int, n: int, k: int, group: int, fp4: bool) -> None:
    if fp4 and k % 16:
        k = k // 16 * 16
    check_w4(m, n, k, group, fp4, None, BF16, "cuda", TOL16)


@gpu
@pytest.mark.parametrize("m, plan", [(1, (1, 32, 128, 4, 2, 3)), (1, (1, 64, 256, 8, 4, 3)),
                                     (1, (1, 64, 128, 4, 4, 1)), (3, (4, 64, 128, 4, 4, 3)),
                                     (8, (8, 32, 128, 2, 4, 1))])
@pytest.mark.parametrize("n, k", [(1000, 1008), (6144, 4096)])
@pytest.mark.parametrize("group, fp4", [(32, False), (128, False), (16, True)])
def test_cuda_w4_gemv_plans(m: int, plan: tuple, n: int, k: int, group: int,
                            fp4: bool) -> None:
    """The GEMV kernel at one and a few rows (the plans bench_quant_gemm's sweep may
    store), masked and unmasked (EVEN) tiles, weight tiles pipelined (3 stages) or not (1)."""
    check_w4(m, n, k, group, fp4, plan, BF16, "cuda", TOL16)


@gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("group, fp4", [(32, False), (128, False), (16, True)])
def test_cuda_w4_decodes_every_code_exactly(m: int, group: int, fp4: bool) -> None:
    """One-hot activation rows read single weights, so each output is one decoded code times
    its scale: bitwise the reference weight rounded to bf16 once, for every code of 512 rows at
    m column positions (GEMV at one row, tensor-core tiles at 16 and 64; NVFP4's 0.5 is a bf16
    subnormal until the kernel unbiases it, a flush would zero it)."""
    from specserve.kernels import w4a16_gemm

    n, k = 512, 1024
    gen = torch.Generator().manual_seed(m + group)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    # e4m3 scales from its smallest normal up (a subnormal scale rounds these to 0)
    scales = (scales * torch.logspace(-2, 8, k // group, base=2.0)).to(FP8) if fp4 else scales.to(BF16)
    row = torch.ones(n) if fp4 else None
    cols = torch.randperm(k, generator=gen)[:m]
    x = torch.zeros(m, k, dtype=BF16)
    x[torch.arange(m), cols] = 1.0
    got = w4a16_gemm.w4a16_mm(x.cuda(), packed.cuda(), scales.cuda(), group, fp4,
                              row.cuda() if fp4 else None)  # fmt: skip
    want = ref_w4(packed, scales, group, k, fp4, row)[:, cols].t().to(BF16)
    assert (want == 0).float().mean() < 0.2 and torch.equal(got.cpu(), want), (
        (got.cpu() != want).sum().item())


@gpu
def test_cuda_graph_capture_of_quantized_layers() -> None:
    """A split-K launch (decode size) replays in a CUDA graph and matches the eager result."""
    from quant_formats import quant_config

    from specserve.layers.linear import RowParallelLinear
    from specserve.layers.quantization import get_quant_config
    from specserve.models.presets import random_init

    torch.set_default_dtype(BF16)
    try:
        for fmt in ("fp8-block", "ct-int4-g32", "ct-nvfp4"):
            with torch.device("cuda"):
                layer = RowParallelLinear(
                    14336,
                    4096,
                    quant_config=get_quant_config(quant_config(fmt)),
                    prefix="m.down_proj",
                )
            random_init(layer)
            x = torch.randn(1, 14336, device="cuda", dtype=BF16)
            eager = layer(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.testing.assert_close(out, layer(x))
            assert not torch.equal(out, eager)
    finally:
        torch.set_default_dtype(torch.float32)
