"""StepInput: built from a real schedule it holds exactly each request's tokens, positions,
pages and sampling fields (checked against the Request objects with naive Python), selects
rows like list indexing, and round-trips through msgpack bytes at bs 1 and 128 (sizes
printed)."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import numpy as np
import pytest

from specserve.config import SchedulerConfig
from specserve.engine.plan import SchedulerOutput
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_builder import build_step_input
from specserve.kv_cache.allocator import PageAllocator
from specserve.sampling_params import SamplingParams
from specserve.worker.step_input import StepInput

PAGE = 4


def scheduled(bs: int, seed: int, decode_steps: int = 2) -> tuple[Scheduler, SchedulerOutput]:
    """bs requests of random lengths and sampling fields, prefilled and decoded a few steps
    (some mid-prefill at the end: the budget is short), then one more schedule."""
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(64, 24 * bs), max_num_seqs=bs),
        PageAllocator(4096),
        PAGE,
        512,
    )
    sched.lookahead = 3
    for i in range(bs):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([-1, 5]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            seed=rng.randrange(1 << 40) if rng.random() < 0.5 else None,
            max_tokens=rng.randint(4, 40),
        )
        prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(1, 40))]
        sched.add(Request(f"req-{seed}-{i}", prompt, params, seed=rng.randrange(1 << 62)))
    for _ in range(decode_steps):
        out = sched.schedule()
        sched.update(out, [[rng.randrange(30000)] if s.samples else [] for s in out.scheduled])
    return sched, sched.schedule()


def check_against_requests(step: StepInput, out: SchedulerOutput) -> None:
    assert step.bs == len(out.scheduled)
    positions = step.positions().tolist()
    table, width = step.page_table(pad=-7)
    t = 0
    for r, s in enumerate(out.scheduled):
        req = s.request
        end = s.start + s.num_new_tokens
        assert step.request_ids[r] == req.request_id
        assert step.tokens(r).tolist() == req.all_token_ids[s.start : end]
        assert positions[t : t + s.num_new_tokens] == list(range(s.start, end))
        t += s.num_new_tokens
        assert step.next_token_ids[r] == (-1 if s.samples else req.all_token_ids[end])
        assert step.pages(r).tolist() == req.page_ids
        assert table[r].tolist() == req.page_ids + [-7] * (width - len(req.page_ids))
        assert bool(step.samples[r]) == s.samples and bool(step.is_decode[r]) == s.is_decode
        assert step.lookahead[r] == s.lookahead and step.num_tokens[r] == req.num_tokens
        assert step.tokens_left[r] == req.max_tokens - req.num_output_tokens
        p = req.params
        assert step.temperature[r] == np.float32(p.temperature) and step.top_k[r] == p.top_k
        assert step.top_p[r] == np.float32(p.top_p) and step.min_p[r] == np.float32(p.min_p)
        assert bool(step.greedy[r]) == p.greedy and step.seed[r] == req.seed


@pytest.mark.parametrize("bs", [1, 128])
def test_round_trip(bs: int, capsys: pytest.CaptureFixture) -> None:
    _, out = scheduled(bs, seed=bs)
    step = build_step_input(out)
    assert step.is_decode.any()
    check_against_requests(step, out)
    data = step.encode()
    assert isinstance(data, bytes)
    back = StepInput.decode(data)
    assert back.equals(step)
    check_against_requests(back, out)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        StepInput.decode(step.encode())
    us = (time.perf_counter() - t0) / n * 1e6
    with capsys.disabled():
        print(
            f"\nStepInput bs={bs}: {step.bs} rows, {len(step.token_ids)} tokens, "
            f"{len(step.page_ids)} page ids -> {len(data)} bytes; encode+decode {us:.0f} us"
        )


def test_release_lists_travel() -> None:
    sched, out = scheduled(6, seed=3)
    victim = out.scheduled[-1].request
    sched.abort(victim.request_id)
    sched.update(out, [[5] if s.samples else [] for s in out.scheduled])
    nxt = sched.schedule()
    assert nxt.finished_ids and victim.request_id in nxt.finished_ids
    step = build_step_input(nxt)
    back = StepInput.decode(step.encode())
    assert back.finished_ids == nxt.finished_ids
    assert back.preempted_ids == [r.request_id for r in nxt.preempted]
    # reported once: the next plan lists only what ended after this one
    sched.update(nxt, [[5] if s.samples else [] for s in nxt.scheduled])
    assert victim.request_id not in sched.schedule().finished_ids


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_step_flags_travel_and_survive_select(launch_ahead: bool) -> None:
    """The step-wide flags (the draft mode, fold, launch_ahead) cross the wire and stay on
    a selection of rows: a rank that dropped launch_ahead would launch ahead alone."""
    _, out = scheduled(6, seed=4)
    step = build_step_input(out, "chain3", fold=True, launch_ahead=launch_ahead)
    for got in (StepInput.decode(step.encode()), step.select([2, 0])):
        assert (got.spec_mode, got.fold, got.launch_ahead) == ("chain3", True, launch_ahead)


def test_select_matches_list_indexing() -> None:
    _, out = scheduled(16, seed=5, decode_steps=1)
    step = build_step_input(out)
    rng = random.Random(0)
    for _ in range(5):
        index = rng.sample(range(step.bs), rng.randint(0, step.bs))
        sub = step.select(index)
        assert sub.request_ids == [step.request_ids[i] for i in index]
        for j, i in enumerate(index):
            assert sub.tokens(j).tolist() == step.tokens(i).tolist()
            assert sub.pages(j).tolist() == step.pages(i).tolist()
            assert sub.starts[j] == step.starts[i] and sub.seed[j] == step.seed[i]
        check_against_requests(sub, SchedulerOutput([out.scheduled[i] for i in index], []))


def test_corrupt_or_foreign_messages_are_refused() -> None:
    _, out = scheduled(2, seed=7)
    import msgpack

    msg = msgpack.unpackb(build_step_input(out).encode())
    msg["v"] = 99
    with pytest.raises(ValueError, match="format"):
        StepInput.decode(msgpack.packb(msg))


def test_step_input_imports_no_torch() -> None:
    code = (
        "import sys; import specserve.worker.step_input, specserve.engine.step_builder; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_processing_fields_built_selected_and_round_tripped() -> None:
    """Rows using penalties / min_tokens / logit_bias / logprobs carry their state (checked
    against the Request with naive Python); plain rows stay neutral and send no lists."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8),
                      PageAllocator(512), PAGE, 512, eos_token_ids=(2,))
    kinds = [SamplingParams(),
             SamplingParams(repetition_penalty=1.3, stop_token_ids=[7]),
             SamplingParams(frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=3,
                            stop_token_ids=[9], logit_bias={4: 1.5, 8: -100.0}),
             SamplingParams(logprobs=2, min_tokens=1, ignore_eos=True)]
    for i, p in enumerate(kinds):
        sched.add(Request(f"r{i}", [10 + i, 11, 12], p))
    out = sched.schedule()
    sched.update(out, [[20 + i] for i in range(4)])  # one output each
    out = sched.schedule()
    step = build_step_input(out, eos_token_ids=(2,))
    check_against_requests(step, out)
    for r, s in enumerate(out.scheduled):
        req, p = s.request, s.request.params
        hist = step.history_ids[step.history_counts[:r].sum():][: step.history_counts[r]]
        want = (req.all_token_ids if p.repetition_penalty != 1.0 else req.output_token_ids) \
            if p.penalized else []
        assert hist.tolist() == want and step.history_outputs[r] == (1 if p.penalized else 0)
        left = max(0, p.min_tokens - 1)
        assert step.min_left[r] == left
        stops = step.suppress_ids[step.suppress_counts[:r].sum():][: step.suppress_counts[r]]
        want_stops = sorted(set(p.stop_token_ids) | ({2} if not p.ignore_eos else set()))
        assert stops.tolist() == (want_stops if left else [])
        bias = step.bias_ids[step.bias_counts[:r].sum():][: step.bias_counts[r]]
        assert bias.tolist() == list(p.logit_bias)
        assert step.logprobs[r] == (-1 if p.logprobs is None else p.logprobs)
    assert step.processed.tolist() == [False, True, True, False] and step.eager
    back = StepInput.decode(step.encode())
    assert back.equals(step)
    sub = step.select([2, 1])
    assert sub.bias_values.tolist() == [1.5, -100.0] and sub.history_ids.tolist() == \
        [22] + out.scheduled[1].request.all_token_ids
    plain = build_step_input(out).select([0])
    assert not plain.eager and len(plain.history_ids) == len(plain.bias_ids) == 0


def test_cached_prefixes_travel_only_when_asked_and_present() -> None:
    """A row admitted on a cached prefix carries the prefix's tokens when the builder is asked
    (host-history drafters); a step with none leaves the arrays off the wire."""
    _, out = scheduled(6, seed=3)
    plain = build_step_input(out, cached_prefixes=True)
    assert not plain.prefix_counts.any() and b"prefix_ids" not in plain.encode()
    s = out.scheduled[2]
    s.from_cache, s.start = True, 3  # as if its first 3 tokens came from the cache
    s.num_new_tokens = min(s.num_new_tokens, len(s.request.all_token_ids) - 3)
    assert not build_step_input(out).prefix_counts.any()  # not asked: nothing travels
    step = build_step_input(out, cached_prefixes=True)
    assert step.prefix_counts.tolist() == [0, 0, 3, 0, 0, 0]
    assert step.prefix(2).tolist() == s.request.all_token_ids[:3]
    back = StepInput.decode(step.encode())
    assert back.equals(step) and back.prefix(2).tolist() == s.request.all_token_ids[:3]
    assert step.select([2, 0]).prefix(0).tolist() == s.request.all_token_ids[:3]
