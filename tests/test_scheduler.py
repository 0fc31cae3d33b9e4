from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from scheduler_helpers import EOS, make, req, step

from specserve.config import SchedulerConfig
from specserve.engine.plan import QueueFullError, SchedulerOutput
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache.allocator import PageAllocator, pages_for
from specserve.sampling_params import SamplingParams


def test_torch_free() -> None:
    # the scheduler stack must stay importable without torch (it is tested exhaustively on CPU)
    code = (
        "import sys; import specserve.engine.scheduler, specserve.kv_cache.allocator; "
        "assert 'torch' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_chunked_prefill_splits_long_prompt() -> None:
    s = make(budget=8)
    s.add(req("a", 20))
    chunks = []
    for _ in range(3):
        out = step(s)
        (e,) = out.scheduled
        chunks.append((e.start, e.num_new_tokens, e.samples))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    a = s.running[0]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [7]
    assert len(a.page_ids) == pages_for(20, 4)


def test_decodes_first_then_chunks_share_budget() -> None:
    s = make(budget=10)
    s.add(req("a", 3))
    step(s)  # a prefilled, now decoding
    s.lookahead = 2
    s.add(req("b", 30))
    out = s.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["a", "b"]
    dec, chunk = out.scheduled
    assert dec.is_decode and dec.num_new_tokens == 1 and dec.lookahead == 2
    assert (chunk.start, chunk.num_new_tokens) == (0, 7)  # 10 - (1 + lookahead)
    assert out.num_tokens == 10
    # a decode owns KV slots for its token plus the lookahead
    assert len(dec.request.page_ids) == pages_for(dec.start + 1 + 2, 4)
    s.update(out, [[7, 8], []], num_computed=[2, 7])  # one draft accepted + bonus
    a = s.get("a")
    assert a is not None and a.output_token_ids == [7, 7, 8]
    assert a.num_computed_tokens == 5 and len(a.page_ids) == pages_for(5, 4)


def test_preemption_takes_last_admitted_and_requeues_at_front() -> None:
    s = make(budget=64, pages=5, page_size=4)
    for rid in "abc":
        s.add(req(rid, 2, max_tokens=8))
    s.add(req("d", 2, max_tokens=4))
    out = step(s)  # a, b, c admitted with one page each; d blocked by the page headroom
    assert [e.request.request_id for e in out.scheduled] == ["a", "b", "c"]
    out = step(s)  # decodes at KV length 3 still fit one page each
    assert [e.request.request_id for e in out.scheduled] == ["a", "b", "c"]
    s.lookahead = 5  # every decode now needs 3 + 1 + 5 = 9 slots = 3 pages
    out = s.schedule()
    # a takes the 2 free pages; b preempts c (admitted last), then is itself the victim
    assert [r.request_id for r in out.preempted] == ["c", "b"]
    assert [e.request.request_id for e in out.scheduled] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "c", "d"]
    for r in out.preempted:
        assert r.status == RequestStatus.WAITING and r.num_preemptions == 1
        assert r.num_computed_tokens == 0 and r.page_ids == [] and r.output_token_ids == [7, 7]
    s.update(out, [[7]])
    s.lookahead = 0
    s.abort("a")
    out = s.schedule()  # b is re-prefilled first, its output tokens with its prompt
    entry = out.scheduled[0]
    assert entry.request.request_id == "b"
    assert (entry.start, entry.num_new_tokens, entry.samples) == (0, 4, True)


def test_victim_is_the_request_being_scheduled() -> None:
    s = make(budget=64, pages=5, page_size=2, seqs=2)
    s.add(req("a", 1, max_tokens=9))
    s.add(req("b", 1, max_tokens=9))
    for _ in range(4):
        out = step(s)
        assert not out.preempted
    out = s.schedule()  # both need a third page, one is free: a (first admitted) gets it
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [e.request.request_id for e in out.scheduled] == ["a"]
    s.update(out, [[7]])
    assert [r.request_id for r in s.waiting] == ["b"]


