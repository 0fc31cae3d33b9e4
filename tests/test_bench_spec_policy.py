"""scripts/bench_spec_policy.py end to end on a tiny model (CPU): every config runs at every
concurrency, the report and the plot are written."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_eagle import make_tiny_pair

from specserve.bench.prompts import output_lengths

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("m"), max_position_embeddings=512)


@pytest.mark.slow
def test_policy_sweep_script_runs(tmp_path: Path, pair: tuple[str, str]) -> None:
    target, head = pair
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_spec_policy.py"),
        "--model",
        target,
        "--load-format",
        "auto",
        "--draft-model",
        head,
        "--device",
        "cpu",
        "--concurrency",
        "1,4",
        "--modes",
        "chain2,chain1",
        "--accept-rate",
        "0.5,0.2",  # two rates, one engine
        "--prompt-len",
        "8",
        "--output-len",
        "6",
        "--requests-per-slot",
        "2",
        "--min-requests",
        "2",
        "--repeats",
        "2",
        "--out",
        str(out),
        "--trace",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    low = json.loads((out / "rate-0.2" / "spec_policy.json").read_text())
    report = json.loads((out / "rate-0.5" / "spec_policy.json").read_text())
    assert (report["accept_rate"], low["accept_rate"]) == (0.5, 0.2)
    assert proc.stdout.count("adaptive / best config >=") == 2
    assert [p["concurrency"] for p in report["points"]] == [1, 4]
    for point in report["points"]:
        for name in ("plain", "forced-off", "chain2", "chain1", "adaptive"):
            assert [r["tokens"] for r in point[name]["runs"]] == [point["requests"] * 6] * 2
        assert point["chain2"]["mode_steps"].get("chain2", 0) > 0
        assert set(point["forced-off"]["mode_steps"]) == {"off"}
        assert "off" in point["plain"]["mode_steps"] or not point["plain"]["mode_steps"]
    assert set(report["cost_table_ms"]) == {"off", "chain2", "chain1"}
    # and what a prefill chunk adds to each kind's step (two chunk sizes each)
    mixed = report["mixed_table_ms"]
    assert set(mixed) == {"off", "chain2", "chain1"}
    assert all(len(row) == 2 and min(row.values()) >= 0 for row in mixed.values())
    assert "extra ms of a prefill chunk" in proc.stdout
    # each decode kind's measured time printed with the table's at its mean decode rows
    assert "cost table (ms):" in proc.stdout
    assert re.search(r"chain2 [\d.]+ ms x\d+ @\d+ \(table [\d.]+\)", proc.stdout)
    assert 0 < report["cost_table_s"] < report["startup_s"]
    assert proc.stdout.count("the cost table's part") == 2
    # one adaptive policy for the sweep (a server's): its step count runs on across runs,
    # the untimed run before the first timed one included
    assert report["policy"] == "server"
    runs = [r for p in report["points"] for r in p["adaptive"]["runs"]]
    counts = [r["learnt"]["steps"] for r in runs]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert counts[0] > sum(runs[0]["mode_steps"].values())
    # the engine told it each step's chunk tokens: prompt tokens per emitted token (8-token
    # prompts, 6 tokens out; a line per kind of mixed step it saw, if any)
    assert 0.5 < runs[-1]["learnt"]["rho"] < 3
    assert isinstance(runs[-1]["learnt"]["chunk_lines"], dict)
    assert "chunk tokens per emitted" in proc.stdout
    assert (out / "rate-0.5" / "spec_policy.png").stat().st_size > 0
    # --trace: each adaptive run's decisions (with the scores where it scored) and its
    # observed steps, as many as the run's steps
    trace = [json.loads(line) for line in
             (out / "rate-0.5" / "trace-c4-2.jsonl").read_text().splitlines()]
    chosen = [r for r in trace if "mode" in r]
    observed = [r for r in trace if "observed" in r]
    assert chosen and any("scores" in r for r in chosen)
    scored = next(r for r in chosen if "scores" in r)  # with what the scores were made of
    assert set(scored["E"]) == set(scored["scores"]) == set(scored["rows"])
    assert scored["E"]["off"] == 1.0 and scored["E"]["chain2"] >= 1.0
    assert {"off", "chain2", "chain1"} >= {m for r in chosen for m in r.get("scores", {})}
    last = report["points"][-1]["adaptive"]["runs"][-1]
    assert len(observed) == sum(last["mode_steps"].values())
    # after each observed step, the engine's record of it: positions caught up (all of the
    # run's, summed), whether its cycle was launched ahead
    engine = [r["engine"] for r in trace if "engine" in r]
    assert len(engine) == len(observed)
    assert sum(e["caught_up"] for e in engine) == last["catch_up_tokens"]
    assert all(e["ahead"] in (0, 1) for e in engine)


@pytest.mark.slow
def test_policy_sweep_real_acceptance_and_emulated_comm(tmp_path: Path,
                                                        pair: tuple[str, str]) -> None:
    """--accept-rate 0 keeps the head's own acceptance over text prompts (--prompts),
    --emulate-comm reaches the engine (the report names the table), and with
    --output-len-spread each request makes its own number of tokens."""
    target, head = pair
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_spec_policy.py"), "--model", target,
           "--load-format", "auto", "--draft-model", head, "--device", "cpu", "--concurrency",
           "2", "--modes", "chain2", "--accept-rate", "0", "--prompts", "code", "--prompt-len",
           "12", "--output-len", "5", "--min-requests", "2", "--emulate-comm", "pcie-nccl-8gpu",
           "--policy", "fresh", "--output-len-spread", "0.5", "--chunks-in-verify", "never",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "spec_policy.json").read_text())
    assert report["prompts"] == "code" and report["accept_rate"] == 0
    assert report["emulate_comm"]["emulate_comm"] == "pcie-nccl-8gpu"
    (point,) = report["points"]
    lens = output_lengths(point["requests"], 5, 0.5)
    assert len(set(lens)) > 1 and report["output_len_spread"] == 0.5
    assert [r["tokens"] for r in point["chain2"]["runs"]] == [sum(lens)] * 2
    # --chunks-in-verify never: no prefill chunk rode in a verify forward
    assert report["chunks_in_verify"] == "never"
    assert all(r["chunks_in_verify"] == 0 for m in ("chain2", "adaptive")
               for r in point[m]["runs"])
    # --policy fresh: every run's policy starts anew (its steps are that run's only)
    assert report["policy"] == "fresh"
    for r in point["adaptive"]["runs"]:
        assert 0 < r["learnt"]["steps"] <= sum(r["mode_steps"].values())


@pytest.mark.parametrize("flags,message", [
    (["--accept-rate", "1.5"], "--accept-rate must be in [0, 1)"),
    (["--accept-rate", "0.5,0"], "--accept-rate must be in [0, 1)"),
    (["--accept-rate", "0.5,x"], "--accept-rate: numbers in [0, 1)"),
    (["--emulate-comm", "no-such-table"], "--emulate-comm:"),
    (["--prompts", "no-such-set"], "--prompts: unknown prompt set"),
])  # fmt: skip
def test_policy_sweep_refuses_bad_flags_before_loading(
    tmp_path: Path, flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """In process (argparse exits 2 before any model loads: LLM is never reached)."""
    spec = importlib.util.spec_from_file_location("bench_spec_policy",
                                                  ROOT / "scripts" / "bench_spec_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LLM", None)  # a call would raise TypeError, not exit 2
    monkeypatch.setattr(sys, "argv", ["bench_spec_policy.py", "--out", str(tmp_path), *flags])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--requests-per-slot", "0"], "--requests-per-slot and --min-requests must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--output-len-spread", "1"], "--output-len-spread must be in [0, 1)"),
])
def test_bad_counts_exit_2_before_loading(tmp_path: Path, flags: list[str], says: str) -> None:
    script = ROOT / "scripts" / "bench_spec_policy.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-500:]
