"""Quantized checkpoints on the CPU path: each format against transformers running the same
weights dequantized in fp32 (tiny_quant.py), loading errors, TP sharding of scales.

Tolerances on |logit difference| per token row (logits of magnitude ~1-5):
    weight-only formats (INT4, NVFP4): 1e-4 for every row (the same fp32 products, another
    summation order)
    W8A8 formats: median row 1e-4, worst row 0.15. The reference quantizes its activations the
    same way, so most rows agree to fp32 rounding; but a residual stream that differs by fp32
    rounding (decode and prefill sum in other orders) can put an activation on the other side
    of an fp8 rounding boundary, one e4m3 step (~6-12% of that element): measured up to 0.08.
    A wrong scale or group would move every row by O(1).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_quant import logit_errors, make_quantized_checkpoint

from specserve.config import CacheConfig, ModelConfig
from specserve.distributed import parallel_state
from specserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from specserve.layers.quantization import get_quant_config
from specserve.llm import LLM
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams

W8A8 = (1e-4, 0.15)  # (median row, worst row)
WEIGHT_ONLY = (1e-4, 1e-4)
FORMATS = {  # format -> (tolerances, the linear method our loader must pick)
    "fp8-block": (W8A8, "fp8-block128x128"),
    "ct-fp8-block": (W8A8, "fp8-block128x128"),
    "ct-fp8-channel": (W8A8, "fp8-channel"),
    "modelopt-fp8": (W8A8, "fp8-tensor"),
    "ct-int4-g32": (WEIGHT_ONLY, "int4-w4a16-g32"),
    "ct-int4-g128": (WEIGHT_ONLY, "int4-w4a16-g128"),
    "modelopt-nvfp4": (WEIGHT_ONLY, "nvfp4-w4a16 (modelopt)"),
    "ct-nvfp4": (WEIGHT_ONLY, "nvfp4-w4a16 (compressed-tensors)"),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    fmt = request.param
    path = str(tmp_path_factory.mktemp(fmt) / "m")
    reference = make_quantized_checkpoint(path, fmt)
    return {"fmt": fmt, "path": path, "reference": reference}


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


def test_logits_match_dequantized_reference(quantized: dict) -> None:
    (median_tol, max_tol), method = FORMATS[quantized["fmt"]]
    model = _load(quantized["path"])
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.name == method
    assert model.model.layers[1].mlp.down_proj.quant_method.name == method
    errors = logit_errors(model, quantized["reference"], seed=1)
    median, worst = errors[len(errors) // 2], errors[-1]
    assert median < median_tol and worst < max_tol, (
        f"{quantized['fmt']}: logit error median {median:.2e}, worst {worst:.2e}"
    )


def _reference_greedy(
    model: torch.nn.Module, prompt: list[int], n: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens of the reference and each step's top-2 logit margin."""
    ids, out, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            out.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            ids.append(out[-1])
    return out, margins