def test_stop_inside_multi_token_list() -> None:
    s = make()
    s.lookahead = 3
    s.add(req("eos", 4, max_tokens=50))
    s.add(req("tok", 4, max_tokens=50, stop_token_ids=[42]))
    s.add(req("ign", 4, max_tokens=50, ignore_eos=True))
    s.add(req("len", 4, max_tokens=3))
    step(s)
    out = s.schedule()
    emitted = {"eos": [5, EOS, 6], "tok": [5, 42, EOS], "ign": [EOS, 5, 6], "len": [5, 6, 7]}
    finished = s.update(
        out, [emitted[e.request.request_id] for e in out.scheduled], num_computed=[3] * 4
    )
    got = {r.request_id: (r.output_token_ids, r.finish_reason, r.stop_reason) for r in finished}
    assert got == {
        "eos": ([7, 5, EOS], "stop", None),
        "tok": ([7, 5, 42], "stop", 42),
        "len": ([7, 5, 6], "length", None),
    }
    ign = s.get("ign")
    assert ign is not None and ign.output_token_ids == [7, EOS, 5, 6]
    assert s.allocator.num_free == s.allocator.num_total - len(ign.page_ids)


def test_max_model_len_clamp_finishes_with_length() -> None:
    s = make(max_model_len=16, pages=64)
    r = req("a", 10, max_tokens=100)
    s.add(r)
    assert r.max_tokens == 6
    while s.has_unfinished:
        step(s)
    assert r.finish_reason == "length" and r.num_tokens == 16


def test_finish_and_abort_free_pages() -> None:
    s = make()
    s.add(req("a", 5))
    s.add(req("b", 5))
    step(s)
    s.add(req("w", 5))
    a = s.get("a")
    assert a is not None
    s.finish(a, "stop", "END")
    assert (a.finish_reason, a.stop_reason, a.page_ids) == ("stop", "END", [])
    assert s.abort("w") is not None and s.abort("b") is not None
    assert s.abort("b") is None and s.abort("nope") is None
    assert not s.has_unfinished and s.allocator.num_free == s.allocator.num_total


