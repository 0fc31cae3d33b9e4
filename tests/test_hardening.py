"""Engine-side hardening: tiny temperatures decode greedily, seeded speculative sampling survives
preemption, the KV pool bounds the default max_tokens, stop-token lists are capped, and an
engine releases its memory on close() so several can be made in a row in one process."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve import defaults
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import Engine
from specserve.engine.spec_policy import ScriptedPolicy
from specserve.layers.sampler import Sampler, SamplingTensors, probs_from_logits
from specserve.llm import LLM
from specserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

PROMPTS = [[17, 230, 41, 99, 5], [3, 8, 400], [250, 251, 252, 253, 254, 255, 7], [42]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny_checkpoint(root / "t", tokenizer=True, num_hidden_layers=4)
    head = make_tiny_eagle3_head(str(root / "h"), target, draft_vocab_size=None)
    return target, head


def _config(target: str, num_pages: int, spec: dict | None = None) -> EngineConfig:
    config = EngineConfig(
        model=target,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        cache=CacheConfig(page_size=4, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    return config if spec is None else config.replace(spec=spec)


def _run(
    engine: Engine, params: list[SamplingParams], prompts: list = PROMPTS
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


# -- item 1: tiny temperatures -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-46, 1e-6, 9.99e-6])
def test_tiny_temperature_samples_greedily(temperature: float) -> None:
    """logits / T overflows float32 for T ~ 1e-38 (NaN) and T = 1e-46 is 0 in float32: both
    must give the argmax, decided once (host flags and device row agree)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 5
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(2)]
    params.append(SamplingParams(temperature=1.0, seed=9))  # a sampled row beside them
    st = SamplingTensors.build(params, [0, 1, 2], [5, 5, 5], 50, "cpu")
    assert params[0].greedy and st.any_greedy and not st.all_greedy
    probs = probs_from_logits(logits, st)
    assert torch.isfinite(probs).all()
    hot = torch.zeros_like(probs[:2]).scatter_(1, logits[:2].argmax(1, keepdim=True), 1.0)
    assert torch.equal(probs[:2], hot)
    assert torch.equal(Sampler()(logits, st)[:2], logits[:2].argmax(1))


def test_greedy_threshold_is_judged_in_float32() -> None:
    """Below 1e-5 (in float32) is greedy; from 1e-5 on the row samples, with finite probs."""
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9.999e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    st = SamplingTensors.build([SamplingParams(temperature=1e-5)], [0], [1], 10, "cpu")
    assert st.temperatures[0].item() > 0 and st.all_greedy is False
    assert torch.isfinite(probs_from_logits(torch.randn(1, 10) * 30, st)).all()


def test_tiny_temperature_engine_output_equals_greedy(pair: tuple[str, str]) -> None:
    engine = Engine(_config(pair[0], 256))
    greedy = _run(engine, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4)
    tiny = _run(
        engine,
        [
            SamplingParams(temperature=t, seed=s, max_tokens=8, ignore_eos=True)
            for s, t in enumerate([1e-38, 1e-40, 1e-46, 1e-39])
        ],
    )
    assert tiny == greedy


# -- item 9: seeded sampling under preemption ----------------------------------------------