def test_greedy_matches_dequantized_reference(quantized: dict) -> None:
    """Token for token; a continuation may part from the reference only at a near-tie (top-2
    margin under the format's logit tolerance), and the comparison of that prompt ends there."""
    tol = FORMATS[quantized["fmt"]][0][1]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    llm = LLM(
        quantized["path"],
        device="cpu",
        dtype="float32",
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, margins = _reference_greedy(quantized["reference"], prompt, 10)
        for got, want, margin in zip(out.token_ids, ref, margins):
            if got != want:
                assert margin < tol, f"diverged at a top-2 margin of {margin:.3g} (tol {tol})"
                break
            compared += 1
    assert compared >= 20


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fp8") / "m")
    make_quantized_checkpoint(path, "fp8-block")
    return path


def _edited(src: str, dst: str, edit) -> str:
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with (
        open(os.path.join(src, "config.json")) as fh,
        open(os.path.join(dst, "config.json"), "w") as out,
    ):
        out.write(fh.read())
    return dst


def test_corrupted_scale_shape_names_the_tensor(fp8_ckpt: str, tmp_path) -> None:
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    path = _edited(fp8_ckpt, str(tmp_path / "m"), lambda t: t.__setitem__(name, torch.ones(2, 2)))
    with pytest.raises(ValueError, match=rf"'{name}'.*\(2, 2\).*\(2, 3\)"):
        _load(path)


def test_dense_tensor_in_a_quantized_layer_is_refused(fp8_ckpt: str, tmp_path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _edited(fp8_ckpt, str(tmp_path / "m"), lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match=rf"'{name}'.*float32.*float8_e4m3fn"):
        _load(path)


def test_missing_scale_is_reported(fp8_ckpt: str, tmp_path) -> None:
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    path = _edited(fp8_ckpt, str(tmp_path / "m"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {name}"):
        _load(path)


def test_codes_without_a_quantization_config_are_refused(fp8_ckpt: str, tmp_path) -> None:
    path = str(tmp_path / "m")
    _edited(fp8_ckpt, path, lambda t: None)
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    del config["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    with pytest.raises(ValueError, match="holds quantized codes but this layer is not quantized"):
        load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


# -- TP: each rank's shards of every tensor, against the TP=1 layer ----------------------------


def _set_tp(monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)


def _layer(cls, args, fmt: str, loads: dict, monkeypatch, rank: int, tp: int):
    from quant_formats import quant_config

    _set_tp(monkeypatch, rank, tp)
    layer = cls(*args, quant_config=get_quant_config(quant_config(fmt)), prefix="m.down_proj")
    params = dict(layer.named_parameters())
    for (suffix, shard), tensor in loads.items():
        layer.weight_loader(params[suffix], tensor, shard)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-int4-g32", "ct-nvfp4", "modelopt-fp8"])
def test_tp2_shards_equal_tp1(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from quant_formats import _tensors

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(256, 512, generator=gen), torch.randn(256, 512, generator=gen)
    down = torch.randn(256, 512, generator=gen)
    col = {}
    for shard, w in ((0, gate), (1, up)):
        col.update({(s, shard): t for s, t in _tensors(fmt, w, shard)[0].items()})
    row = {(s, None): t for s, t in _tensors(fmt, down, 0)[0].items()}
    x = torch.randn(3, 512, generator=gen)
    whole_col = _layer(MergedColumnParallelLinear, (512, [256, 256]), fmt, col, monkeypatch, 0, 1)
    whole_row = _layer(RowParallelLinear, (512, 256), fmt, row, monkeypatch, 0, 1)
    ref_col, ref_row = whole_col(x), whole_row(x)
    cols, partial = [], torch.zeros_like(ref_row)
    for rank in range(2):
        c = _layer(MergedColumnParallelLinear, (512, [256, 256]), fmt, col, monkeypatch, rank, 2)
        r = _layer(RowParallelLinear, (512, 256), fmt, row, monkeypatch, rank, 2)
        cols.append(c.quant_method.apply(c, x, None).split(128, dim=-1))
        partial += r.quant_method.apply(r, x[:, rank * 256 : (rank + 1) * 256], None)
    # rank-major [gate_r | up_r] -> [gate | up]
    stitched = torch.cat([cols[0][0], cols[1][0], cols[0][1], cols[1][1]], -1)
    torch.testing.assert_close(stitched, ref_col, rtol=1e-5, atol=1e-4)
    # row-parallel: each rank quantizes its half of x; 128-groups fall the same as at TP=1
    torch.testing.assert_close(partial, ref_row, rtol=1e-4, atol=1e-3)


def test_tp_split_inside_a_block_names_the_tensor_and_sizes_that_work(monkeypatch) -> None:
    from quant_formats import quant_config

    _set_tp(monkeypatch, 0, 2)
    with pytest.raises(
        ValueError,
        match=r"'m.down_proj.weight_scale_inv'.*blocks of 128; "
        r"tp_size 2 .* work for this tensor: 1, 3",
    ):
        RowParallelLinear(
            384, 128, quant_config=get_quant_config(quant_config("fp8-block")), prefix="m.down_proj"
        )
    with pytest.raises(ValueError, match=r"'m.down_proj.weight_packed'.*blocks of 8.*: 1, 5$"):
        RowParallelLinear(
            40,
            128,
            quant_config=get_quant_config(quant_config("ct-int4-g32")),
            prefix="m.down_proj",
        )


def test_fused_shard_off_a_block_boundary_is_refused() -> None:
    from quant_formats import quant_config

    with pytest.raises(
        ValueError,
        match=r"'m.up_proj.weight_scale_inv'.*feature 64, inside a "
        "block of 128",
    ):
        MergedColumnParallelLinear(
            128,
            [64, 64],
            quant_config=get_quant_config(quant_config("fp8-block")),
            prefix="m.gate_up_proj",
        )


# -- TP=2 over gloo processes: the logits of TP=1 ---------------------------------------------

TP_CASES = {  # format -> (checkpoint overrides making every shard whole blocks, tolerance)
    "ct-int4-g32": ({}, 1e-4),
    "modelopt-nvfp4": ({}, 1e-4),
    # W8A8: each rank quantizes its half of a row-parallel input in the same 128-groups, so
    # only fp32 summation order differs; an fp8 rounding flip bounds the error (see the top)
    "fp8-block": ({"num_key_value_heads": 4, "intermediate_size": 512}, W8A8[1]),
}


@pytest.mark.slow
def test_tp2_gloo_logits_equal_tp1(tmp_path) -> None:
    import torch.multiprocessing as mp
    from test_tp_gloo import TP, _free_port, _run, _worker

    paths = []
    for fmt, (overrides, _) in TP_CASES.items():
        paths.append(str(tmp_path / fmt))
        make_quantized_checkpoint(paths[-1], fmt, **overrides)
    mp.spawn(_worker, args=(paths, _free_port(), str(tmp_path), "gloo"), nprocs=TP, join=True)
    expected = [_run(p) for p in paths]
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for (fmt, (_, tol)), exp, res in zip(TP_CASES.items(), expected, got):
            err = max((g - e).abs().max().item() for e, g in zip(exp, res))
            assert err < tol, f"{fmt} rank {rank}: max abs logit difference {err:.2e}"


def test_fp8_is_refused_by_name_on_gpus_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any weight loads: an FP8 checkpoint (alone or mixed with INT4 layers) on a GPU
    below compute capability 8.9 gets one message naming the capability and what to serve
    instead; INT4 and NVFP4 (weight-only, scales decoded in the kernel) pass, as does FP8 on
    an Ada/Hopper part or the CPU."""
    from quant_formats import quant_config

    from specserve.kernels import gemm_split
    from specserve.layers.quantization import check_device

    cuda = torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(gemm_split, "fp8_native", lambda device: device.type != "cuda")
    # Kimi K2.5's shape: INT4 routed experts, FP8 elsewhere, one compressed-tensors config
    mixed = quant_config("ct-int4-g32")
    mixed["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
    mixed["config_groups"]["group_1"] = {
        **quant_config("ct-fp8-block")["config_groups"]["group_0"], "format": "float-quantized"}
    fp8 = [quant_config(f) for f in ("fp8-block", "ct-fp8-block", "modelopt-fp8")] + [mixed]
    assert get_quant_config(mixed).family == "mixed"
    for raw in fp8:
        with pytest.raises(ValueError, match=r"FP8 .*compute capability 8\.9.*cuda:0 is 8\.0"):
            check_device(raw, cuda)
        check_device(raw, torch.device("cpu"))
    for fmt in ("ct-int4-g32", "ct-nvfp4"):
        check_device(quant_config(fmt), cuda)
    check_device(None, cuda)
    monkeypatch.setattr(gemm_split, "fp8_native", lambda device: True)
    check_device(quant_config("fp8-block"), cuda)