def test_add_errors() -> None:
    s = make(max_model_len=32, pages=4, page_size=4, max_waiting=2)
    with pytest.raises(ValueError, match="empty"):
        s.add(Request("e", [], SamplingParams()))
    with pytest.raises(ValueError, match="prompt has 32 tokens but the context length is 32"):
        s.add(req("long", 32))
    for bad in ([1, -1], [1, 2.0], [True, 3], [1, "2"]):
        with pytest.raises(ValueError, match="non-negative integers"):
            s.add(Request("bad", bad, SamplingParams()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KV pages"):
        s.add(req("big", 10, max_tokens=7))  # 17 tokens > 16 slots
    s.add(req("fits", 10, max_tokens=6))
    s.lookahead = 1
    with pytest.raises(ValueError, match="KV pages"):
        s.add(req("la", 10, max_tokens=6))  # the lookahead slot no longer fits
    s.lookahead = 0
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("fits", 3, max_tokens=4))
    s.add(req("two", 3, max_tokens=4))
    with pytest.raises(QueueFullError):
        s.add(req("three", 3, max_tokens=4))
    with pytest.raises(ValueError, match="lookahead"):
        s.lookahead = 64


def test_request_stats_and_seed() -> None:
    r = Request("r", [1, 2], SamplingParams(seed=5), seed=9)
    assert r.seed == 5 and Request("q", [1], SamplingParams(), seed=9).seed == 9
    r.record_spec_cycle(3, 2)
    r.record_spec_cycle(4, 0)
    r.record_spec_cycle(2, 1)
    assert (r.spec_cycles, r.spec_draft_tokens, r.spec_accepted_tokens) == (3, 9, 3)
    assert r.spec_accepted_per_pos == [2, 1, 0, 0]


# ---------------------------------------------------------------------------------------------
# randomized engine simulation against a naive reference


@dataclass
class Sim:
    streams: dict[str, list[int]] = field(default_factory=dict)  # output each request would get
    kv: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> (request, position)
    aborted: set[str] = field(default_factory=set)
    stop_string_at: dict[str, int] = field(default_factory=dict)


def expected_output(r: Request, stream: list[int], max_len: int) -> tuple[list[int], str]:
    """Naive reference: the stream cut at the first stop token, EOS, max_tokens or context end."""
    out: list[int] = []
    for t in stream:
        out.append(t)
        if t in r.params.stop_token_ids or (t == EOS and not r.params.ignore_eos):
            return out, "stop"
        if len(out) == r.params.max_tokens or r.num_prompt_tokens + len(out) == max_len:
            return out, "length"
    raise AssertionError("stream too short")


def check_invariants(s: Scheduler, out: SchedulerOutput | None, sim: Sim) -> None:
    ps = s.page_size
    owned: list[int] = []
    entries = {e.request.request_id: e for e in (out.scheduled if out else [])}
    for r in s.running:
        e = entries.get(r.request_id)
        if e is not None:
            need = e.start + e.num_new_tokens + e.lookahead
        else:
            need = r.num_computed_tokens
        assert len(r.page_ids) == pages_for(need, ps), (r, e)
        assert r.num_computed_tokens <= r.num_tokens - 1
        # valid KV positions still hold what this request wrote there
        for p in range(r.num_computed_tokens):
            slot = r.page_ids[p // ps] * ps + p % ps
            assert sim.kv[slot] == (r.request_id, p)
        owned += r.page_ids
    for r in s.waiting:
        assert r.page_ids == [] and r.num_computed_tokens == 0
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert s.allocator.num_free + len(owned) == s.allocator.num_total
    assert len(s.running) <= s.config.max_num_seqs


def run_sim(seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim()
    page_size = rng.choice([1, 2, 4])
    max_len = rng.randint(6, 40)
    # a pool holding one to three long requests: tight enough to force preemptions
    num_pages = rng.randint(pages_for(max_len // 2, page_size), pages_for(2 * max_len, page_size))
    budget = rng.randint(4, 24)
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=budget, max_waiting=1000
        ),
        PageAllocator(num_pages),
        page_size,
        max_len,
        eos_token_ids=(EOS,),
    )
    all_reqs: list[Request] = []
    vocab = 20
    for i in range(rng.randint(3, 12)):
        rid = f"r{seed}-{i}"
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=[rng.randrange(1, vocab)] if rng.random() < 0.3 else [],
        )
        longest = max_len + 2 if rng.random() < 0.15 else max_len // 2
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, longest))]
        r = Request(rid, prompt, params)
        sim.streams[rid] = [rng.choice([EOS] + list(range(1, vocab)) * 6) for _ in range(80)]
        if rng.random() < 0.15:
            sim.stop_string_at[rid] = rng.randint(1, 5)
        r._arrive = rng.randint(0, 30)  # type: ignore[attr-defined]
        all_reqs.append(r)
    pending = sorted(all_reqs, key=lambda r: r._arrive)  # type: ignore[attr-defined]
    admitted: list[Request] = []
    for t in range(3000):
        while pending and pending[0]._arrive <= t:  # type: ignore[attr-defined]
            r = pending.pop(0)
            n = r.num_prompt_tokens
            mt = min(r.params.max_tokens, max_len - n)
            never_fits = n >= max_len or pages_for(n + mt + s.lookahead, page_size) > num_pages
            if never_fits:
                with pytest.raises(ValueError):
                    s.add(r)
            else:
                s.add(r)
                admitted.append(r)
        if rng.random() < 0.1:
            s.lookahead = rng.randint(0, min(3, budget - 1))
        if rng.random() < 0.05 and admitted:
            victim = rng.choice(admitted)
            if s.abort(victim.request_id) is not None:
                sim.aborted.add(victim.request_id)
        out = s.schedule()
        assert out.num_tokens <= budget
        check_invariants(s, out, sim)
        emitted, computed = [], []
        for e in out.scheduled:
            r = e.request
            for p in range(e.start, e.start + e.num_new_tokens + e.lookahead):  # the runner writes
                sim.kv[r.page_ids[p // page_size] * page_size + p % page_size] = (r.request_id, p)
            if not e.samples:
                emitted.append([])
                computed.append(e.num_new_tokens)
                continue
            k = rng.randint(1, 1 + e.lookahead)  # tokens of one verify: accepted drafts + bonus
            stream = sim.streams[r.request_id]
            emitted.append(stream[r.num_output_tokens : r.num_output_tokens + k])
            computed.append(e.num_new_tokens + k - 1)
        s.update(out, emitted, computed)
        for r in list(s.running):
            at = sim.stop_string_at.get(r.request_id)
            if at is not None and r.num_output_tokens >= at:
                s.finish(r, "stop", "STOP")
        check_invariants(s, None, sim)
        if not s.has_unfinished and not pending:
            break
    assert not s.has_unfinished, "no progress"
    assert s.allocator.num_free == num_pages
    for r in admitted:
        assert r.is_finished and r.page_ids == []
        stream = sim.streams[r.request_id]
        assert r.output_token_ids == stream[: r.num_output_tokens]
        if r.request_id in sim.aborted:
            assert r.finish_reason == "abort"
        elif r.finish_reason == "stop" and r.stop_reason == "STOP":
            assert r.num_output_tokens >= sim.stop_string_at[r.request_id]
        else:
            assert (r.output_token_ids, r.finish_reason) == expected_output(r, stream, max_len)


@pytest.mark.parametrize("chunk", range(4))
def test_random_engine_simulation(chunk: int) -> None:
    for seed in range(chunk * 250, (chunk + 1) * 250):
        run_sim(seed)

