"""FP8 activations quantized by the kernel that writes them: RMSNorm and SiLU-and-mul writing
their output's e4m3 rows and group scales (kernels/fused_ops.py), and an FP8 linear taking
them for that very tensor (layers/quantization/base.py FusedInput, InputFeeder). On the CPU the
checks run under the Triton interpreter in a subprocess (`python tests/test_fused_fp8_rows.py`
prints their results); tests/test_kernels_gpu.py and tests/test_quant_models_gpu.py run them
on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from interpreted import interpreter_test, report  # noqa: E402

from specserve.kernels import fp8_gemm  # noqa: E402
from specserve.kernels import fused_ops as fo  # noqa: E402

F32, CPU = torch.float32, "cpu"


def check_fused_fp8_rows(dtype: torch.dtype, device: str, hidden: int, inter: int,
                         group: int, norm_fits: bool = True, silu_fits: bool = True) -> None:
    """RMSNorm (with and without the residual) and SiLU-and-mul writing their outputs' FP8 rows
    too: the same outputs as without, and codes and scales bitwise quant_fp8_torch of them;
    None where the group does not tile the row (or the kernel's column blocks)."""
    from specserve.kernels.fp8_gemm import quant_fp8_torch

    gen = torch.Generator().manual_seed(hidden + group)
    x, res = (torch.randn(2, 3, hidden, generator=gen) * 3).to(device, dtype)
    x[0, :group] = 0  # an all-zero group: the tiny scale, codes 0
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    gate_up = torch.randn(5, 2 * inter, generator=gen).to(device, dtype)
    for out, fp8, rows, cols, fits in (
        (*fo.rms_norm(x, w, 1e-6, fp8_group=group), 3, hidden, norm_fits),
        (*fo.fused_add_rms_norm(x, res, w, 1e-6, fp8_group=group)[::2], 3, hidden, norm_fits),
        (*fo.silu_and_mul(gate_up, fp8_group=group), 5, inter, silu_fits),
    ):
        assert (fp8 is not None) == fits
        if fp8 is None:
            continue
        # the reference on the CPU: CUDA torch divides by a scalar as a multiply by its
        # reciprocal, not the IEEE division quant_fp8 (and these kernels) do
        q_want, s_want = quant_fp8_torch(out.reshape(rows, cols).cpu(), group)
        assert torch.equal(fp8[1].cpu(), s_want), (fp8[1].cpu() - s_want).abs().max()
        assert torch.equal(fp8[0].cpu().view(torch.uint8), q_want.view(torch.uint8))
    assert torch.equal(fo.rms_norm(x, w, 1e-6, fp8_group=group)[0], fo.rms_norm(x, w, 1e-6))
    assert torch.equal(fo.silu_and_mul(gate_up, fp8_group=group)[0], fo.silu_and_mul(gate_up))


def check_fp8_input_fed_by_kernels(fmt: str) -> None:
    """An FP8 MLP behind its RMSNorm on the Triton path (here the interpreter): the norm's and
    the SiLU-and-mul's kernels write the FP8 rows gate_up and down read, so no quantization
    launch runs, and the output is bitwise that of the same modules unfed (each linear
    quantizing its own input: two launches). A tensor other than the one offered gets no rows."""
    from unittest import mock

    from quant_formats import quant_config

    from specserve.layers import activation, norm
    from specserve.layers.mlp import GatedMLP
    from specserve.layers.norm import RMSNorm
    from specserve.layers.quantization import fp8 as fp8_method
    from specserve.layers.quantization import get_quant_config
    from specserve.models.presets import random_init

    mlp = GatedMLP(256, 256, quant_config=get_quant_config(quant_config(fmt)), prefix="m")
    random_init(mlp)
    ln = RMSNorm(256)
    ln.weight.data.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(1))
    x, res = torch.randn(2, 20, 256, generator=torch.Generator().manual_seed(2))
    calls, quant = [], fp8_gemm.quant_fp8

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[0].shape)
        return quant(*args, **kwargs)

    def on(*_tensors):  # noqa: ANN002, ANN202
        return True

    with (mock.patch.object(norm, "use_triton", on), mock.patch.object(activation, "use_triton", on),
          mock.patch.object(fp8_method, "use_triton", on),
          mock.patch.object(fp8_gemm, "quant_fp8", counted)):  # fmt: skip
        ln.feeds(*mlp.input_projs)
        fed = mlp(ln(x, res)[0])
        fed_row = mlp(ln(x[:1], res[:1])[0])  # one row: GEMV plans read the rows too
        assert not calls, calls
        normed = ln(x, res)[0]
        assert mlp.gate_up_proj.fused_input.take(normed.clone()) is None  # another tensor
        ln.feeds(None)
        mlp.act_fn.feeds(None)
        unfed = mlp(ln(x, res)[0])
        assert len(calls) == 2, calls
        unfed_row = mlp(ln(x[:1], res[:1])[0])  # quantized in the GEMV's loop
    assert torch.equal(fed, unfed) and torch.equal(fed_row, unfed_row)


def test_the_fp8_group_is_read_once_until_feeds_or_loading() -> None:
    """fp8_group() asks the consumers' methods once (an eager forward asked every one of them
    before), again after feeds() and after process_weights_after_loading (static scales are
    known from then)."""
    from torch import nn

    from specserve.layers.norm import RMSNorm
    from specserve.layers.quantization import process_weights_after_loading

    asked = []

    class Method:
        group = 128

        def fused_input_group(self, layer) -> int | None:  # noqa: ANN001
            asked.append(layer)
            return self.group

    lin = nn.Module()
    lin.quant_method = Method()
    model = nn.Module()
    model.norm = RMSNorm(8)
    model.norm.feeds(lin, lin)
    assert [model.norm.fp8_group() for _ in range(5)] == [128] * 5 and len(asked) == 2
    lin.quant_method.group = None  # e.g. static scales read from the checkpoint
    assert model.norm.fp8_group() == 128  # still the first answer
    process_weights_after_loading(model)
    assert model.norm.fp8_group() is None and len(asked) == 4
    lin.quant_method.group = 64
    model.norm.feeds(lin)
    assert model.norm.fp8_group() == 64 and len(asked) == 5


INTERPRETER_CHECKS = {
    "fused_fp8_rows_g128": lambda: check_fused_fp8_rows(F32, CPU, 256, 2048, 128),
    "fused_fp8_rows_per_row": lambda: check_fused_fp8_rows(F32, CPU, 256, 256, 256),
    "fused_fp8_rows_untiled": lambda: check_fused_fp8_rows(F32, CPU, 200, 384, 128, False),
    "fused_fp8_rows_per_row_blocks": lambda: check_fused_fp8_rows(F32, CPU, 2048, 2048, 2048,
                                                                  silu_fits=False),
    "fp8_input_fed_block": lambda: check_fp8_input_fed_by_kernels("fp8-block"),
    "fp8_input_fed_channel": lambda: check_fp8_input_fed_by_kernels("ct-fp8-channel"),
}
test_interpreter = interpreter_test(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__":
    report(INTERPRETER_CHECKS)
