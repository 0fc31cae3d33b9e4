"""Rotary position embedding applied in place to q and k in one launch (neox half-split layout).

    x = [x1 | x2] (halves of head_dim);  out = [x1 cos - x2 sin | x2 cos + x1 sin]
with cos/sin read from a [max_positions, head_dim] fp32 table (cos in the first half, sin in
the second) at each token's position. One program per token handles every q and k head.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, tl
from specserve.kernels.fused_ops import _next_power_of_2


@jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d_ok, other=0.0)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    for which in tl.static_range(2):
        if which == 0:
            base, stride_t, stride_h, heads = q_ptr, stride_qt, stride_qh, num_q_heads
        else:
            base, stride_t, stride_h, heads = k_ptr, stride_kt, stride_kh, num_k_heads
        ok = (h < heads) & d_ok[None, :]
        p1 = base + t * stride_t + h * stride_h + d[None, :]
        x1 = tl.load(p1, mask=ok, other=0.0)
        x2 = tl.load(p1 + half, mask=ok, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p1, (x1f * cos - x2f * sin).to(x1.dtype), mask=ok)
        tl.store(p1 + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=ok)


def rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cos_sin: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hk, D] (last dim contiguous) rotated in place; cos_sin [P, D] fp32."""
    t, hq, d = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if t == 0:
        return
    half = d // 2
    positions = positions.contiguous()  # an expanded [1, k] reshape is a stride-0 view
    _rotary_kernel[(t,)](
        q, k, cos_sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        hq, k.shape[1], half,
        BLOCK_H=_next_power_of_2(max(hq, k.shape[1])), BLOCK_D=_next_power_of_2(half),
    )  # fmt: skip


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference in fp32 math, rounded to the input dtype."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)
