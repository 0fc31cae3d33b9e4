"""Small fused elementwise kernels (residual-add + RMSNorm, SiLU-and-mul) with torch references.

Rounding follows the transformers Llama modules: the residual sum is rounded to the activation
dtype, the norm is computed in fp32 and rounded before the weight multiply, and SiLU output is
rounded before the up-projection multiply.

Either kernel may also write its output quantized for an FP8 linear that reads it (fp8_group:
e4m3 codes and one fp32 scale per row and group, exactly quant_fp8 of the rounded output), so
that linear needs no quantization launch of its own.
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl, triton  # noqa: F401
from specserve.kernels.fp8_gemm import AMAX_EPS, FP8, FP8_MAX, quant_rows_e4m3


@jit
def store_fp8_groups(y, q_ptr, s_ptr, col0, n_cols, fp8_max, eps, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    # y [BLOCK] fp32 (columns col0 .. col0 + BLOCK - 1 of a row, zeros past n_cols; col0 and
    # BLOCK multiples of GROUP) -> its e4m3 codes at q_ptr + column and one scale a group at
    # s_ptr + column // GROUP, as quant_fp8
    q, s = quant_rows_e4m3(tl.reshape(y, (BLOCK // GROUP, GROUP)), fp8_max, eps)
    cols = col0 + tl.arange(0, BLOCK)
    tl.store(q_ptr + cols, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    g = col0 // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + g, s, mask=g * GROUP < n_cols)


def fp8_buffers(rows: int, cols: int, group: int, device: torch.device):
    """(codes [rows, cols] e4m3, scales [rows, cols / group] fp32) for a fused kernel to fill."""
    return (torch.empty(rows, cols, dtype=FP8, device=device),
            torch.empty(rows, cols // group, dtype=torch.float32, device=device))


@jit
def rms_norm_row(h, w, hidden, eps):
    # h [BLOCK] one row in the activation dtype (zeros past `hidden`), w [BLOCK] fp32 weights
    # -> fp32 w * round(h / sqrt(mean(h^2) + eps))
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / hidden + eps)
    return (hf * rstd).to(h.dtype).to(tl.float32) * w


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_q, stride_s, hidden, eps, fp8_max, fp8_eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, FP8_GROUP: tl.constexpr = 0,
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
    y = rms_norm_row(x, w.to(tl.float32), hidden, eps).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if FP8_GROUP:  # the stored (rounded) row quantized
        store_fp8_groups(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row * stride_s, 0,
                         hidden, fp8_max, fp8_eps, FP8_GROUP, BLOCK)  # fmt: skip


def fp8_group_fits(cols: int, group: int | None, block: int) -> bool:
    """Whether a kernel over blocks of `block` columns can quantize its output in groups."""
    return bool(group) and cols % group == 0 and block % group == 0


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    fp8_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:  # fmt: skip
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    block = next_power_of_2(hidden)
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    fp8 = fp8_buffers(x2.shape[0], hidden, fp8_group, x.device) if fp8_group_fits(
        hidden, fp8_group, block) else None  # fmt: skip
    q, s = fp8 if fp8 is not None else (out, out)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, q, s,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), q.stride(0),
            s.stride(0), hidden, eps, FP8_MAX, AMAX_EPS, HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            FP8_GROUP=fp8_group if fp8 is not None else 0,
        )  # fmt: skip
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None), fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             fp8_group: int | None = None) -> torch.Tensor | tuple:  # fmt: skip
    """RMSNorm over the last dim of x [..., hidden]; with fp8_group, (y, its FP8 rows or None
    where the group does not tile the row)."""
    out, _, fp8 = _launch_rms_norm(x, None, weight, eps, fp8_group)
    return (out, fp8) if fp8_group else out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    fp8_group: int | None = None,
) -> tuple:  # fmt: skip
    """Returns (rms_norm(x + residual), x + residual); inputs are left untouched. With
    fp8_group, a third item: rms_norm's FP8 rows (or None)."""
    out, res, fp8 = _launch_rms_norm(x, residual, weight, eps, fp8_group)
    assert res is not None
    return (out, res, fp8) if fp8_group else (out, res)


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
    x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_o, stride_q, stride_s, inter, fp8_max,
    fp8_eps, BLOCK: tl.constexpr, FP8_GROUP: tl.constexpr = 0,
):  # fmt: skip
    # x row = [gate | up], each `inter` wide; out = round(silu(gate)) * up
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if FP8_GROUP:  # the stored (rounded) block quantized
        store_fp8_groups(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row * stride_s,
                         tl.program_id(1) * BLOCK, inter, fp8_max, fp8_eps, FP8_GROUP, BLOCK)


def silu_and_mul(x: torch.Tensor, fp8_group: int | None = None) -> torch.Tensor | tuple:
    """x [..., 2 * inter] -> silu(x[..., :inter]) * x[..., inter:]  [..., inter]; with
    fp8_group, (that, its FP8 rows or None where the group does not tile the blocks)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    assert x2.stride(-1) == 1
    out = x2.new_empty(x2.shape[0], inter)
    block = min(1024, next_power_of_2(inter))
    fp8 = fp8_buffers(x2.shape[0], inter, fp8_group, x.device) if fp8_group_fits(
        inter, fp8_group, block) else None  # fmt: skip
    q, s = fp8 if fp8 is not None else (out, out)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, q, s, x2.stride(0), out.stride(0), q.stride(0), s.stride(0), inter, FP8_MAX,
            AMAX_EPS, BLOCK=block, FP8_GROUP=fp8_group if fp8 is not None else 0,
        )  # fmt: skip
    out = out.view(*x.shape[:-1], inter)
    return (out, fp8) if fp8_group else out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
