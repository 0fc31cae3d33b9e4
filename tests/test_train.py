"""train-eagle3: draft vocabulary, chat loss masks, training head == inference head (every TTT
step against the engine's drafting positions), loss goes down, the export decodes losslessly,
resume, the CLI, and the reference-pair recipe end to end on toy sizes."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model
from tiny_tokenizer import make_tiny_tokenizer

from specserve.config import ModelConfig
from specserve.kv_cache.pool import KVPool
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.backends.torch_ref import TorchRefBackend
from specserve.llm import LLM
from specserve.models.eagle3 import load_eagle3_head
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.train import data as D
from specserve.train.config import TrainConfig
from specserve.train.eagle3 import Eagle3Trainer
from specserve.train.head import Eagle3TrainHead, draft_vocab_from_counts, export_head
from specserve.worker.forward_batch import build_attention_metadata

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on 2 shared cores run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama whose teacher is peaked (scaled lm_head), so a head can learn it."""
    path = tmp_path_factory.mktemp("train") / "target"
    model = make_hf_model("llama", seed=3, vocab_size=512, num_hidden_layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    make_tiny_tokenizer(str(path), vocab_size=512)
    return str(path)


def _write_corpus(root: Path, seed: int = 0, num_files: int = 4) -> tuple[str, ...]:
    """Python-like files from templates: fixed text (not the repository's own sources, which
    change), regular enough that a few training steps learn something."""
    rng = random.Random(seed)
    names = ["value", "count", "items", "total", "index", "result", "buffer", "offset", "size"]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(num_files):
        lines = [f'"""Module {f}."""', "", "import math", ""]
        for i in range(40):
            a, b = rng.sample(names, 2)
            op = rng.choice(["+", "-", "*"])
            lines += [f"def {a}_{b}_{i}({b}, {a}=None):", f"    if {a} is None:",
                      f"        {a} = {b} {op} {rng.randint(0, 9)}",
                      f"    return math.floor({a}) {op} {b}", ""]
        path = root / f"module_{f}.py"
        path.write_text("\n".join(lines))
        files.append(str(path))
    return tuple(files)


@pytest.fixture(scope="module")
def code_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


# -- draft vocabulary and data ---------------------------------------------------------------------


def test_draft_vocab_matches_naive_frequency_table() -> None:
    rng = random.Random(0)
    vocab, vd = 50, 12
    samples = []
    for _ in range(6):
        ids = [rng.choice([1, 2, 3, 5, 8, 13, 21, 34] + list(range(vocab))) for _ in range(40)]
        mask = [rng.random() < 0.7 for _ in ids]
        samples.append(D.Sample(torch.tensor(ids), torch.tensor(mask)))
    counter = collections.Counter(i for s in samples for i, m in
                                  zip(s.input_ids.tolist(), s.loss_mask.tolist()) if m)
    counts = D.token_counts(samples, vocab)
    assert counts.tolist() == [counter[i] for i in range(vocab)]
    chosen = sorted(sorted(range(vocab), key=lambda i: (-counter[i], i))[:vd])
    d2t, t2d = draft_vocab_from_counts(counts, vd)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert [i + int(d2t[i]) for i in range(vd)] == chosen  # target_id = i + d2t[i]
    assert t2d.tolist() == [i in chosen for i in range(vocab)]
    with pytest.raises(ValueError, match="draft-vocab-size"):
        draft_vocab_from_counts(counts, vocab + 1)


def test_chat_loss_mask_covers_assistant_turns_only(tmp_path: Path, target: str) -> None:
    from transformers import AutoTokenizer

    chat = {"messages": [{"role": "user", "content": "add two numbers"},
                         {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                         {"role": "user", "content": "and print"},
                         {"role": "assistant", "content": "print(add(1, 2))"}]}
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps(chat) + "\n" + json.dumps({"text": "x = 1\n"}) + "\n")
    records = D.read_records([str(file)])
    tok = AutoTokenizer.from_pretrained(target)
    chat_sample, text_sample = D.tokenize_records(tok, records)
    ids, mask = chat_sample.input_ids.tolist(), chat_sample.loss_mask.tolist()
    # contiguous masked runs, decoded, are exactly each reply plus its end-of-turn marks
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    got = [tok.decode(r, skip_special_tokens=False) for r in runs]
    assert got == [m["content"] + "<|eos|>\n" for m in chat["messages"][1::2]]
    assert text_sample.loss_mask.all() and text_sample.input_ids[0] == tok.bos_token_id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        D.read_records([str(bad)])


def test_regenerated_text_is_the_targets_greedy_continuation(target: str,
                                                            code_files: tuple[str, ...]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    records = [D.Record(text=open(f).read()) for f in code_files[:2]]
    llm = LLM(target, device="cpu", dtype="float32")
    samples = D.regenerate(records, llm, tok, seq_len=24, prompt_tokens=8, temperature=0.0,
                           max_samples=3)
    assert len(samples) == 3
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    for s in samples:
        prompt = s.input_ids[:8]
        assert not s.loss_mask[:8].any() and s.loss_mask[8:].all()
        ref = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                          attention_mask=torch.ones(1, 8, dtype=torch.long))[0, 8:].tolist()
        gen = s.input_ids[8:].tolist()
        assert gen == ref[:len(gen)] and (len(gen) == 16 or ref[len(gen) - 1] in
                                          llm.tokenizer.eos_token_ids)


# -- the training head against the inference head -----------------------------------------------


def _random_head(target: str, vd: int, seed: int) -> tuple[Eagle3TrainHead, ModelConfig]:
    from transformers import AutoModelForCausalLM

    tcfg = ModelConfig.from_hf(target)
    hf = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(seed)
    cfg = TrainConfig(draft_vocab_size=vd).head_config(tcfg, (1, 2, 3))
    head = Eagle3TrainHead(cfg, tcfg.hidden_size, hf.get_input_embeddings().weight)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    counts = torch.randint(0, 100, (tcfg.vocab_size,))
    head.set_draft_vocab(*draft_vocab_from_counts(counts, vd))
    return head, tcfg


def test_ttt_steps_equal_inference_drafting(tmp_path: Path, target: str) -> None:
    """Step 0 == the head's extend over real features; TTT step s at index P-1 == chain draft
    step s after a prefix of P positions (RoPE P+s-1, sees the prefix and its own chain)."""
    head, tcfg = _random_head(target, vd=96, seed=1)
    export_head(head, str(tmp_path / "head"), "float32", tcfg.num_layers)
    model = load_model(tcfg, target, torch.float32, "cpu")
    infer = load_eagle3_head(str(tmp_path / "head"), model, tcfg, 0, torch.float32,
                             torch.device("cpu"))
    assert infer.config.aux_layer_ids == (1, 2, 3)
    assert torch.equal(infer.d2t, head.d2t)
    page_size, num_pages = 4, 24
    pool = KVPool([infer.midlayer.attn.kv_spec], num_pages, page_size, torch.float32, "cpu")
    pool.bind([infer.midlayer.attn])
    pages = list(range(num_pages))
    random.Random(0).shuffle(pages)

    def draft(ids: list[int], pos: list[int], g: torch.Tensor, seq_len: int) -> torch.Tensor:
        md = build_attention_metadata([len(ids)], [seq_len], [pages], page_size, "cpu")
        set_forward_context(ForwardContext(md, TorchRefBackend()))
        try:
            return infer(torch.tensor(ids), torch.tensor(pos), g)
        finally:
            set_forward_context(None)

    seq, steps = 30, 4
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, tcfg.vocab_size, (seq,), generator=gen)
    feats = torch.randn(seq, 3 * tcfg.hidden_size, generator=gen)
    # training: index t pairs feature t with token t+1 (L = seq - 1 indices)
    outs, cache, g = [], None, feats[None, :-1]
    with torch.no_grad():
        for s in range(steps + 1):
            ids = torch.cat([tokens[1 + s:], torch.zeros(s, dtype=torch.long)])[None]
            g, cache = head.step(ids, g, s, cache)
            outs.append((g[0], head.logits(g)[0]))
        L = seq - 1
        ext = draft(tokens[1:].tolist(), list(range(L)), feats[:L], L)
        torch.testing.assert_close(ext, outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(infer.compute_logits(ext), outs[0][1], rtol=1e-4, atol=1e-4)
        for prefix in (1, 6, L - steps):
            t = prefix - 1
            y = draft(tokens[1:prefix + 1].tolist(), list(range(prefix)), feats[:prefix],
                      prefix)[-1:]
            for s in range(1, steps + 1):  # chain step s: token t+1+s at RoPE position t+s
                y = draft([int(tokens[t + 1 + s])], [t + s], y, prefix + s)
                torch.testing.assert_close(y[0], outs[s][0][t], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(infer.compute_logits(y)[0], outs[s][1][t],
                                           rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_head_parameter_gets_a_gradient(target: str, device: str) -> None:
    """On CUDA the inference layers dispatch to fused kernels without a backward; the training
    head must not use them, or everything below the final norm silently stops learning."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    head, tcfg = _random_head(target, vd=64, seed=4)
    head = head.to(device)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(4, tcfg.vocab_size, (2, 12), generator=gen).to(device)
    g = torch.randn(2, 12, 3 * tcfg.hidden_size, generator=gen).to(device)
    cache, loss = None, torch.zeros((), device=device)
    for s in range(3):
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
            g, cache = head.step(ids, g, s, cache)
            loss = loss + head.logits(g).logsumexp(-1).mean()
    loss.backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


# -- training --------------------------------------------------------------------------------------


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
