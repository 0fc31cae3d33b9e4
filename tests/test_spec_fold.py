"""Mixed steps (a speculative step that carries prefill chunks): folded, its decodes run one
token each in the chunks' forward, feeding the drafter (StepInput.fold); or, for a chain,
the chunks ride in the cycle's verify forward (speculative/mixed.py).

- Through the engine (tiny random pair, fp32, requests arriving while others decode, a pool
  small enough to preempt): greedy output == plain, folds happened, and the drafter's state
  after a fold equals the one a catch-up computes for the same positions (a second run that
  goes off on exactly the folded steps and catches up after).
- Chunks in a chain's verify forward: the same tokens, log-probs, prompt log-probs and
  drafter state rows as the two forwards they replace, step by step.
- The adaptive policy: folds a mixed step when its decodes yield more tokens per second
  that way (low acceptance, a costly verify beside the chunks), keeps the verify when it
  pays, learns the fold's time, and in a model engine with frequent mixed steps reaches the
  best static choice.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_drivers import record_preemptions
from tiny_eagle import make_tiny_pair
from tiny_models import device_fixture

from specserve.config import CacheConfig, SchedulerConfig
from specserve.engine.spec_policy import AdaptivePolicy, StaticPolicy, _interpolate
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

# CPU, and (marked gpu) CUDA, where the speculative steps are graph replays
device = device_fixture(globals())


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("fold"))


class FoldAlways(StaticPolicy):
    """chain3 on every step; every mixed step folds (its engine step indices kept)."""

    def __init__(self) -> None:
        super().__init__("chain3")
        self.steps, self.folded = 0, []

    def choose(self, decoding: list[str], others: int = 0, behind: int = 0) -> str:
        self.steps += 1
        return self.mode

    def fold(self, mode: str, decoding: list[str]) -> bool:
        self.folded.append(self.steps)
        return True


class OffAt(StaticPolicy):
    """chain3, except off on the given engine steps."""

    def __init__(self, off: list[int]) -> None:
        super().__init__("chain3")
        self.steps, self.off = 0, set(off)

    def choose(self, decoding: list[str], others: int = 0, behind: int = 0) -> str | None:
        self.steps += 1
        return None if self.steps in self.off else self.mode


def _workload(seed: int = 3) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 40))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(10, 30), ignore_eos=True)
              for _ in prompts]
    return prompts, params


def _llm(pair, device: str, num_pages: int, spec: bool = True, exact: bool = False,
         **extra) -> LLM:
    kw = dict(device=device, dtype="float32", cache=CacheConfig(page_size=4, num_pages=num_pages),
              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24), exact=exact)
    if spec:
        kw["speculative_config"] = dict(algorithm="eagle3", draft_model=pair[1], num_steps=3,
                                        modes="tree2x2x4", **extra)
    return LLM(pair[0], **kw)


def _states_after_each_step(llm: LLM) -> dict[tuple[str, int], torch.Tensor]:
    """(request id, covered) -> the drafter's state row, after every step (a spy)."""
    engine, seen = llm.engine, {}
    inner = engine.executor.execute

    def spy(step):
        out = inner(step)
        d = engine.drafter.primary
        for rid in step.request_ids:
            if rid in d.state and not d.pending.get(rid):
                seen[(rid, d.covered[rid])] = d.state[rid].clone()
        return out

    engine.executor.execute = spy
    return seen


