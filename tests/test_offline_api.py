"""The offline API as vLLM's (`from specserve import LLM, SamplingParams`), generation-config
defaults, chat templates, the server's model names, and the memory estimate."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cli_run import run_cli
from tiny_models import make_hf_model

from specserve import defaults
from specserve.config import ModelConfig
from specserve.generation_config import load_generation_defaults

ROOT = Path(__file__).resolve().parents[1]
TINY = defaults.tiny_code_path()
HEAD = defaults.tiny_code_draft_path()
GREEDY_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with a generation_config.json that sets sampling defaults."""
    out = tmp_path_factory.mktemp("gen") / "model"
    out.mkdir()
    for name in os.listdir(TINY):
        if name != "generation_config.json":
            os.symlink(os.path.join(TINY, name), out / name)
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": 1,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 0,
                "repetition_penalty": 1.1,
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from specserve import LLM

    return LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        seed=3,
        chat_template=GREEDY_TEMPLATE,
        max_num_seqs=4,
        num_pages=256,
        page_size=8,
    )


def test_package_import_is_cheap_and_lazy() -> None:
    code = (
        "import sys, specserve\n"
        "from specserve import SamplingParams\n"
        "assert SamplingParams(max_tokens=3).max_tokens == 3\n"
        "assert 'torch' not in sys.modules and 'specserve.llm' not in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    import specserve
    import specserve.llm
    import specserve.sampling_params

    assert specserve.LLM is specserve.llm.LLM
    assert specserve.SamplingParams is specserve.sampling_params.SamplingParams
    with pytest.raises(AttributeError):
        specserve.NoSuchThing  # noqa: B018


@pytest.mark.skipif(HEAD is None, reason="no bundled EAGLE-3 head")
def test_llm_takes_vllm_keywords() -> None:
    from specserve import LLM, SamplingParams

    spec = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 2}
    llm = LLM(
        TINY,
        speculative_config=spec,
        tensor_parallel_size=1,
        dtype="float",
        seed=7,
        device="cpu",
        gpu_memory_utilization=0.5,
        block_size=8,
        num_pages=64,
    )
    config = llm.engine.config
    assert (config.parallel.tp_size, config.dtype, config.seed) == (1, "float32", 7)
    assert (config.cache.gpu_memory_utilization, config.cache.page_size) == (0.5, 8)
    assert (config.spec.algorithm, config.spec.draft_model, config.spec.num_steps) == (
        "eagle3",
        HEAD,
        2,
    )
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.spec_cycles > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_config={"method": "medusa"}), "'medusa' is not implemented yet"),
        (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 0}),
         "'prompt_lookup_min': must be >= 1"),
        (dict(speculative_config={"num_speculative_tokens": 3}), "needs 'method'"),
        (dict(speculative_config={"method": "eagle3"}), "draft_model is required by eagle3"),
        (
            dict(speculative_config={"method": "eagle3", "model": "dummy", "topk": 0}),
            "'topk': must be >= 1",
        ),
        (dict(dtype="bf16"), "dtype must be one of"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    ],
)
def test_llm_refuses_bad_options_before_loading(kwargs: dict, message: str) -> None:
    from specserve import LLM

    with pytest.raises(ValueError, match=message):
        LLM("/no/such/model", **kwargs)


def test_llm_unknown_keyword_is_a_type_error() -> None:
    from specserve import LLM

    with pytest.raises(TypeError, match="unknown engine option 'tensor_paralel_size'"):
        LLM(TINY, tensor_paralel_size=1)


def test_generation_config_sets_request_defaults(llm, model_dir: Path) -> None:
    gd = llm.engine.generation_defaults
    assert gd.params == {"temperature": 0.6, "top_p": 0.9, "top_k": -1,
                         "repetition_penalty": 1.1}
    assert gd.unapplied == {}  # every sampling key of the file is applied now
    assert "NOT applied" not in gd.describe() and "repetition_penalty=1.1" in gd.describe()
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, -1)
    assert params.repetition_penalty == 1.1
    # explicit values win over the defaults
    assert gd.sampling_params(temperature=0.0, top_p=None).temperature == 0.0
    assert load_generation_defaults("vllm", str(model_dir)).params == {}
    assert load_generation_defaults(str(model_dir), None).params == gd.params


