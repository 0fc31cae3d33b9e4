"""train-eagle3 end to end: a few steps lower the loss, the export's format, the exported head
decodes losslessly (and the bundled pair does), resume, the time budget, Ctrl-C, the CLI
(train-eagle3's refusals, eval-accept), and the reference-pair recipe on toy sizes. The draft
vocabulary, data and the training head against the inference head are in
test_train_head.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import train_fixtures

from specserve.config import ModelConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.train import data as D
from specserve.train.config import TrainConfig
from specserve.train.eagle3 import Eagle3Trainer

ROOT = Path(__file__).resolve().parents[1]

# the fixtures of train_fixtures.py, bound here so that pytest finds them in this module
one_thread = train_fixtures.one_thread
target = train_fixtures.target
code_files = train_fixtures.code_files


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, target: str,
            code_files: tuple[str, ...]) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("head") / "head"
    cfg = TrainConfig(target=target, out=str(out), data=code_files, seq_len=48,
                      batch_size=4, max_steps=40, lr=1e-2, warmup=0.05, draft_vocab_size=200,
                      export_dtype="float32", save_every=20, progress=False)
    trainer = Eagle3Trainer(cfg)
    rows = trainer.load_rows()
    trainer.init_draft_vocab(rows)
    ids, mask = next(D.batches(rows, 8, seed=99, epoch=0))
    with torch.no_grad():
        before, accs0 = trainer.loss(ids, mask)
    result = trainer.train(rows)
    with torch.no_grad():
        after, accs = trainer.loss(ids, mask)
    return str(out), dict(before=before.item(), after=after.item(), accs0=accs0, accs=accs,
                          result=result, cfg=cfg)


def test_few_steps_lower_the_loss(trained: tuple[str, dict]) -> None:
    _, info = trained
    assert info["result"].steps == 40
    assert info["after"] < 0.85 * info["before"], info
    # top-1 agreement with the teacher rises from chance (~1/200) at every TTT step
    assert all(a > a0 + 0.03 for a, a0 in zip(info["accs"], info["accs0"])), info
    assert len(info["result"].accuracy[-1]) == 7


def test_export_format(trained: tuple[str, dict], target: str) -> None:
    from safetensors import safe_open

    out, _ = trained
    with safe_open(f"{out}/model.safetensors", "pt") as fh:
        names = set(fh.keys())
        d2t, t2d = fh.get_tensor("d2t"), fh.get_tensor("t2d")
    assert "embed_tokens.weight" not in names
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight",
            "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"} <= names
    assert d2t.dtype == torch.int64 and d2t.shape == (200,) and t2d.shape == (512,)
    assert (torch.arange(200) + d2t).tolist() == torch.nonzero(t2d).flatten().tolist()
    cfg = json.loads(Path(out, "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and cfg["draft_vocab_size"] == 200
    assert "eagle_config" not in cfg  # default capture layers: left implicit
    assert ModelConfig.from_hf(target).num_layers == 4


@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1), dict(num_steps=3, topk=4,
                                                                   num_draft_tokens=8)])
def test_trained_head_decodes_losslessly(trained: tuple[str, dict], target: str,
                                         spec: dict) -> None:
    out, _ = trained
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", cache=dict(page_size=4, kv_cache_bytes=8 << 20))
    plain = LLM(target, **kw).generate(prompts, params)
    spec_out = LLM(target, speculative_config=dict(algorithm="eagle3", draft_model=out, **spec),
                   **kw).generate(prompts, params)
    for a, b in zip(plain, spec_out):
        assert b.token_ids == a.token_ids
        assert b.spec_cycles > 0


def test_bundled_pair_decodes_losslessly() -> None:
    from specserve import defaults

    draft = defaults.tiny_code_draft_path()
    if draft is None:
        pytest.skip("no bundled EAGLE-3 head")
    model = defaults.tiny_code_path()
    prompts = ["def fibonacci(n):\n", "import os\n\nclass Config:\n    def __init__(self"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(model, device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(model, device="cpu", dtype="float32", speculative_config=dict(
        algorithm="eagle3", draft_model=draft, num_steps=5, topk=1)).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.spec_accepted_tokens for o in spec) > 0  # the head predicts its target


def test_resume_continues_from_checkpoint(trained: tuple[str, dict], tmp_path: Path) -> None:
    import dataclasses

    out, info = trained
    (tmp_path / "head").mkdir()
    state = torch.load(f"{out}/trainer_state.pt", weights_only=True)
    assert state["step"] == 40
    torch.save(state, tmp_path / "head" / "trainer_state.pt")
    cfg = dataclasses.replace(info["cfg"], out=str(tmp_path / "head"), max_steps=44,
                              resume=True)
    result = Eagle3Trainer(cfg).train()
    assert result.steps == 44 and len(result.losses) == 4
    resumed = torch.load(tmp_path / "head" / "trainer_state.pt", weights_only=True)
    assert torch.equal(resumed["head"]["d2t"], state["head"]["d2t"])


def test_cli_rejects_bad_input(tmp_path: Path, target: str, code_files: tuple[str, ...],
                               capsys) -> None:
    from specserve.cli import main

    assert main(["train-eagle3", "--target", str(tmp_path), "--out", "x", "--data", "y"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["train-eagle3", "--target", target, "--out", str(tmp_path / "o"),
                 "--data", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train-eagle3", "--target", target, "--out", str(tmp_path / "o"),
                 "--data", *code_files, "--aux-layer-ids", "1,9,2"]) == 2
    assert "aux-layer-ids" in capsys.readouterr().err


@pytest.mark.slow
def test_recipe_end_to_end_on_toy_sizes(tmp_path: Path) -> None:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path / "pair"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_reference_pair.py"), "--out", str(out),
           "--pairs", "toy", "--source-dirs", str(stdlib / "json"), str(stdlib / "email"),
           "--vocab-size", "400", "--holdout-permille", "200", "--time-scale", "0.5",
           "--eval-prompts", "3", "--eval-prompt-tokens", "24", "--eval-max-tokens", "12",
           "--max-corpus-mb", "1", "--device", "cpu"]
    subprocess.run(cmd, check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    holdout = set((out / "holdout.txt").read_text().split())
    trained_on = [Path(f) for f in (out / "head_files.txt").read_text().split()]
    roots = [(stdlib / "json").resolve(), (stdlib / "email").resolve()]
    rel = [f.relative_to(r).as_posix() for f in trained_on for r in roots if f.is_relative_to(r)]
    assert holdout and len(rel) == len(trained_on) and not set(rel) & holdout
    results = json.loads((out / "results.json").read_text())
    rows = results["pairs"]["toy"]["eval"]["results"]
    assert {r["spec"] for r in rows} == {"chain3", "chain5", "tree4x16(d5)"}
    for r in rows:
        assert r["accept_length"] >= 1.0 and r["cycles"] > 0
        if r["temperature"] == 0:
            assert r["greedy_match"] == 3


def test_recipe_without_eval_stops_once_the_pair_is_saved(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-eval (the GPU suite trains the reference pair, then sweeps it itself): run_pair
    returns after the head, evaluate_pair never runs; with the default it does."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("recipe", ROOT / "scripts/train_reference_pair.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "recipe", recipe)  # its dataclasses look it up
    spec.loader.exec_module(recipe)
    monkeypatch.setattr(recipe, "train_target", lambda p, stream, tok, out, *a: {"steps": 1})
    monkeypatch.setattr(recipe, "train_eagle3", lambda cfg: SimpleNamespace(
        steps=1, losses=[1.0], accuracy=[[0.5]]))
    evaluated = []
    monkeypatch.setattr(recipe, "evaluate_pair", lambda out, args, holdout: evaluated.append(1)
                        or {"results": []})
    ctx = {"stream": None, "tok": None, "device": "cpu", "head_list": "x", "holdout": []}
    for flag, runs in (("--no-eval", 0), ("--eval", 1)):
        args = SimpleNamespace(out=str(tmp_path), time_scale=1.0, seed=0, device="cpu",
                               progress=False, eval=flag == "--eval")
        res = recipe.run_pair("toy", recipe.PRESETS["toy"], args, ctx)
        assert len(evaluated) == runs and ("eval" in res) == bool(runs), res


def test_ctrl_c_saves_after_the_step_and_exits_130(tmp_path: Path, target: str,
                                                  code_files: tuple[str, ...],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    import signal

    from cli_run import run_cli

    real_loss = Eagle3Trainer.loss
    calls = []

    def loss_then_ctrl_c(self, ids, mask):  # the user presses Ctrl-C during step 3
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return real_loss(self, ids, mask)

    monkeypatch.setattr(Eagle3Trainer, "loss", loss_then_ctrl_c)
    out = tmp_path / "head"
    rc, err = run_cli(["train-eagle3", "--target", target, "--out", str(out), "--data",
                       *code_files, "--seq-len", "48", "--batch-size", "2", "--max-steps", "50",
                       "--draft-vocab-size", "100", "--save-every", "0", "--no-progress"],
                      capsys)
    assert rc == 130, err
    assert len(calls) == 3  # the interrupted step finished, no further step began
    assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == 3
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_time_budget_stops_training(trained: tuple[str, dict], tmp_path: Path) -> None:
    import dataclasses

    _, info = trained
    cfg = dataclasses.replace(info["cfg"], out=str(tmp_path / "head"), max_steps=100_000,
                              time_budget=1.0, save_every=0)
    result = Eagle3Trainer(cfg).train()
    assert 0 < result.steps < 100_000 and not result.interrupted


def test_eval_accept_cli_reports_progress(trained: tuple[str, dict], target: str,
                                          code_files: tuple[str, ...],
                                          capsys: pytest.CaptureFixture) -> None:
    from cli_run import run_cli

    out, _ = trained
    rc, err = run_cli(["eval-accept", "--model", target, "--draft", out, "--files", *code_files,
                       "--num-prompts", "2", "--prompt-tokens", "16", "--max-tokens", "8",
                       "--specs", "2/1/3", "--temperatures", "0", "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "chain2 temperature 0: accept length" in err and "eval-accept" in err
