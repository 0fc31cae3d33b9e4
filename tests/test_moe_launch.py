"""The fused MoE's launch configs (kernels/fused_moe.py moe_launch_config): tile sizes against
the problem's shapes, and the 4-bit experts' GEMV form behind SPECSERVE_MOE_GEMV."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import fused_moe as fm


def test_moe_gemv_switch_picks_one_pair_blocks_at_decode(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:  # fmt: skip
    """SPECSERVE_MOE_GEMV=1: 4-bit experts whose groups hold whole words take the GEMV form
    (BLOCK_M 1) while rows per expert stay <= 1; batches, 8-bit/dense experts and groups that
    split a packed word keep the MMA tiles; off (the default) changes nothing."""
    def experts(fmt: int, group_k: int) -> fm.ExpertWeights:
        return fm.ExpertWeights(fmt, torch.empty(384, 64, 896, dtype=torch.int32), None, 7168,
                                1, group_k, 2)

    int4 = experts(fm.INT4, 32)
    assert fm.moe_launch_config(1, 2048, 7168, 384, 8, torch.bfloat16, int4).block_m == 16
    monkeypatch.setattr(fm, "MOE_GEMV", True)
    cfg = fm.moe_launch_config(1, 2048, 7168, 384, 8, torch.bfloat16, int4)
    assert (cfg.block_m, cfg.block_k) == (1, 128)
    assert fm.moe_launch_config(48, 2048, 7168, 384, 8, torch.bfloat16, int4).block_m == 1
    assert fm.moe_launch_config(49, 2048, 7168, 384, 8, torch.bfloat16, int4).block_m == 16
    assert fm.moe_launch_config(1, 2048, 7168, 384, 8, torch.bfloat16,
                                experts(fm.INT4, 12)).block_m == 16
    assert fm.moe_launch_config(1, 2048, 7168, 384, 8, torch.bfloat16).block_m == 16


def test_launch_config_fits_shapes() -> None:
    for m in (1, 8, 64, 512, 4096):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = fm.moe_launch_config(m, 2048, 7168, 384, 8, dtype)
            assert cfg.block_m in (16, 32, 64, 128) and cfg.block_n <= 128
    small = fm.moe_launch_config(4, 24, 40, 8, 2, torch.float32)
    assert small.block_n == 32 and small.block_k == 64  # clamped to the problem
    assert fm.moe_launch_config(1, 2048, 7168, 384, 8, torch.bfloat16).block_m == 16
    assert fm.moe_launch_config(4096, 2048, 7168, 384, 8, torch.bfloat16).block_m == 64
