"""The model-free drafters (ngram: chain on the device; suffix: host-built tree) are lossless
through the whole engine: greedy output == plain decoding, token for token, on the bundled
tiny-code model, 8 code prompts under continuous batching (staggered arrivals, 4 running at
most), a KV pool small enough to force preemptions, and prefix caching on.

The prompts include the worker's one-token-chunk-after-a-cached-prefix path: requests whose
prompt is an earlier request's prompt plus its first output tokens are admitted on its cached
pages with a single token left to run (checked: such rows occur, and for the state-free
suffix proposer they speculate).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_drivers import record_preemptions

from specserve import defaults
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.spec_policy import ScriptedPolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_config import speculative_config

TINY = defaults.tiny_code_path()
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PAGE = 8  # >= 1 + lookahead: a one-token chunk's page holds a cycle's verify nodes
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3, "topk": 2,
               "num_draft_tokens": 6},
}


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy outputs): six slices of this repo's source, then two prompts
    that extend the first one by 1 and by 9 of its output tokens (page-aligned cached prefix,
    one token left: 16 + 1 and 24 + 1)."""
    llm = LLM(TINY, device="cpu", dtype="float32", enable_prefix_caching=False)
    text = Path(__file__).read_text() + Path(defaults.__file__).read_text()
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:16]] + [ids[40 * i : 40 * i + 12 + 5 * i] for i in range(1, 6)]
    first = llm.generate([prompts[0]], GREEDY)[0].token_ids
    prompts += [prompts[0] + first[:1], prompts[0] + first[:9]]
    outs = llm.generate(prompts, GREEDY)
    return prompts, [o.token_ids for o in outs]


def _run(spec: SpecConfig, prompts: list[list[int]],
         pattern: list[str | None] | None = None) -> tuple[dict, Engine, list, list]:
    engine = Engine(EngineConfig(
        model=TINY, device="cpu", dtype="float32", spec=spec,
        cache=CacheConfig(page_size=PAGE, num_pages=18, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)))
    if pattern is not None:
        engine.spec_policy = ScriptedPolicy(pattern)
    preempted = record_preemptions(engine.scheduler)
    one_token_after_cache = []  # (request id, speculated) of such rows
    execute = engine.executor.execute

    def spy(step):
        out = execute(step)
        for r, rid in enumerate(step.request_ids):
            if step.from_cache[r] and step.num_new_tokens[r] == 1:
                one_token_after_cache.append((rid, bool(out.num_drafted and out.num_drafted[r] > 0)))
        return out

    engine.executor.execute = spy
    arrivals = {0: [0, 1], 3: [2], 5: [3, 4], 9: [5], 30: [6], 34: [7]}  # step -> prompts
    outputs: dict[int, list[int]] = {}
    for step in range(2000):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], GREEDY)
            outputs[i] = []
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
        if step > max(arrivals) and not engine.has_unfinished():
            break
    return outputs, engine, preempted, one_token_after_cache


@pytest.mark.parametrize("switching", [False, True], ids=["static", "on-off"])
@pytest.mark.parametrize("method", list(METHODS))
def test_drafter_greedy_equals_plain_with_preemption_and_prefix_cache(
        workload, method: str, switching: bool) -> None:
    """on-off: speculation scripted on 3 steps, off 4, on 1, off 2 (ngram's history is then
    caught up over the tokens plain steps made; suffix indexes them as they come)."""
    prompts, plain = workload
    mode = "chain3" if method == "ngram" else "tree2x3x6"
    pattern = [mode] * 3 + [None] * 4 + [mode] + [None] * 2 if switching else None
    got, engine, preempted, one_token = _run(speculative_config(METHODS[method]), prompts,
                                             pattern)
    for i, want in enumerate(plain):
        assert got[i] == want, (method, i)
    c = engine.drafter.counters
    assert c.num_drafts > 20 and c.num_accepted_tokens > 10, c
    assert preempted, "the pool was sized to force preemptions"
    assert engine.prefix_cache is not None
    # (switching off, ngram's history lags behind and the pages past it are not cached)
    assert one_token or switching, "no one-token chunk after a cache hit"
    # a prefill chunk owns no lookahead slots: it never runs a cycle, even with a state-free
    # proposer (suffix) whose page would hold the verify nodes
    assert not any(spec for _, spec in one_token), one_token
    assert engine.allocator.num_free == engine.allocator.num_total
    assert not engine.drafter.covered and not engine.drafter.state, "per-request state leaked"
    if switching:
        assert c.mode_steps["off"] > 10 and c.mode_steps[mode] > 10, c.mode_steps
        assert method == "suffix" or c.num_catch_ups > 5, c
    if method == "suffix":
        assert not engine.drafter.proposer.requests, "host histories leaked"
        assert engine.drafter.proposer.cache.entries, "no output reached the output cache"