SEEDED = [
    SamplingParams(temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(4)
]
CODE = ["def add(a, b):\n", "class Stack:\n", "import os\n", "for i in range(10):\n"]
SHAPES = {
    "plain": None,
    "chain": dict(num_steps=3),
    "tree": dict(num_steps=2, topk=2, num_draft_tokens=5),
}


@pytest.fixture(scope="module")
def trained_pair() -> tuple[str, str]:
    """The bundled code model and its EAGLE-3 head: a head that is accepted often."""
    draft = defaults.tiny_code_draft_path()
    if draft is None:
        pytest.skip("the bundled EAGLE-3 head is missing")
    return defaults.tiny_code_path(), draft


def _spec(head: str, shape: str) -> dict | None:
    return (
        None
        if SHAPES[shape] is None
        else dict(algorithm="eagle3", draft_model=head, **SHAPES[shape])
    )


@pytest.fixture(scope="module")
def roomy(trained_pair: tuple[str, str]) -> dict[str, dict[str, list[int]]]:
    """Seeded outputs with a pool that never preempts, per draft shape."""
    target, head = trained_pair
    return {
        shape: _run(Engine(_config(target, 256, _spec(head, shape))), SEEDED, CODE)
        for shape in SHAPES
    }


@pytest.mark.parametrize("shape", list(SHAPES))
def test_seeded_sampling_survives_preemption(
    trained_pair: tuple[str, str], roomy: dict, shape: str
) -> None:
    """A pool too small for the four requests at once preempts (recompute): re-prefill
    samples a token outside any cycle and shifts every later cycle's root. Each token is
    the draw of its own position, so the outputs equal those of a pool that never preempts."""
    target, head = trained_pair
    small = Engine(_config(target, 16, _spec(head, shape)))
    schedule, outputs_when_preempted = small.scheduler.schedule, []

    def spy(**kw):
        out = schedule(**kw)
        outputs_when_preempted.extend(r.num_output_tokens for r in out.preempted)
        return out

    small.scheduler.schedule = spy
    tight = _run(small, SEEDED, CODE)
    assert sum(n > 0 for n in outputs_when_preempted) >= 2, outputs_when_preempted
    if shape != "plain":
        assert small.drafter.counters.num_accepted_tokens > 10, "drafts were seldom accepted"
    assert tight == roomy[shape]


def test_seeded_output_independent_of_what_decides_each_token(
    trained_pair: tuple[str, str], roomy: dict
) -> None:
    """Same seed, same tokens whatever decides them: plain decoding, a chain of 3, a tree of 5,
    or speculation switched on and off step by step (plain steps between cycles)."""
    assert roomy["chain"] == roomy["tree"] == roomy["plain"]
    target, head = trained_pair
    engine = Engine(_config(target, 256, _spec(head, "chain")))
    engine.spec_policy = ScriptedPolicy([True, False, False])
    assert _run(engine, SEEDED, CODE) == roomy["plain"]
    assert engine.drafter.counters.num_catch_ups > 0  # the off steps really ran plain


# -- items 4 and 8: list caps, default max_tokens --------------------------------------------


def test_stop_token_ids_capped_and_kept_as_a_set(pair: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    engine = Engine(_config(pair[0], 256))
    stops = list(range(3, 3 + MAX_STOP_TOKEN_IDS))
    engine.add_request(
        "s", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops)
    )
    assert engine.get_request("s").stop_token_set == frozenset(stops)
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last.finish_reason == "stop" and last.new_token_ids[-1] in stops


def test_max_new_tokens_is_bounded_by_the_pool(pair: tuple[str, str]) -> None:
    """The room a server clamps an omitted max_tokens to: the context or the pool, whichever
    is smaller (less the slots kept ahead for drafts); the scheduler accepts exactly that."""
    target, head = pair
    for spec in (None, dict(algorithm="eagle3", draft_model=head, num_steps=3)):
        engine = Engine(_config(target, 8, spec))  # 8 pages x 4 = 32 slots, context 256
        sched = engine.scheduler
        ahead = max(sched.lookahead, sched.keep_ahead)
        room = sched.max_new_tokens(5)
        assert room == 32 - 5 - ahead
        engine.add_request("fits", [7] * 5, SamplingParams(max_tokens=room))
        with pytest.raises(ValueError, match=f"at most {room}"):
            engine.add_request("over", [7] * 5, SamplingParams(max_tokens=room + 1))
    big = Engine(_config(target, 1024))
    assert big.scheduler.max_new_tokens(5) == big.max_model_len - 5


# -- item 13: close() -----------------------------------------------------------------------


def _refs(llm: LLM) -> list[weakref.ref]:
    engine = llm.engine
    pool = [t for g in engine.runner.kv_pool.groups for t in g.tensors.values()]
    refs = [weakref.ref(t) for t in pool] + [weakref.ref(next(engine.runner.model.parameters()))]
    if engine.drafter is not None:
        refs.append(weakref.ref(next(engine.drafter.proposer.head.parameters())))
    return refs


def test_five_engines_in_a_row_release_their_memory(pair: tuple[str, str]) -> None:
    """`with LLM(...)`, close() and `del` each release the KV pool and the weights at once
    (checked with the cycle collector off: nothing waits for a later collection)."""
    target, head = pair
    spec = dict(algorithm="eagle3", draft_model=head, num_steps=2)
    kw = dict(
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    gc.disable()
    try:
        for i in range(5):
            params = SamplingParams(temperature=0, max_tokens=4)
            if i % 2 == 0:
                with LLM(target, speculative_config=spec if i == 2 else None, **kw) as llm:
                    refs = _refs(llm)
                    llm.generate([PROMPTS[0]], params)
                    llm.engine.add_request("left-running", PROMPTS[1], params)
                assert llm.engine.closed and not llm.engine.has_unfinished()
                with pytest.raises(RuntimeError, match="closed"):
                    llm.generate([PROMPTS[0]], params)
            elif i == 1:
                llm = LLM(target, **kw)
                refs = _refs(llm)
                llm.generate([PROMPTS[0]], params)
                del llm
            else:
                llm = LLM(target, speculative_config=spec, **kw)
                refs = _refs(llm)
                llm.close()
                llm.close()  # idempotent
            assert all(r() is None for r in refs), f"engine {i} still holds its tensors"
    finally:
        gc.enable()


@pytest.mark.gpu
def test_five_cuda_engines_in_a_row_size_the_same_pool(pair: tuple[str, str]) -> None:
    """On a GPU the pool is sized from free memory: a closed engine's pool, graphs and weights
    must be free again, or each next engine gets fewer pages (the 4th got 0)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pages = []
    for _ in range(5):  # each would get 80% of the one before if the last one held its pool
        with LLM(
            pair[0],
            device="cuda",
            dtype="float32",
            cache=CacheConfig(page_size=16, gpu_memory_utilization=0.2),
        ) as llm:
            pages.append(llm.engine.runner.num_pages)
            llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
    assert min(pages) >= 0.9 * pages[0], pages  # other test workers share the device