def test_generation_config_repetition_penalty_is_logged_as_applied(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from specserve.engine.engine import Engine

    with caplog.at_level(logging.WARNING):
        Engine(_tiny_engine_config(model_dir))
    assert not any("NOT applied" in r.message for r in caplog.records)


def _tiny_engine_config(model: Path | str, **kw: object):
    from specserve.config import engine_config

    return engine_config(
        model=str(model), device="cpu", dtype="float32", num_pages=64, page_size=8, **kw
    )


def test_generation_config_values_are_checked(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ValueError, match="top_p must be in"):
        load_generation_defaults(str(tmp_path), None)
    with pytest.raises(ValueError, match="neither auto, vllm, nor a directory"):
        load_generation_defaults(str(tmp_path / "missing"), None)


def test_generate_uses_generation_config_unless_a_flag_is_given(
    model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    base = [
        "generate",
        "def f(",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--max-tokens",
        "4",
        "--num-pages",
        "64",
    ]
    rc, err = run_cli(base, capsys)
    assert rc == 0 and "temperature=0.6, top_p=0.9, top_k=-1" in err, err
    rc, err = run_cli([*base, "--temperature", "0"], capsys)
    assert rc == 0 and "greedy" in err, err
    rc, err = run_cli([*base, "--generation-config", "vllm"], capsys)
    assert rc == 0 and "greedy" in err, err  # generate's own default


def test_chat_template_inline_replaces_the_tokenizers(llm) -> None:
    from specserve import SamplingParams

    messages = [{"role": "user", "content": "hi there"}]
    ids = llm.tokenizer.apply_chat_template(messages)
    assert ids == llm.tokenizer.encode("<user>hi there", add_special_tokens=False)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_token_ids == ids and len(out.token_ids) == 3


def test_chat_template_from_a_file(tmp_path: Path) -> None:
    from specserve.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(GREEDY_TEMPLATE)
    assert read_chat_template(str(path)) == GREEDY_TEMPLATE
    # transformers' template extensions parse: loop controls and {% generation %}
    read_chat_template(
        "{% for m in messages %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    )


def test_server_takes_several_names_and_the_generation_defaults(model_dir: Path) -> None:
    from test_server import LiveServer

    server = LiveServer(_tiny_engine_config(model_dir), model_name=["first", "second"])
    try:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        body = {"model": "second", "prompt": "def f(", "max_tokens": 2}
        reply = httpx.post(server.url + "/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["model"] == "first"
        missing = httpx.post(server.url + "/v1/completions", json={**body, "model": "third"})
        assert missing.status_code == 404 and "'first' | 'second'" in missing.text
    finally:
        server.stop()
    from specserve.server.protocol import CompletionRequest

    req = CompletionRequest(prompt="x", top_p=0.5)
    params = req.sampling_params(4, server.async_engine.engine.generation_defaults.params)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, -1)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}),
    ("deepseek_v3", {}),  # MLA + MoE (router bias, shared expert, a dense first layer)
    ("deepseek_v3", {"q_lora_rank": None, "first_k_dense_replace": 3}),  # MLA, dense MLPs
    ("deepseek_v2", {}),  # no router bias
    ("glm4_moe", {}),  # GQA with q/k/v bias and q/k norms, MoE
    ("glm4_moe_lite", {}),  # MLA, MoE after mlp_layer_types' dense layer
    ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"]}),  # MLA + two indexers
])  # fmt: skip
def test_num_parameters_matches_transformers(family: str, overrides: dict) -> None:
    model = make_hf_model(family, **overrides)
    config = ModelConfig.from_hf(model.config.to_dict())
    # the router's selection bias is a buffer in transformers, a weight of the checkpoint
    biases = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters()) + biases


def test_memory_check_refuses_with_what_to_do() -> None:
    import torch

    from specserve.config import CacheConfig
    from specserve.engine.memory import check_fits
    from specserve.models.presets import PRESETS

    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    cpu = torch.device("cpu")
    check_fits("8b", cfg, None, torch.float32, cpu, CacheConfig(), available=40 * 10**9)
    with pytest.raises(
        ValueError,
        match=r"needs about 32\.1 GB .* \+ 0\.27 GB of KV cache, "
        r"but 20\.0 GB of memory available; use --dtype bfloat16",
    ):
        check_fits("8b", cfg, None, torch.float32, cpu, CacheConfig(), available=20 * 10**9)
    with pytest.raises(ValueError) as info:
        check_fits("8b", cfg, None, torch.bfloat16, cpu, CacheConfig(), available=10 * 10**9)
    assert "--dtype" not in str(info.value) and "a smaller model" in str(info.value)


def test_server_start_up_line_says_how_speculation_runs(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from starlette.testclient import TestClient

    from specserve.engine.engine import Engine
    from specserve.server.api import build_app
    from specserve.server.async_engine import AsyncEngine
    from specserve.spec_config import SpecConfig

    spec = SpecConfig(
        algorithm="eagle3", draft_model="dummy", num_steps=2, topk=2, num_draft_tokens=5
    )
    engine = Engine(_tiny_engine_config(model_dir, spec=spec))
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        with TestClient(build_app(AsyncEngine(engine), None, model_name="m")) as client:
            assert client.get("/health").status_code == 200
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving m"))
    assert (
        "speculation eagle3 (tree topk 2, 2 draft steps, 5 tokens verified per cycle; head dummy)"
    ) in line
    assert "sampling defaults from" in line and "repetition_penalty=1.1" in line
    assert "NOT applied" not in line
    assert SpecConfig().describe() == "speculation off"


def test_generate_n_choices_per_prompt() -> None:
    """SamplingParams(n=k): k independent choices per prompt (vLLM's out.outputs), choice 0 with
    the request's seed, the others with seeds derived from it: distinct, reproducible; the
    engine itself runs one sequence per request."""
    from specserve import LLM, SamplingParams

    llm = LLM(TINY, device="cpu", dtype="float32", speculative_config={
        "method": "eagle3", "model": HEAD, "num_speculative_tokens": 2})
    prompts = ["def add(a, b):", "import os\n"]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=11, n=3)
    outs = llm.generate(prompts, sampled)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    texts = [[c.token_ids for c in o.outputs] for o in outs]
    assert all(len({tuple(t) for t in ts}) == 3 for ts in texts)  # the choices differ
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled)] == texts
    one = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=11))
    assert [o.token_ids for o in one] == [t[0] for t in texts] and one[0].outputs == [one[0]]
    greedy = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="an engine request is one sequence"):
        llm.engine.add_request(None, prompts[0], sampled)
    for bad in (0, 17):
        with pytest.raises(ValueError, match=r"n must be in \[1, 16\]"):
            SamplingParams(n=bad)
    llm.close()