def test_server_speculates_with_ngram_and_labels_its_counters(workload) -> None:
    """`serve` with speculative_config ngram: greedy completion tokens == plain, and the
    acceptance counters on /metrics carry method="ngram"."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from test_server import LiveServer

    prompts, plain = workload
    config = EngineConfig(model=TINY, device="cpu", dtype="float32", enforce_eager=True,
                          spec=speculative_config(METHODS["ngram"]))
    server = LiveServer(config)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        reply = client.completions.create(model=TINY, prompt=prompts[2], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == server.async_engine.engine.tokenizer.decode(plain[2])
        text = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    drafts = {tuple(s.labels.items()): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "specserve:spec_decode_num_drafts_total"}
    assert list(drafts) == [(("method", "ngram"),)] and drafts[(("method", "ngram"),)] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", list(METHODS))
def test_offline_api_with_decode_overlap_on(workload, method: str, device: str) -> None:
    """LLM(..., speculative_config={vLLM's keys}) with --decode-overlap on: ngram launches the
    next cycle from the device outputs (its history is updated inside the cycle) and stays
    lossless; suffix builds trees on the host, so the worker turns overlap off for it. On
    CUDA every cycle is a graph replay (static inputs: ngram's page table, suffix's tree)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    prompts, plain = workload
    # on CUDA a fixed pool: a budget taken from free memory can come out empty beside the
    # other engines of this process and other test workers on the same GPU
    pool = {"cache": CacheConfig(page_size=16, num_pages=512)} if device == "cuda" else {}
    llm = LLM(TINY, device=device, dtype="float32", decode_overlap="on",
              speculative_config=METHODS[method], **pool)
    if device == "cuda":
        assert llm.engine.drafter.num_graphs > 0
    outs = llm.generate(prompts[:4], GREEDY)
    if device == "cuda":  # plain decoding on the same device
        ref = LLM(TINY, device=device, dtype="float32", enable_prefix_caching=False, **pool)
        plain = [o.token_ids for o in ref.generate(prompts[:4], GREEDY)]
    assert [o.token_ids for o in outs] == plain[:4]
    drafter = llm.engine.drafter
    if method == "ngram":
        assert drafter.overlap and drafter.cycles_launched_ahead > 5
    else:
        assert not drafter.overlap and drafter.cycles_launched == 0
        assert not any(m.cycles.overlap for m in drafter.modes.values())


@pytest.mark.slow
def test_drafters_under_tensor_parallelism(workload) -> None:
    """TP 2 (a gloo worker process): every rank runs the drafter (ngram's device history,
    suffix's host trees built from the same inputs) and the tokens are plain's."""
    prompts, plain = workload
    for method in METHODS:
        with LLM(TINY, device="cpu", dtype="float32", tensor_parallel_size=2,
                 speculative_config=METHODS[method]) as llm:
            outs = llm.generate(prompts[:3], GREEDY)
            assert [o.token_ids for o in outs] == plain[:3], method
            assert llm.engine.drafter.counters.num_accepted_tokens > 0


def test_suffix_indexes_the_tokens_of_a_cached_prefix(workload) -> None:
    """A request admitted on a cached prefix: its first step carries the prefix's tokens
    (only for this host-history drafter), so the suffix index covers the whole request from
    position 0, as without caching."""
    prompts, plain = workload
    engine = Engine(EngineConfig(
        model=TINY, device="cpu", dtype="float32", spec=speculative_config(METHODS["suffix"]),
        cache=CacheConfig(page_size=PAGE, num_pages=64, enable_prefix_caching=True)))
    proposer, seen = engine.drafter.proposer, []
    observe = proposer.observe

    def spy(step, emitted):
        observe(step, emitted)
        for r, rid in enumerate(step.request_ids):
            if step.from_cache[r]:
                index = proposer.requests[rid]
                seen.append((int(step.starts[r]), proposer.base[rid], len(index),
                             int(step.seq_lens[r]) + len(emitted[r])))

    proposer.observe = spy
    for i in (0, 7):  # prompt 7 = prompt 0 + 9 of its output tokens: 24 tokens cached
        rid = engine.add_request(str(i), prompts[i], GREEDY)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert out == plain[i]
    assert seen and all(start > 0 and base == 0 and n == end for start, base, n, end in seen)


def test_cost_table_times_the_suffix_host_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive policy's start-up table charges suffix modes the host tree building every
    step does (here slowed to 100 ms a call, well above a plain step even on a loaded CI
    box, where one took 31 ms): each suffix entry >= 100 ms, plain below;
    the profiled rows had a history behind them (full trees were built) and leave no
    per-request state or output-cache entry."""
    import time

    from specserve.speculative.suffix import SuffixProposer

    built = []
    host_states = SuffixProposer.host_states

    def slow(self, shape, rows):
        time.sleep(0.1)
        out = host_states(self, shape, rows)
        built.append(int((out[:, : shape.num_draft_tokens - 1] != 0).sum()))
        return out

    monkeypatch.setattr(SuffixProposer, "host_states", slow)
    spec = speculative_config({**METHODS["suffix"], "modes": "chain2", "policy": "adaptive"})
    engine = Engine(EngineConfig(
        model=TINY, device="cpu", dtype="float32", spec=spec,
        cache=CacheConfig(page_size=PAGE, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=2)))
    table = engine.spec_cost_table
    assert set(table) == {"off", "tree2x3x6", "chain2"}
    for mode in ("tree2x3x6", "chain2"):
        assert all(t >= 0.1 for t in table[mode].values()), table
    assert all(t < 0.1 for t in table["off"].values()), table
    assert built and min(built) > 0, "no tree drafted from the profiled histories"
    proposer = engine.drafter.proposer
    assert not proposer.requests and not proposer.base and not proposer.output_start
    assert not proposer.cache.entries and not proposer.cache.ends
