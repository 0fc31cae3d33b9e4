"""Benchmark statistics, experiment log, plots and prompt sets."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess

import pytest

from specserve.bench import log, plots, prompts, stats

# t_{0.975, df} from printed tables (independent of the implementation's table)
T_TABLE = {
    1: 12.706,
    2: 4.303,
    4: 2.776,
    9: 2.262,
    19: 2.093,
    29: 2.045,
    40: 2.021,
    60: 2.000,
    120: 1.980,
    10**6: 1.960,
}


@pytest.mark.parametrize("df,expected", sorted(T_TABLE.items()))
def test_t_quantile_matches_tables(df: int, expected: float) -> None:
    assert stats.t_quantile_975(df) == pytest.approx(expected, abs=1.5e-3)


def test_summarize_against_statistics_module() -> None:
    rng = random.Random(0)
    vals = [rng.uniform(100, 130) for _ in range(10)]
    s = stats.summarize(vals)
    mean, sd = statistics.fmean(vals), statistics.stdev(vals)
    half = 2.262 * sd / math.sqrt(10)  # t_{0.975, 9}
    assert (s.n, s.min, s.max) == (10, min(vals), max(vals))
    assert s.mean == pytest.approx(mean) and s.stdev == pytest.approx(sd)
    assert s.ci95_low == pytest.approx(mean - half, rel=1e-4)
    assert s.ci95_high == pytest.approx(mean + half, rel=1e-4)


def test_summarize_by_hand_and_edges() -> None:
    # [1, 2, 3, 4]: mean 2.5, sample variance 5/3
    s = stats.summarize([4.0, 1.0, 3.0, 2.0])
    assert s.mean == 2.5 and s.stdev == pytest.approx(math.sqrt(5 / 3))
    assert s.ci95_high - s.mean == pytest.approx(3.1824 * math.sqrt(5 / 3) / 2)
    one = stats.summarize([7.0])
    assert one.mean == 7.0 and math.isnan(one.stdev) and math.isnan(one.ci95_low)
    assert one.format() == "7.0"
    with pytest.raises(ValueError, match="empty"):
        stats.summarize([])
    with pytest.raises(ValueError, match="NaN"):
        stats.summarize([1.0, float("nan")])


def test_percentiles_match_statistics_quantiles() -> None:
    rng = random.Random(1)
    vals = [rng.expovariate(1.0) for _ in range(37)]
    # statistics.quantiles(method="inclusive") uses the same (n - 1) * q interpolation
    ref = statistics.quantiles(vals, n=100, method="inclusive")
    for q in (1, 50, 90, 99):
        assert stats.percentile(vals, q) == pytest.approx(ref[q - 1])
    assert stats.percentile(vals, 0) == min(vals) and stats.percentile(vals, 100) == max(vals)
    p = stats.percentiles(vals)
    assert set(p) == {"mean", "p50", "p90", "p99"} and p["p50"] == pytest.approx(ref[49])
    assert math.isnan(stats.percentiles([])["p99"])
    assert stats.percentile([5.0, 1.0], 50) == 3.0
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        stats.percentile(vals, 101)


def test_formatting() -> None:
    assert stats.format_range(123.44, 120.06, 125.0) == "123.4 (120.1-125.0)"
    s = stats.summarize([120.1, 125.0, 125.1])
    assert s.format() == "123.4 (120.1-125.1)"
    assert s.format(spread="ci").startswith("123.4 (")
    assert stats.relative_change(110.0, 100.0) == "+10.0%"
    assert stats.relative_change(90.0, 100.0) == "-10.0%"
    assert stats.relative_change(1.0, 0.0) == "n/a"


def test_environment_info_outside_and_inside_git(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPECSERVE_GIT_SHA", raising=False)
    info = log.environment_info(str(tmp_path))
    assert info["git_sha"] == "unknown" and info["git_dirty"] is None
    monkeypatch.setenv("SPECSERVE_GIT_SHA", "abc123")  # an exported tree names its commit
    info = log.environment_info(str(tmp_path))
    assert info["git_sha"] == "abc123" and info["git_dirty"] is None
    monkeypatch.delenv("SPECSERVE_GIT_SHA")
    assert info["versions"]["python"].count(".") == 2
    assert info["gpu"]  # "cpu" here, a GPU name on a GPU machine
    assert info["date"].endswith("Z")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    info = log.environment_info(str(tmp_path))
    assert info["git_sha"] == head.strip() and info["git_dirty"] is False
    (tmp_path / "a.txt").write_text("b")
    assert log.environment_info(str(tmp_path))["git_dirty"] is True
    monkeypatch.setenv("SPECSERVE_GIT_SHA", "abc123")  # the override wins over stale metadata
    info = log.environment_info(str(tmp_path))
    assert info["git_sha"] == "abc123" and info["git_dirty"] is None


def test_append_result_creates_header_once(tmp_path) -> None:
    exp = tmp_path / "experiments"
    row = {"benchmark": "latency", "config": "bs=1 | spec", "tok_s": "123.4 (120.1-125.0)"}
    record = {"benchmark": "latency", "config": {"bs": 1}, "tok_s": [120.1, 125.0]}
    md, jl = log.append_result(str(exp), record, row, repo_dir=str(tmp_path))
    log.append_result(str(exp), {**record, "n": 2}, {**row, "notes": "second"})
    lines = (exp / "LOG.md").read_text().splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert md == str(exp / "LOG.md") and jl == str(exp / "results.jsonl")
    assert table[0].count("|") == 9 and "tok/s mean (min-max)" in table[0]
    assert len(table) == 4  # header, separator, two rows
    assert "bs=1 \\| spec" in table[2] and "unknown" in table[2]  # pipe escaped; no git here
    assert table[3].rstrip(" |").endswith("second")
    recs = [json.loads(x) for x in (exp / "results.jsonl").read_text().splitlines()]
    assert [r.get("n") for r in recs] == [None, 2]
    assert recs[0]["config"] == {"bs": 1} and recs[0]["git_sha"] == "unknown"
    assert set(recs[0]["versions"]) >= {"python", "torch", "transformers", "triton"}
    assert log.read_results(str(exp)) == recs
    with pytest.raises(ValueError, match="unknown LOG.md column"):
        log.append_result(str(exp), record, {"tok/s": "1"})


def _is_png(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_write_png(tmp_path) -> None:
    rng = random.Random(2)
    runs = {
        "baseline": [rng.uniform(90, 110) for _ in range(5)],
        "eagle3": [rng.uniform(180, 220) for _ in range(5)],
    }
    p1 = plots.plot_runs(str(tmp_path / "runs.png"), runs, "tok/s")
    sweep = {name: ys[:4] for name, ys in runs.items()}
    p2 = plots.plot_sweep(str(tmp_path / "sub" / "sweep.png"), [1, 2, 4, 8], sweep)
    for p in (p1, p2):
        assert _is_png(p) and (tmp_path / p).stat().st_size > 1000
    with pytest.raises(ValueError, match="has 5 points but x has 4"):
        plots.plot_sweep(str(tmp_path / "bad.png"), [1, 2, 4, 8], runs)
    with pytest.raises(ValueError, match="> 0"):
        plots.plot_sweep(str(tmp_path / "bad.png"), [0, 1], {"a": [1.0, 2.0]})


def test_builtin_prompt_sets() -> None:
    chat, code = prompts.load_prompts("chat"), prompts.load_prompts("code")
    assert len(chat) >= 12 and len(code) >= 12
    assert all(p.messages and p.messages[0]["role"] == "user" for p in chat)
    assert all(p.text and ("def " in p.text or "class " in p.text) for p in code)
    assert chat[0].as_text() == chat[0].messages[0]["content"]
    assert code[0].as_messages() == [{"role": "user", "content": code[0].text}]
    shared = prompts.load_prompts("shared")  # one long system prompt, then the chat questions
    system = shared[0].messages[0]
    assert system["role"] == "system" and len(system["content"]) > 5000
    assert all(p.messages == (system, c.messages[0]) for p, c in zip(shared, chat))
    assert len({p.as_text() for p in shared}) == len(shared)
    with pytest.raises(ValueError, match="'chat', 'code'"):
        prompts.load_prompts("poems")


def test_jsonl_prompts_and_errors(tmp_path) -> None:
    good = tmp_path / "p.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    good.write_text(json.dumps({"prompt": "abc"}) + "\n\n" + json.dumps({"messages": msgs}) + "\n")
    got = prompts.load_prompts(str(good))
    assert got[0].text == "abc" and list(got[1].messages) == msgs
    assert got[1].as_text() == "be brief\n\nhi"
    cases = {
        "{not json": r"bad0\.jsonl:1: not valid JSON",
        '{"prompt": "a", "messages": []}': "exactly one",
        '{"messages": [{"role": "robot", "content": "x"}]}': "role",
        '{"prompt": 3}': "non-empty string",
        "[1, 2]": "JSON object",
    }
    for i, (line, err) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=err):
            prompts.load_prompts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        prompts.load_prompts(str(empty))
    txt = tmp_path / "p.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match=".jsonl"):
        prompts.load_prompts(str(txt))
