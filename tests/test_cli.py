"""The `specserve` command line: vLLM-shaped flags, early one-line errors, real defaults.

Parsing is checked in-process (fast); the few behaviours that need a fresh interpreter (no
torch at parse time, `python -m specserve`, --version) run as subprocesses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli

from specserve import defaults
from specserve.cli import build_parser
from specserve.cli.engine_args import engine_config_from_args
from specserve.config import EngineConfig, engine_config
from specserve.config_flags import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = defaults.tiny_code_path()
HEAD = defaults.tiny_code_draft_path()


def _config(*argv: str, command: str = "serve") -> EngineConfig:
    args = build_parser().parse_args(
        [command, *argv] if command != "generate" else [command, "prompt", *argv]
    )
    return engine_config_from_args(args)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_parsing_and_flag_errors_import_no_torch() -> None:
    proc = _python(
        "import sys\n"
        "from specserve.cli import main\n"
        "for argv in (['serve', '--help'], ['bench', 'latency', '--help'],\n"
        "             ['train-eagle3', '--help'], ['serve', '--page-size', '0']):\n"
        "    try:\n"
        "        rc = main(argv)\n"
        "    except SystemExit as exc:\n"
        "        rc = exc.code\n"
        "    assert rc == (2 if '0' in argv else 0), (argv, rc)\n"
        "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'matplotlib')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "--page-size must be >= 1, got 0" in proc.stderr


def test_python_dash_m_and_version() -> None:
    from specserve import __version__

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    version, helped = (
        subprocess.run(
            [sys.executable, "-m", "specserve", flag],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        for flag in ("--version", "--help")
    )
    assert version.returncode == 0 and version.stdout.strip() == f"specserve {__version__}"
    assert helped.returncode == 0
    for command in ("generate", "serve", "bench", "doctor", "train-eagle3", "eval-accept"):
        assert command in helped.stdout


def test_help_shows_the_real_defaults(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    name = f"{defaults.DEFAULT_MODEL_NAME} ({defaults.DEFAULT_MODEL_PACKAGE})"
    assert f"the default model, {name} with its EAGLE-3 head" in text
    assert "eagle3 with the bundled head when --model is omitted" in text
    assert "(default: '')" not in text  # no placeholder shown as a default
    assert "-tp N, --tensor-parallel-size N, --tp-size N" in text


BAD = [
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--cpu-threads", "-1"], "--cpu-threads must be >= 0, got -1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be <= 1.0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be > 0.0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--kv-cache-bytes", "0"], "--kv-cache-bytes must be >= 1"),
    (["-tp", "0"], "--tensor-parallel-size must be >= 1"),
    (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N"),
    (["--dtype", "bf16"], "argument --dtype: invalid choice"),
    (["--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value"),
    (["--model", "/no/such/model"], "--model '/no/such/model': no such file or directory"),
    (["--spec-draft-model", "/no/such/head"], "--spec-draft-model '/no/such/head': no such"),
    (["--spec-draft-model", str(ROOT)], "holds no config.json"),
    (["--spec-algorithm", "medusa"], "--spec-algorithm 'medusa' is not implemented yet"),
    (["--spec-algorithm", "ngram", "--spec-draft-model", "dummy"], "method ngram takes no draft"),
    (["--spec-algorithm", "eagle3", "--spec-prompt-lookup-max", "3"],
     "--spec-prompt-lookup-max applies to method ngram only"),
    (["--speculative-config", '{"method": "ngram", "topk": 2, "num_draft_tokens": 4}'],
     "--speculative-config 'topk': ngram drafts a chain"),
    (["--speculative-config", '{"method": "suffix", "suffix_max_match_len": 0}'],
     "--speculative-config 'suffix_max_match_len': must be >= 1"),
    (["--spec-algorithm", "medusa2"], "'medusa2' is not a speculative method"),
    (["--spec-algorithm", "none", "--spec-draft-model", "dummy"], "speculation is off"),
    (["--model", TINY, "--spec-num-steps", "5"], "--spec-num-steps needs speculation on"),
    (
        ["--spec-topk", "4", "--spec-num-draft-tokens", "99"],
        "--spec-num-draft-tokens must be in [2, 37] for topk 4 and 3 steps, got 99",
    ),
    (["--spec-synthetic-accept-len", "9"], "--spec-synthetic-accept-len must be <= "),
    (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
    (["--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
    (["--speculative-config", '{"method": "eagle3", "foo": 1}'], "unknown key 'foo'"),
    (
        ["--speculative-config", '{"method": "medusa"}'],
        "--speculative-config 'method': 'medusa' is not implemented yet; implemented: eagle3, ",
    ),
    (
        ["--speculative-config", '{"num_speculative_tokens": 0}'],
        "--speculative-config 'num_speculative_tokens': must be >= 1, got 0",
    ),
    (
        ["--speculative-config", '{"num_speculative_tokens": 4, "num_steps": 5}'],
        "mean the same; give one",
    ),
    (
        ["--speculative-config", '{"topk": 2}', "--spec-topk", "3"],
        "--speculative-config topk=2 conflicts with --spec-topk 3",
    ),
    (["--chat-template", "no_such_template.jinja"], "--chat-template 'no_such_template.jinja'"),
    (
        ["--chat-template", "{% for m in messages %}"],
        "--chat-template the chat template does not parse",
    ),
    (["--generation-config", str(ROOT / "docs")], "--generation-config"),
    (["/no/such/model"], "--model '/no/such/model'"),
    ([TINY, "--model", HEAD or "x"], "the model is given twice"),
    (["--port", "0"], "--port must be in [1, 65535]"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_bad_flag_is_one_line_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    rc, err = run_cli(["serve", *argv], capsys)
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_port_in_use_is_refused_before_loading(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, err = run_cli(["serve", "--port", str(port)], capsys)
    assert rc == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in err


def test_serve_model_positional_equals_model_flag() -> None:
    assert _config(TINY).model == _config("--model", TINY).model == TINY
    assert _config(TINY, "--model", TINY).model == TINY  # the same twice is fine


def test_tensor_parallel_spellings_set_tp_size() -> None:
    for flag in ("-tp", "--tensor-parallel-size", "--tp-size"):
        assert _config("--model", TINY, flag, "2").parallel.tp_size == 2
    for keyword in ("tensor_parallel_size", "tp_size"):
        assert engine_config(**{keyword: 4}).parallel.tp_size == 4


def test_dtype_aliases() -> None:
    assert _config("--dtype", "half").dtype == "float16"
    assert _config("--dtype", "float").dtype == "float32"
    assert _config("--dtype", "bfloat16").dtype == "bfloat16"


def test_default_is_the_bundled_pair_with_eagle3() -> None:
    config = _config()
    assert config.model == defaults.default_model_path()
    draft = defaults.default_draft_path()
    if draft:
        assert (config.spec.algorithm, config.spec.draft_model) == ("eagle3", draft)
    assert not _config("--spec-algorithm", "none").spec.enabled
    assert not _config("--model", TINY).spec.enabled  # a model of your own: plain
    tuned = _config("--spec-num-steps", "5", "--spec-topk", "2", "--spec-num-draft-tokens", "8")
    assert (tuned.spec.num_steps, tuned.spec.topk, tuned.spec.verify_tokens) == (5, 2, 8)


def test_model_free_drafters_from_flags_and_json() -> None:
    """ngram and suffix need no draft model (not even the default model's bundled head)."""
    for argv in (["--spec-algorithm", "ngram", "--spec-prompt-lookup-max", "3"],
                 ["--model", TINY, "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}']):
        spec = _config(*argv).spec
        assert (spec.algorithm, spec.draft_model, spec.lookup_range) == ("ngram", "", (1, 3))
    from specserve.cli.preflight import check_engine_config

    check_engine_config(_config(*argv))  # no draft model path to check
    spec = _config("--model", TINY, "--spec-algorithm", "suffix", "--spec-topk", "2",
                   "--spec-num-draft-tokens", "6", "--spec-suffix-min-token-prob", "0.3").spec
    assert (spec.algorithm, spec.verify_tokens, spec.suffix_settings) == ("suffix", 6,
                                                                          (8, 1000, 0.3))


def test_draft_model_alone_turns_eagle3_on() -> None:
    spec = _config("--model", TINY, "--spec-draft-model", "dummy").spec
    assert (spec.algorithm, spec.draft_model) == ("eagle3", "dummy")


def test_speculative_config_maps_vllm_keys() -> None:
    text = json.dumps(
        {
            "method": "eagle3",
            "model": "dummy",
            "num_speculative_tokens": 4,
            "topk": 2,
            "num_draft_tokens": 7,
        }
    )
    spec = _config("--model", TINY, "--speculative-config", text).spec
    assert (spec.algorithm, spec.draft_model, spec.num_steps, spec.topk, spec.num_draft_tokens) == (
        "eagle3",
        "dummy",
        4,
        2,
        7,
    )
    # the --spec-* flags are aliases: they merge with the JSON when they agree
    both = _config("--model", TINY, "--speculative-config", text, "--spec-topk", "2").spec
    assert both == spec
    # a model without a method is EAGLE-3 (the one method taking a head)
    only = _config("--model", TINY, "--speculative-config", '{"model": "dummy"}').spec
    assert only.algorithm == "eagle3"


def test_config_errors_name_the_flag_and_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        engine_config(page_size=0)
    assert str(info.value) == "page_size must be >= 1, got 0"
    assert info.value.cli_message() == "--page-size must be >= 1, got 0"
    with pytest.raises(TypeError, match="unknown engine option 'page_sise'"):
        engine_config(page_sise=16)


def test_served_model_names(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    rc, err = run_cli(["serve", "--served-model-name", ""], capsys)
    assert rc == 2 and "--served-model-name names must be non-empty" in err


def test_bench_latency_preset_memory_is_checked_before_building(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve.engine import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 24 * 10**9)
    rc, err = run_cli(
        [
            "bench",
            "latency",
            "--model",
            "llama-3.1-8b",
            "--device",
            "cpu",
            "--batch-sizes",
            "1",
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 2, err
    assert "llama-3.1-8b needs about 32.1 GB for its float32 weights" in err
    assert "24.0 GB of memory available" in err and "--dtype bfloat16 (16.1 GB" in err