def test_folded_steps_are_lossless_and_feed_the_drafter_as_a_catch_up_would(
        pair, device: str) -> None:
    prompts, params = _workload()
    ref = [o.token_ids for o in _llm(pair, device, 512, spec=False).generate(prompts, params)]
    folding = _llm(pair, device, 512)
    policy = folding.engine.spec_policy = FoldAlways()
    states = _states_after_each_step(folding)
    assert [o.token_ids for o in folding.generate(prompts, params)] == ref
    c = folding.engine.drafter.counters
    assert c.mode_steps["fold"] == len(policy.folded) > 5, c.mode_steps
    assert c.mode_steps["chain3"] > 10 and c.num_catch_ups == 0, c

    # the same schedule with the folded steps off: the catch-up after each computes the
    # state the fold fed
    catching = _llm(pair, device, 512)
    catching.engine.spec_policy = OffAt(policy.folded)
    caught = []
    worker = catching.engine.drafter
    inner = worker._catch_up

    def spy(d, rows):
        due = [rid for rid in rows.request_ids if d.pending.get(rid)]
        inner(d, rows)
        caught.extend((rid, d.covered[rid], d.state[rid].clone()) for rid in due)

    worker._catch_up = spy
    assert [o.token_ids for o in catching.generate(prompts, params)] == ref
    assert worker.counters.mode_steps["off"] == len(policy.folded)
    assert len(caught) > 5
    for rid, covered, row in caught:
        tol = 1e-5 if device == "cpu" else 1e-3  # CUDA: another reduction order per shape
        torch.testing.assert_close(row, states[(rid, covered)], rtol=tol, atol=tol)


def test_the_engine_tells_the_policy_each_steps_chunk_tokens(pair) -> None:
    """observe() gets the prompt tokens the step's chunks ran (mixed iff any), which add up
    to every prompt's length: the adaptive policy's prompt tokens per emitted token."""
    prompts, params = _workload()
    llm = _llm(pair, "cpu", 512)
    seen = []

    class Recording(StaticPolicy):
        def observe(self, mode, accepted, seconds, batch, mixed=False, folded=False,
                    chunk_tokens=None, chain_runs=None):
            seen.append((mixed, chunk_tokens))

    llm.engine.spec_policy = Recording("chain3")
    llm.generate(prompts, params)
    assert all(mixed == (n > 0) for mixed, n in seen), seen
    assert sum(n for _, n in seen) == sum(len(p) for p in prompts)
    assert sum(1 for mixed, _ in seen if mixed) > 5


def test_folded_steps_under_preemption(pair, device: str) -> None:
    prompts, params = _workload(seed=8)
    ref = [o.token_ids for o in _llm(pair, device, 512, spec=False).generate(prompts, params)]
    small = _llm(pair, device, 40)  # 160 slots for 4 requests of up to 70 tokens plus lookahead
    small.engine.spec_policy = FoldAlways()
    preempted = record_preemptions(small.engine.scheduler)
    assert [o.token_ids for o in small.generate(prompts, params)] == ref
    assert preempted and small.engine.drafter.counters.mode_steps["fold"] > 0
    assert small.engine.allocator.num_free == small.engine.allocator.num_total


