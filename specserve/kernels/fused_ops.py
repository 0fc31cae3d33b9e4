"""Small fused elementwise kernels (residual-add + RMSNorm, SiLU-and-mul) with torch references.

Rounding follows the transformers Llama modules: the residual sum is rounded to the activation
dtype, the norm is computed in fp32 and rounded before the weight multiply, and SiLU output is
rounded before the up-projection multiply.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl, triton  # noqa: F401


@jit
def rms_norm_row(h, w, hidden, eps):
    # h [BLOCK] one row in the activation dtype (zeros past `hidden`), w [BLOCK] fp32 weights
    # -> fp32 w * round(h / sqrt(mean(h^2) + eps))
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / hidden + eps)
    return (hf * rstd).to(h.dtype).to(tl.float32) * w


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one program per row: h = x (+ residual); out = w * round(h / sqrt(mean(h^2) + eps))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)).to(
            x.dtype
        )
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = rms_norm_row(x, w.to(tl.float32), hidden, eps)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape), None
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., hidden]."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); inputs are left untouched."""
    out, res = _launch_rms_norm(x, residual, weight, eps)
    assert res is not None
    return out, res


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


@jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr
):  # fmt: skip
    # x row = [gate | up], each `inter` wide; out = round(silu(gate)) * up
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * inter] -> silu(x[..., :inter]) * x[..., inter:]  [..., inter]."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    assert x2.stride(-1) == 1
    out = x2.new_empty(x2.shape[0], inter)
    block = min(1024, next_power_of_2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
