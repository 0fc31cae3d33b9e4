"""Quantized checkpoints in the engine: config parsing and the --quantization flag, EAGLE-3
heads over a quantized target, the weight-stream floor, random weights in each format."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_quant import SHAPE, make_quantized_checkpoint

from specserve.config import ModelConfig
from specserve.layers.quantization import get_quant_config, resolve_quantization
from specserve.llm import LLM
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fp8") / "m")
    make_quantized_checkpoint(path, "fp8-block")
    return path


def _load(path: str) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(path), path, torch.float32, "cpu")


# -- configs ------------------------------------------------------------------------------------


def test_quantization_flag_must_match_the_checkpoint(fp8_ckpt: str) -> None:
    raw = ModelConfig.from_hf(fp8_ckpt).quantization
    assert resolve_quantization(raw, "fp8", dummy=False) is raw
    with pytest.raises(
        ValueError, match="--quantization w4a16 but the checkpoint's weights are fp8"
    ):
        resolve_quantization(raw, "w4a16", dummy=False)
    with pytest.raises(ValueError, match="weights are none"):
        resolve_quantization(None, "nvfp4", dummy=False)
    assert get_quant_config(resolve_quantization(None, "nvfp4", dummy=True)).family == "nvfp4"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"quant_method": "awq"}, "'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "MIXED_PRECISION"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "symmetric": False,
                            "strategy": "group",
                            "group_size": 128,
                        },
                    }
                },
            },
            "asymmetric",
        ),
    ],
)
def test_unsupported_configs_are_named(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_quant_config(raw)


def test_exclusions_keep_layers_dense() -> None:
    from quant_formats import quant_config

    ct = get_quant_config(
        {**quant_config("ct-int4-g32"), "ignore": ["lm_head", "re:.*self_attn.*"]}
    )
    assert ct.linear_method("model.layers.0.self_attn.qkv_proj").name == "unquantized"
    assert ct.linear_method("model.layers.0.mlp.gate_up_proj").name == "int4-w4a16-g32"
    mo = get_quant_config(
        {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "exclude_modules": ["lm_head", "model.layers.0.mlp*"],
        }
    )
    assert mo.linear_method("model.layers.0.mlp.down_proj").name == "unquantized"
    assert mo.linear_method("model.layers.1.mlp.down_proj").family == "nvfp4"
    half = get_quant_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "ignored_layers": ["model.layers.0.self_attn.q_proj"],
        }
    )
    with pytest.raises(ValueError, match="excludes only some of"):
        half.linear_method("model.layers.0.self_attn.qkv_proj")


# -- EAGLE-3 over a quantized target ------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fp8t") / "m")
    make_quantized_checkpoint(path, "fp8-block", num_hidden_layers=4)  # room for 3 aux layers
    return path


def _head_linears(engine) -> list:
    from specserve.layers.linear import LinearBase

    head = engine.drafter.proposer.head
    return [m for m in head.modules() if isinstance(m, LinearBase)]


def test_eagle3_head_stays_dense_over_a_quantized_target(fp8_target: str, tmp_path) -> None:
    """A head whose config.json carries the target's quantization_config (as copied configs
    do) loads dense, value for value; the random head for a quantized target is dense too."""
    from tiny_eagle import make_tiny_eagle3_head

    head_dir = make_tiny_eagle3_head(str(tmp_path / "head"), fp8_target)
    with open(os.path.join(head_dir, "config.json")) as fh:
        cfg = json.load(fh)
    with open(os.path.join(fp8_target, "config.json")) as fh:
        cfg["quantization_config"] = json.load(fh)["quantization_config"]
    with open(os.path.join(head_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    saved = load_file(os.path.join(head_dir, "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain = [
        o.token_ids
        for o in LLM(fp8_target, device="cpu", dtype="float32").generate(prompts, params)
    ]
    for draft in (head_dir, "dummy"):
        llm = LLM(
            fp8_target,
            device="cpu",
            dtype="float32",
            speculative_config={"algorithm": "eagle3", "draft_model": draft},
        )
        engine = llm.engine
        target = engine.runner.model.model.layers[0].mlp.down_proj
        assert target.quant_method.family == "fp8"
        linears = _head_linears(engine)
        assert len(linears) == 5
        assert all(
            m.quant_method.name == "unquantized" and m.weight.dtype == torch.float32
            for m in linears
        )
        if draft == head_dir:
            torch.testing.assert_close(
                engine.drafter.proposer.head.fc.weight, saved["fc.weight"], rtol=0, atol=0
            )
        outs = llm.generate(prompts, params)  # lossless: the target's own greedy tokens
        assert [o.token_ids for o in outs] == plain
        assert sum(o.spec_cycles for o in outs) > 0


def test_quantized_eagle3_head_is_refused(fp8_target: str, tmp_path) -> None:
    from tiny_eagle import make_tiny_eagle3_head

    from specserve.config import EngineConfig, SpecConfig
    from specserve.engine.engine import Engine

    head_dir = make_tiny_eagle3_head(str(tmp_path / "head"), fp8_target)
    tensors = load_file(os.path.join(head_dir, "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, os.path.join(head_dir, "model.safetensors"))
    with pytest.raises(ValueError, match="stores quantized tensors.*fc.weight"):
        Engine(
            EngineConfig(
                model=fp8_target,
                device="cpu",
                dtype="float32",
                spec=SpecConfig(algorithm="eagle3", draft_model=head_dir),
            )
        )


# -- the weight-stream floor counts what each format reads ---------------------------------------


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-int4-g32", "modelopt-nvfp4"])
def test_floor_streams_the_formats_bytes(fmt: str, tmp_path) -> None:
    from specserve.bench import floor

    path = str(tmp_path / "m")
    make_quantized_checkpoint(path, fmt)
    model = _load(path)
    down = model.model.layers[0].mlp.down_proj  # N 256, K 384, fp32 activations
    n, k = 256, 384
    expected = {
        "fp8-block": n * k + 4 * 2 * 3,  # codes + fp32 128x128 block scales
        "ct-int4-g32": n * k // 2 + 4 * n * (k // 32),  # nibbles + scales (model dtype)
        "modelopt-nvfp4": n * k // 2 + n * (k // 16) + 4 * n,
    }[fmt]  # + fp8 scales, rows
    assert floor.linear_stream_bytes(down) == expected
    weights = floor.floor_weights(model)
    codes = down.quant_method.stream_tensors(down)[0]
    assert any(w.data_ptr() == codes.data_ptr() for w in weights)  # a view, not a copy
    linears = [
        m
        for layer in model.model.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    total = sum(w.numel() * w.element_size() for w in weights)
    streamed = sum(floor.linear_stream_bytes(m) for m in linears) + 512 * 256 * 4  # + lm_head
    assert streamed <= total < streamed + 256 * 4  # the scales' matrix rounds up to a row
    point = floor.measure_floor(model, [1], replays=2, warmup=1)[0]
    assert point.weight_bytes == total and point.ms > 0


# -- random weights in a format (--load-format dummy --quantization X) --------------------------


@pytest.mark.parametrize(
    "flag, method",
    [
        ("fp8", "fp8-block128x128"),
        ("w4a16", "int4-w4a16-g128"),
        ("nvfp4", "nvfp4-w4a16 (modelopt)"),
    ],
)
def test_dummy_weights_in_each_format(flag: str, method: str, tmp_path) -> None:
    from specserve.config import EngineConfig

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
        **SHAPE,
    }
    path = tmp_path / "shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        EngineConfig(
            model=str(path), load_format="dummy", quantization=flag, device="cpu", dtype="float32"
        )
    )
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.quant_method.name == method
    w = layer.quant_method.dequantized_weight(layer)
    assert 0.01 < w.std().item() < 0.04  # random codes meaning ~N(0, 0.02)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_cli_rejects_a_mismatched_flag_before_loading(fp8_ckpt: str, capsys) -> None:
    from specserve.cli import main

    rc = main(["generate", "hi", "--model", fp8_ckpt, "--quantization", "nvfp4", "--device", "cpu"])
    err = capsys.readouterr()
    assert rc != 0
    assert "--quantization nvfp4 but the checkpoint's weights are fp8" in err.out + err.err


# -- the TP runtime (worker processes) resolves the same format on every rank --------------------


@pytest.mark.slow
def test_tp2_engine_builds_every_shard_in_the_resolved_format(tmp_path, capfd) -> None:
    """Random NVFP4 weights from --quantization at TP=2: the worker process resolves the same
    format for its shard (TP=2 numerics == TP=1 on checkpoints: test_quantization's gloo test)."""
    from specserve.config import EngineConfig, ParallelConfig

    path = tmp_path / "shape"
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
        **SHAPE,
    }
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            load_format="dummy",
            quantization="nvfp4",
            parallel=ParallelConfig(tp_size=2),
        )
    )
    assert llm.engine.executor.worker_pids
    llm.generate([[5, 9, 300, 41]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    digests = llm.engine.executor.close()
    assert digests == {1: llm.engine.executor.digest}
    llm.close()
    assert "tp-rank1 INFO linear layers and experts by method: {'nvfp4-w4a16 (modelopt)': 8}" in (
        capfd.readouterr().err
    )