@pytest.mark.parametrize("accept", ["real", "synthetic"])
@pytest.mark.parametrize("mode", ["chain3", "tree2x2x4"])
def test_chunks_in_the_verify_forward_equal_two_forwards(pair, device: str, mode: str,
                                                         accept: str) -> None:
    """A chain's nodes in one causal forward with the chunks; a tree's under SplitMetadata
    (attention per range, every other layer once). The random pair accepts nothing, so only
    each root's logits and features count there: the synthetic acceptance (0.7 a draft)
    accepts nodes past the root, whose features feed the drafter and whose logits give the
    bonus token (a wrong node mask or position changes them); its tokens are no plain
    decoding's, so those runs are compared with each other only."""
    prompts, params = _workload(seed=5)
    for i in (1, 4):  # log-probs of the emitted tokens, and of the prompt (its chunks)
        params[i] = SamplingParams(temperature=0, max_tokens=params[i].max_tokens,
                                   ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ref = [o.token_ids for o in _llm(pair, device, 512, spec=False).generate(prompts, params)]
    extra = dict(synthetic_accept_rate=0.7) if accept == "synthetic" else {}
    runs = {}
    for together in (True, False):
        llm = _llm(pair, device, 512, **extra)
        llm.engine.spec_policy = StaticPolicy(mode)
        llm.engine.drafter.chunks_in_verify = "always" if together else "never"
        states = _states_after_each_step(llm)
        outs = llm.generate(prompts, params)
        if accept == "real":
            assert [o.token_ids for o in outs] == ref
        runs[together] = outs, states, llm.engine.drafter.counters
    (outs, states, c), (outs2, states2, c2) = runs[True], runs[False]
    assert [o.token_ids for o in outs] == [o.token_ids for o in outs2]
    assert c.num_chunks_in_verify > 5 and c2.num_chunks_in_verify == 0, c
    assert c.num_drafts == c2.num_drafts and c.accepted_per_pos == c2.accepted_per_pos
    if accept == "synthetic":
        assert sum(c.accepted_per_pos[1:]) > 10, c.accepted_per_pos  # nodes past depth 1
    assert states.keys() == states2.keys() and len(states) > 50
    tol = 1e-5 if device == "cpu" else 1e-3
    for key, row in states.items():
        torch.testing.assert_close(row, states2[key], rtol=tol, atol=tol)
    for i in (1, 4):
        for got, want in ((outs[i].logprobs, outs2[i].logprobs),
                          (outs[i].prompt_logprobs[1:], outs2[i].prompt_logprobs[1:])):
            assert len(got) == len(want) > 3
            for a, b in zip(got, want):
                assert a[1] == b[1]  # the same top ids
                torch.testing.assert_close(torch.tensor([a[0], *a[2]]),
                                           torch.tensor([b[0], *b[2]]), rtol=tol, atol=tol)


def test_chunks_in_the_verify_forward_in_exact_mode(pair, device: str) -> None:
    """Exact mode: chunks riding in a chain's verify forward (one causal extend over chunks
    and nodes), and greedy output equals plain decoding in exact mode."""
    prompts, params = _workload(seed=6)
    ref = [o.token_ids for o in
           _llm(pair, device, 512, spec=False, exact=True).generate(prompts, params)]
    llm = _llm(pair, device, 512, exact=True)
    llm.engine.spec_policy = StaticPolicy("chain3")
    llm.engine.drafter.chunks_in_verify = "always"  # (on a GPU "auto" runs them on their own)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.drafter.counters.num_chunks_in_verify > 5


MODES = {"chain3": (1, 3)}
COSTS = {"off": {1: 1.0, 16: 1.2}, "chain3": {1: 1.3, 16: 1.8}}


def _policy(rate_hits: int, rate_trials: int) -> AdaptivePolicy:
    pol = AdaptivePolicy(MODES, COSTS, explore_every=10**6)
    for _ in range(rate_trials):  # global acceptance: rate_hits / rate_trials per depth
        pol.acceptance.observe_step({"x": 3 if rate_hits else 0}, 1, 3)
    return pol


def test_policy_folds_when_the_decodes_yield_more_that_way() -> None:
    rows = [f"r{i}" for i in range(16)]
    low, high = _policy(0, 50), _policy(1, 50)  # acceptance ~0 and ~1
    for pol in (low, high):
        pol.mixed_extra["chain3"] = 0.3  # the verify beside the chunks' forward
        pol.mixed_extra["fold"] = 0.1
    # 16 tokens in 1.2 + 0.1 s (fold) vs 16 x E in 1.8 + 0.3 s: E ~1 folds; E ~4 keeps the
    # verify (48 more tokens for 0.8 s more, above the 64 / 1.8 s of the other steps)
    assert low.fold("chain3", rows) and not high.fold("chain3", rows)
    # a verify beside the chunks that costs a whole step: its 48 extra tokens in 1.5 s more
    # are worth less than the other steps' rate, so even E ~4 folds
    high.mixed_extra["chain3"] = 1.0
    assert high.fold("chain3", rows)
    # learnt from folded steps: the time over the plain step's
    pol = _policy(0, 5)
    for _ in range(60):
        pol.observe("chain3", {}, _interpolate(sorted(COSTS["off"].items()), 16) + 0.3, 16,
                    mixed=True, folded=True)
    assert pol.mixed_extra["fold"] == pytest.approx(0.3, rel=0.01)
    assert pol.scale == {"off": 1.0, "chain3": 1.0}  # no rescaling, no switch learnt
    assert pol.switch_steps == {"on": 2.0, "off": 1.0, "mode": 1.0}


def _run_model(policy, rate: float, steps: int, batch: int, mixed_every: int,
               verify_beside: float, fold_extra: float, seed: int = 0) -> float:
    """Tokens per second in a model engine: steps cost the table's time; every
    `mixed_every`-th step carries chunks, which cost a speculative step `verify_beside`
    more, or, folded, the plain step's time plus `fold_extra` for one token a row."""
    rng = random.Random(seed)
    rows = [f"r{i}" for i in range(batch)]
    tokens, seconds = 0, 0.0
    for i in range(steps):
        mode = policy.choose(rows)
        mixed = i % mixed_every == 0
        folded = bool(mode is not None and mixed and policy.fold(mode, rows))
        key = "off" if mode is None or folded else mode
        t = _interpolate(sorted(COSTS[key].items()), batch)
        if mixed:
            t += fold_extra if folded else verify_beside if mode is not None else 0.0
        accepted = {}
        for rid in rows:
            m = 0
            if mode is not None and not folded:
                while m < 3 and rng.random() < rate:
                    m += 1
                accepted[rid] = m
            tokens += m + 1
        policy.observe(mode, accepted, t, batch, mixed=mixed, folded=folded)
        seconds += t
    return tokens / seconds


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.8])
def test_adaptive_with_folds_reaches_the_best_static_choice(rate: float) -> None:
    """Every 3rd step mixed, a verify beside the chunks costing 1.5 plain steps: against off,
    chain3 everywhere and chain3 folding every mixed step, adaptive reaches 0.95 of the
    best."""
    kw = dict(steps=3000, batch=16, mixed_every=3, verify_beside=1.8, fold_extra=0.2)

    class Fixed(StaticPolicy):
        def __init__(self, mode, folds):
            super().__init__(mode)
            self.folds = folds

        def fold(self, mode, decoding):
            return self.folds

    static = {"off": _run_model(Fixed(None, False), rate, **kw),
              "chain3": _run_model(Fixed("chain3", False), rate, **kw),
              "chain3+fold": _run_model(Fixed("chain3", True), rate, **kw)}
    costs = {m: {b: t for b, t in r.items()} for m, r in COSTS.items()}
    got = _run_model(AdaptivePolicy(MODES, costs), rate, **kw)
    assert got >= 0.95 * max(static.values()), (got, static)


