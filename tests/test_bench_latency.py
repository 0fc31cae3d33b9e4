"""`specserve bench latency` on the CPU with the tiny preset, and the floor/peer helpers."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest
from cli_run import run_cli
from tiny_models import make_tiny_checkpoint

from specserve.bench import floor, hf_peer, latency
from specserve.bench.log import read_results
from specserve.models import presets

SYNTHETIC_AL = 3  # forced accept length: 2 drafts + the bonus token per cycle
OUTPUT_LEN = 7


def _parse(argv: list[str]) -> argparse.Namespace:
    from specserve.cli import build_parser

    return build_parser().parse_args(["bench", "latency", "--no-progress", *argv])


def _tiny_args(tmp_path, *extra: str) -> list[str]:
    return ["--model", "tiny-llama", "--device", "cpu", "--batch-sizes", "1,3",
            "--context-len", "24", "--output-len", str(OUTPUT_LEN), "--runs", "2",
            "--warmup", "1", "--exp-dir", str(tmp_path / "exp"), *extra]


@pytest.fixture(scope="module")
def engine():
    from specserve.llm import LLM

    llm = LLM("tiny-llama", load_format="dummy", device="cpu",
              speculative_config=dict(algorithm="eagle3", draft_model="dummy"))
    yield llm.engine  # the LLM owns the engine: keep it alive while the tests use it
    llm.close()


def _check_summary(s: dict, n: int) -> None:
    assert s["n"] == n
    assert 0 < s["min"] <= s["mean"] <= s["max"]
    assert s["ci95_low"] <= s["mean"] <= s["ci95_high"]
    assert s["stdev"] >= 0 and math.isfinite(s["stdev"])


def test_bench_latency_cli_log_json_png(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    args = _parse(_tiny_args(
        tmp_path, "--spec-algorithm", "eagle3", "--spec-draft-model", "dummy",
        "--spec-synthetic-accept-len", str(SYNTHETIC_AL), "--floor", "--compare-hf", "--log",
        "--label", "cpu smoke", "--json-out", str(out_json)))
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "synthetic acceptance (cost-only)" in table and "transformers" in table
    report = json.loads(out_json.read_text())
    assert report["acceptance"] == latency.SYNTHETIC and report["startup_s"] > 0
    assert [(p["batch_size"], p["context_len"]) for p in report["points"]] == [(1, 24), (3, 24)]
    for p in report["points"]:
        bs = p["batch_size"]
        base, spec = p["modes"]["baseline"], p["modes"]["eagle3"]
        for r in (base, spec):
            _check_summary(r["tok_s"], 2)
            _check_summary(r["ms_per_step"], 2)
        for run in base["runs"]:  # plain decode: one token per request per step, full batch
            assert run["steps"] == OUTPUT_LEN and run["tokens"] == bs * OUTPUT_LEN
            assert run["tok_s"] == pytest.approx(run["tokens"] / run["decode_s"])
            assert run["ms_per_step"] == pytest.approx(run["decode_s"] * 1e3 / run["steps"])
        for run in spec["runs"]:  # ceil(7 / 3) cycles of 3 tokens; the last may overshoot
            assert run["steps"] == math.ceil(OUTPUT_LEN / SYNTHETIC_AL)
            assert run["tokens"] == bs * run["steps"] * SYNTHETIC_AL
            assert run["drafts"] == bs * run["steps"]
        assert spec["accept_length"]["mean"] == pytest.approx(SYNTHETIC_AL)
        assert spec["acceptance_per_pos"] == pytest.approx([1.0, 1.0, 0.0])
        eff = spec["tok_s"]["mean"] / (SYNTHETIC_AL * base["tok_s"]["mean"])
        assert p["efficiency"] == pytest.approx(eff)
        floor_pt = next(f for f in report["floor"]["points"] if f["batch_size"] == bs)
        assert p["floor_ratio"] == pytest.approx(floor_pt["ms"] / base["ms_per_step"]["mean"])
        # roofline: tiny-llama in fp32 on the CPU, by hand from its config.json shape
        roof, shape = p["roofline"], presets.PRESETS["tiny-llama"]
        context = 24 + OUTPUT_LEN / 2
        kv = bs * context * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
            shape["hidden_size"] // shape["num_attention_heads"]) * 4
        assert roof["kv_bytes"] == pytest.approx(kv) and roof["context"] == context
        assert roof["weight_bytes"] == floor_pt["weight_bytes"]
        mem_ms = (roof["weight_bytes"] + kv) / (report["copy"]["bandwidth_gbs"] * 1e9) * 1e3
        assert roof["memory_ms"] == pytest.approx(mem_ms)
        assert roof["compute_ms"] == pytest.approx(
            roof["flops"] / (report["peak"]["tflops"] * 1e12) * 1e3)
        assert roof["ms"] == max(roof["memory_ms"], roof["compute_ms"])
        assert p["roofline_ratio"] == pytest.approx(roof["ms"] / base["ms_per_step"]["mean"])
    assert report["copy"]["bandwidth_gbs"] > 0
    # the verify pass's floor: every node of every request as a row; a dense model streams
    # the decode step's weights (a MoE one the experts the nodes touch: test_deepseek_engine)
    vf, nodes = report["verify_floor"], report["config"]["spec"]["num_steps"] + 1
    assert vf["nodes"] == nodes
    for p, f in zip(report["points"], vf["points"]):
        decode = next(d for d in report["floor"]["points"] if d["batch_size"] == p["batch_size"])
        assert (f["batch_size"], f["rows"]) == (p["batch_size"], p["batch_size"] * nodes)
        assert f["weight_bytes"] == decode["weight_bytes"] and p["verify_floor_ms"] == f["ms"]
        assert f"verify floor bs {p['batch_size']} ({nodes} nodes a request" in table
    hf = report["hf"]
    _check_summary(hf["tok_s"], 2)
    assert report["points"][0]["hf_speedup"]["baseline"] == pytest.approx(
        report["points"][0]["modes"]["baseline"]["tok_s"]["mean"] / hf["tok_s"]["mean"])

    # scripts/plot_roofline.py over this report: one row per plain point, its ratio, a PNG
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "plot_roofline.py"
    spec = importlib.util.spec_from_file_location("plot_roofline", script)
    plot_roofline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_roofline)
    png = tmp_path / "roofline.png"
    assert plot_roofline.main([str(out_json), "--out", str(png), "--goal", "0.9"]) == 0
    assert [(r["batch"], r["ratio"]) for r in plot_roofline.roofline_rows([report])] == [
        (p["batch_size"], p["roofline_ratio"]) for p in report["points"]]
    assert png.read_bytes()[:4] == b"\x89PNG"
    exp = tmp_path / "exp"
    rows = [r for r in (exp / "LOG.md").read_text().splitlines() if "| latency |" in r]
    assert len(rows) == 4  # (baseline, eagle3) x (bs 1, bs 3)
    assert sum("roofline/step" in r and "-bound" in r for r in rows) == 2  # baseline rows
    assert "roofline ctx 24 bs 3" in table and "matmul peak" in table
    assert sum("synthetic acceptance (cost-only)" in r for r in rows) == 2
    records = read_results(str(exp))
    assert [(r["mode"], r["point"]["batch_size"]) for r in records] == [
        ("baseline", 1), ("eagle3", 1), ("baseline", 3), ("eagle3", 3)]
    assert records[0]["git_sha"] and records[0]["config"]["spec"]["synthetic_accept_len"] == 3
    pngs = sorted(p.name for p in exp.glob("*.png"))
    assert pngs == ["cpu-smoke-ctx24-bs1.png", "cpu-smoke-ctx24-bs3.png"]
    assert all((exp / n).read_bytes()[:4] == b"\x89PNG" for n in pngs)


def test_bench_latency_baseline_only_skips_floor_and_hf_with_reason(tmp_path, capsys):
    args = _parse(_tiny_args(tmp_path, "--runs", "1", "--batch-sizes", "2",
                             "--json-out", str(tmp_path / "r.json")))
    assert args.func(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["points"][0]["modes"]) == ["baseline"]
    assert "without CUDA" in report["floor"]["skipped"] and "skipped" in report["hf"]
    assert "floor: skipped" in capsys.readouterr().out
    assert not (tmp_path / "exp").exists()  # no --log: nothing written


def test_bench_latency_exact_reports_cost_against_default(tmp_path, capsys):
    args = _parse(_tiny_args(tmp_path, "--runs", "1", "--batch-sizes", "1,2", "--exact",
                             "--json-out", str(tmp_path / "r.json")))
    assert args.func(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["exact"] is True
    rows = report["exact_cost"]
    assert [(r["batch_size"], r["mode"]) for r in rows] == [(1, "baseline"), (2, "baseline")]
    for r in rows:
        assert r["exact_tok_s"] > 0 and r["default_tok_s"] > 0
        assert r["cost"] == pytest.approx(r["default_tok_s"] / r["exact_tok_s"] - 1)
    assert "exact mode vs default" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--context-len", "a,b"], "--context-len"),
    (["--output-len", "1"], "--output-len"),
    (["--batch-sizes", "300"], "--max-num-seqs"),
    (["--context-len", "4000"], "--max-model-len"),
    (["--no-baseline"], "nothing to time"),
    (["--kv-cache-bytes", "100000"], "does not fit the KV cache"),
])
def test_bench_latency_bad_flags(tmp_path, argv, message, capsys):
    rc, err = run_cli(["bench", "latency", "--no-progress", *_tiny_args(tmp_path, *argv)], capsys)
    assert rc == 2 and message in err and "Traceback" not in err


def test_floor_weights_are_the_models_linear_weights(engine):
    model, cfg = engine.runner.model, engine.model_config
    weights = floor.floor_weights(model)
    hd, inter, h = cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    per_layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd),
                 (2 * inter, h), (h, inter)]
    assert [tuple(w.shape) for w in weights] == per_layer * cfg.num_layers + [
        (cfg.vocab_size, h)]
    params = {p.data_ptr() for p in model.parameters()}
    assert all(w.data_ptr() in params for w in weights)  # the module's tensors, not copies
    points = floor.measure_floor(model, [1, 4], replays=5, warmup=1)
    nbytes = 4 * sum(a * b for a, b in per_layer * cfg.num_layers + [(cfg.vocab_size, h)])
    for p in points:
        assert p.weight_bytes == nbytes and not p.graphed and p.ms > 0
        assert p.bandwidth_gbs == pytest.approx(nbytes / (p.ms * 1e-3) / 1e9)


def test_copy_bandwidth_counts_read_and_write(engine):
    c = floor.measure_copy_bandwidth(engine.runner.device, nbytes=1 << 20, repeats=3)
    assert c.nbytes == 1 << 20 and c.ms > 0
    assert c.bandwidth_gbs == pytest.approx(2 * c.nbytes / (c.ms * 1e-3) / 1e9)


def _greedy(engine, prompt: list[int], n: int) -> list[int]:
    from specserve.sampling_params import SamplingParams

    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                          ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens.extend(out.new_token_ids)
    return tokens


def test_hf_peer_shares_weights_and_matches_greedy_tokens(engine):
    peer = hf_peer.hf_peer_model(engine)
    ours = {p.data_ptr() for p in engine.runner.model.parameters()}
    # every peer weight lies inside one of our tensors' storage (views: no second copy)
    storages = {p.untyped_storage().data_ptr() for p in engine.runner.model.parameters()}
    assert all(p.untyped_storage().data_ptr() in storages for p in peer.parameters())
    assert any(p.data_ptr() not in ours for p in peer.parameters())  # q/k/v, gate/up slices
    prompt = [random.Random(5).randrange(engine.model_config.vocab_size) for _ in range(20)]
    hf = hf_peer.measure_hf_generate(peer, prompt, 10, runs=1, warmup=0)
    engine.set_speculation(False)
    assert hf.token_ids == _greedy(engine, prompt, 10)
    assert len(hf.tok_s) == 1 and hf.tok_s[0] > 0


def test_hf_peer_of_a_checkpoint_with_qkv_bias(tmp_path):
    from specserve.llm import LLM

    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", seed=4)
    llm = LLM(path, device="cpu")
    eng = llm.engine
    peer = hf_peer.hf_peer_model(eng)
    prompt = [random.Random(6).randrange(eng.model_config.vocab_size) for _ in range(16)]
    hf = hf_peer.measure_hf_generate(peer, prompt, 8, runs=1, warmup=0)
    assert hf.token_ids == _greedy(eng, prompt, 8)


def test_make_prompts_random_ids_are_reproducible(engine):
    a = latency.make_prompts(engine, None, 3, 17, seed=1)
    assert a == latency.make_prompts(engine, None, 3, 17, seed=1)
    assert len(a) == 3 and all(len(p) == 17 for p in a) and a[0] != a[1]
    assert all(0 <= t < engine.model_config.vocab_size for p in a for t in p)
    with pytest.raises(ValueError, match="tokenizer"):
        latency.make_prompts(engine, "code", 1, 8, seed=0)


@pytest.mark.parametrize("spec", [False, True])
def test_run_once_times_full_batch_and_frees_kv(engine, spec):
    engine.set_speculation(spec)
    prompts = latency.make_prompts(engine, None, 2, 40, seed=3)
    free = engine.allocator.num_free
    run = latency.run_once(engine, prompts, 5, spec)
    assert not engine.has_unfinished() and engine.allocator.num_free == free
    assert run.tokens >= 2 * 5 and run.steps >= 1 and run.decode_s > 0
    if spec:  # real verification with a random head: each cycle emits 1 .. num_steps+1 tokens
        assert run.drafts == 2 * run.steps and run.tokens == run.accepted + run.drafts
        assert sum(run.accepted_per_pos) == run.accepted
        assert 1.0 <= run.accept_length <= engine.config.spec.num_steps + 1
    else:
        assert (run.steps, run.tokens, run.drafts) == (5, 10, 0)


def test_make_prompts_from_a_prompt_set_cycles_and_cuts():
    from types import SimpleNamespace

    from specserve.bench.prompts import load_prompts

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    fake = SimpleNamespace(tokenizer=SimpleNamespace(encode=encode))
    texts = [p.as_text() for p in load_prompts("code")]
    for j, got in enumerate(latency.make_prompts(fake, "code", 20, 150, seed=0)):
        want: list[int] = []
        k = j
        while len(want) < 150:  # naive: the set's prompts from the j-th on, cycling
            want += encode(texts[k % len(texts)])
            k += 1
        assert got == want[:150]


def test_bench_latency_shows_progress_per_point(tmp_path, capsys):
    argv = ["--model", "tiny-llama", "--device", "cpu", "--batch-sizes", "1,2",
            "--context-len", "16", "--output-len", "4", "--runs", "1", "--warmup", "0",
            "--spec-draft-model", "dummy"]
    rc, err = run_cli(["bench", "latency", *argv], capsys)
    assert rc == 0, err
    assert "bench latency" in err and "4/4" in err  # the bar: 2 points x 2 modes x 1 run
    for bs in (1, 2):
        assert f"ctx 16 bs {bs}: baseline " in err and "tok/s, eagle3 " in err


def test_planned_capacity_is_the_engines(engine):
    # the pre-build estimate (model config only) against the built engine's KV pool
    from specserve.config import engine_config

    config = engine_config(model="tiny-llama", load_format="dummy", device="cpu",
                           spec=engine.config.spec)
    assert latency.planned_capacity(config) == (
        engine.max_model_len, engine.stats()["kv_token_capacity"])
    plain = engine_config(model="tiny-llama", load_format="dummy", device="cpu",
                          kv_cache_bytes=1 << 20)
    per_token = 2 * 4 * 2 * 16 * 4  # K and V x 4 layers x 2 kv heads x head_dim 16 x fp32
    assert latency.planned_capacity(plain)[1] == (1 << 20) // (per_token * 16) * 16


def test_bench_latency_names_the_speculative_method(tmp_path, capsys):
    """The speculative mode is reported under its method's name (here the n-gram drafter, on
    random weights with a forced accept length)."""
    out_json = tmp_path / "ngram.json"
    args = _parse(["--model", "tiny-llama", "--device", "cpu", "--batch-sizes", "1",
                   "--context-len", "24", "--output-len", "4", "--runs", "1", "--warmup", "0",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                   "--spec-synthetic-accept-len", "2", "--json-out", str(out_json)])
    assert args.func(args) == 0
    assert " ngram " in capsys.readouterr().out
    (point,) = json.loads(out_json.read_text())["points"]
    assert set(point["modes"]) == {"baseline", "ngram"}
    assert point["modes"]["ngram"]["accept_length"]["mean"] == 2


def test_bench_latency_leaves_room_for_decodes_while_the_batch_prefills(tmp_path, capsys):
    """A batch whose prompts take many steps of the token budget decodes its first requests
    meanwhile: the point check asks for that room up front (naming the context length that
    holds it), and at exactly that length the timed runs finish without a request hitting it
    (on an 8k x 64 point the check passed and the run failed after the prefill)."""
    from specserve.config import engine_config

    ctx, bs, budget = 24, 4, 32
    config = engine_config(model="tiny-llama", load_format="dummy", device="cpu",
                           max_num_batched_tokens=budget)
    need = ctx + latency.max_new_tokens(config, bs * ctx, OUTPUT_LEN, False) + 1
    assert need > ctx + OUTPUT_LEN + 4 + 2 * 4  # more than the old estimate's room
    argv = ["bench", "latency", "--no-progress", *_tiny_args(
        tmp_path, "--batch-sizes", str(bs), "--context-len", str(ctx), "--runs", "1",
        "--max-num-batched-tokens", str(budget))]
    rc, err = run_cli([*argv, "--max-model-len", str(need - 1)], capsys)
    assert rc == 2 and f"--max-model-len to at least {need}" in err, err[-400:]
    rc, err = run_cli([*argv, "--max-model-len", str(need)], capsys)
    assert rc == 0, err[-400:]
