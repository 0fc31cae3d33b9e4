"""Every command scripts/gpu_suite.sh would run parses, checked on the CPU before a GPU is spent
on it: the suite runs with every step against stand-ins for python, timeout and nvidia-smi
that record each python command instead of running it; then each `specserve` command goes
through the CLI's parser and its pre-load checks (what a typo'd flag or a bad combination hits
before the model loads), each script through its own parser (stopped right after parsing), and
each pytest run's files must exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ("tests,profile,plain,spec,moe,match,serve,mla,quant,comm,prefix,default,exact,glm,"
         "policy,mtp,drafters,longctx")
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["SUITE_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


class Parsed(Exception):
    """Raised by the patched parse_args once a script's flags parsed."""


def _run_suite(tmp: Path, steps: str, **env_extra: str) -> tuple[list[list[str]], int, str]:
    """The suite's python commands (recorded, not run), its exit status and stderr."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(RECORDER.format(python=sys.executable))
    (bin_dir / "timeout").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # run without a limit
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp / "commands.jsonl"
    log.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SUITE_LOG": str(log),
           **env_extra}
    done = subprocess.run(["bash", "scripts/gpu_suite.sh", str(tmp / "out"), steps], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    return [json.loads(line) for line in log.read_text().splitlines()], done.returncode, \
        done.stderr


@pytest.fixture(scope="module")
def suite_commands(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    return _run_suite(tmp_path_factory.mktemp("suite"), STEPS)[0]


def test_parts_pick_the_commands_of_a_step(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """LONGCTX_PARTS / POLICY_PARTS run only the parts named (a call's time limit), and a
    part not known stops the suite with a message naming the parts."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "longctx-32k.json").write_text("{}")  # as the 32k run leaves it
    cmds, rc, _ = _run_suite(tmp_path, "longctx", LONGCTX_PARTS="32k")
    assert rc == 0
    ran = [" ".join(c) for c in cmds]
    assert any("--context-len 32768" in c for c in ran), ran
    assert not any("1024,8192" in c or "eagle3" in c or "decode_vs_sdpa" in c for c in ran)
    plot = [c for c in cmds if c[0] == "scripts/plot_roofline.py"]
    assert len(plot) == 1 and not any("longctx-8k" in a for a in plot[0]), plot
    cmds, rc, _ = _run_suite(tmp_path, "policy", POLICY_PARTS="0.3")
    rates = [c[c.index("--accept-rate") + 1] for c in cmds if "--accept-rate" in c]
    assert rc == 0 and rates and set(rates) == {"0.3"}, cmds
    # the reference pair: trained without the recipe's evaluation, then swept; both parse
    cmds, rc, _ = _run_suite(tmp_path, "policy", POLICY_PARTS="reference")
    assert rc == 0 and [c[0] for c in cmds if c[0].startswith("scripts/")] == [
        "scripts/train_reference_pair.py", "scripts/bench_spec_policy.py"], cmds
    train, sweep = (c for c in cmds if c[0].startswith("scripts/"))
    assert "--no-eval" in train and sweep[sweep.index("--model") + 1].endswith(
        "/reference/target")
    for argv in (train, sweep):
        _check_script(argv[0], argv[1:], monkeypatch)
    for name, step in (("LONGCTX_PARTS", "longctx"), ("POLICY_PARTS", "policy")):
        cmds, rc, err = _run_suite(tmp_path, step, **{name: "nope"})
        assert rc == 2 and f"{name}: unknown part 'nope'" in err
        assert all(c[-1] == "doctor" for c in cmds), cmds  # nothing of the step ran


def _check_cli(argv: list[str]) -> None:
    from specserve.cli import build_parser
    from specserve.cli.commands import checked_engine_config
    from specserve.models.presets import PRESETS

    parser = build_parser()
    args = parser.parse_args(argv)  # SystemExit(2) on an unknown flag or a bad value
    if args.command == "bench" and args.bench_command == "latency":
        if args.model in PRESETS and args.load_format is None:
            args.load_format = "dummy"  # as `bench latency` does before its checks
        checked_engine_config(args)
    elif args.command == "bench" and args.bench_command == "serve" and args.start_server:
        _check_cli(["serve", *shlex.split(args.start_server)])
    elif args.command in ("generate", "serve", "eval-accept") and hasattr(args, "model"):
        checked_engine_config(args, dummy_ok=True)


def _check_script(path: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # a script's dataclasses look it up
    env = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:  # a script may set TRITON_INTERPRET for itself on a CPU: not for later tests
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [path, *argv])
        with pytest.raises(Parsed):
            module.main(argv) if "argv" in module.main.__code__.co_varnames else module.main()


def test_suite_runs_every_step(suite_commands: list[list[str]]) -> None:
    kinds = {c[1] if c[0] == "-m" else c[0] for c in suite_commands}
    assert {"specserve.cli", "pytest"} <= kinds, kinds
    assert any(k.startswith("scripts/") for k in kinds), kinds
    assert len(suite_commands) > 60, len(suite_commands)


def test_every_suite_command_parses(suite_commands: list[list[str]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    failures = []
    for argv in suite_commands:
        try:
            if argv[:2] == ["-m", "specserve.cli"]:
                _check_cli(argv[2:])
            elif argv[:2] == ["-m", "pytest"]:
                files = [a.split("::")[0] for a in argv[2:]
                         if a.startswith("tests/") and "*" not in a]
                missing = [f for f in files if not (REPO / f).exists()]
                assert not missing, f"missing test files {missing}"
            elif argv[0].startswith("scripts/"):
                _check_script(argv[0], argv[1:], monkeypatch)
        except (Exception, SystemExit) as exc:
            failures.append(f"{shlex.join(argv)[:300]}\n    -> {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