def test_no_fold_where_a_cycle_launched_ahead_holds_the_decodes(pair) -> None:
    """With decode overlap, a pure speculative step launches the next cycle before the host
    reads it; if the next step carries prefill chunks, that cycle is already on the device,
    and folding would discard its work (a folded step measured 20.4 ms where its plain
    counterpart took 16.4 on an H100). The engine then keeps the cycle (chunks in a forward
    of their own) and asks the policy to fold only steps with no such cycle; output stays
    plain decoding's."""
    prompts, params = _workload()
    ref = [o.token_ids for o in _llm(pair, "cpu", 512, spec=False).generate(prompts, params)]
    llm = LLM(pair[0], device="cpu", dtype="float32", decode_overlap="on",
              cache=CacheConfig(page_size=4, num_pages=512),
              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
              speculative_config=dict(algorithm="eagle3", draft_model=pair[1], num_steps=3,
                                      modes="tree2x2x4"))
    engine = llm.engine
    policy = engine.spec_policy = FoldAlways()
    asked_while_held, mixed_spec = [], []
    inner_fold, inner_execute = policy.fold, engine.executor.execute

    def fold(mode: str, decoding: list[str]) -> bool:
        if engine.drafter.modes[mode].cycles.holds_requests(decoding):
            asked_while_held.append(policy.steps)
        return inner_fold(mode, decoding)

    def execute(step):
        if step.spec_mode is not None and not step.fold and step.is_decode.any() \
                and not step.is_decode.all():
            mixed_spec.append(policy.steps)  # decodes speculate beside prefill chunks
        return inner_execute(step)

    policy.fold, engine.executor.execute = fold, execute
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    c = engine.drafter.counters
    assert asked_while_held == [], asked_while_held
    assert mixed_spec and c.mode_steps["fold"] == len(policy.folded) > 0, (mixed_spec, c)
    assert engine.drafter.cycles_launched_ahead > 0
