"""The speculative worker serves any proposer, and speculation stops and resumes per step.

- A trivial second proposer written here (each node's children repeat its token, then
  token + 1, + 2, ...: a chain at topk 1) runs through the same worker as EAGLE-3: greedy
  output == plain, chain and tree, with drafts accepted.
- EAGLE-3 under a policy forced off and on every few steps (and between chain and tree
  modes), with arrivals, aborts and preemptions: greedy requests give exactly the plain
  tokens, the proposer was caught up after off stretches (counted), every page returns to
  the pool. Both run on the CPU and (marked gpu) on CUDA, where every mode is a graph.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_drivers import random_workload, record_preemptions
from tiny_eagle import make_tiny_pair

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.spec_policy import ScriptedPolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.speculative.catch_up import pieces
from specserve.speculative.proposer import DraftShape
from specserve.speculative.tree import DraftTree, TreeAccumulator
from specserve.speculative.verify import VerifyResult

MAX_TOKENS = 24


class RepeatProposer:
    """Drafts without a model: the children of a node carrying token t are t, t + 1, ...,
    t + topk - 1 (scored in that order), so the chain repeats the root token."""

    needs_target_features = False
    aux_layer_ids: tuple[int, ...] = ()
    keeps_state = False
    state_dim = 0
    num_kv_layers = 0

    def __init__(self, runner) -> None:
        self.state_dtype = runner.dtype
        self.vocab = runner.model_config.vocab_size
        self.released: list[str] = []

    def scratch_slots(self, shape: DraftShape) -> int:
        return 0

    def propose(
        self,
        shape: DraftShape,
        state: torch.Tensor,
        root_pos: torch.Tensor,
        root_tokens: torch.Tensor,
        page_table: torch.Tensor,
        valid: torch.Tensor,
    ) -> DraftTree:
        k, bs, dev = shape.topk, root_tokens.shape[0], root_tokens.device
        logp = torch.linspace(0.9, 0.5, k, device=dev).log().expand(bs, k)
        offsets = torch.arange(k, device=dev)
        acc = TreeAccumulator(logp, (root_tokens[:, None] + offsets) % self.vocab, None)
        for _ in range(1, shape.num_steps):
            children = (acc.frontier_tokens[:, :, None] + offsets) % self.vocab  # [bs, k, k]
            acc.extend(logp[:, None, :].expand(bs, k, k), children)
        return acc.build(root_tokens, shape.num_draft_tokens)

    def extend_accepted(
        self,
        shape: DraftShape,
        result: VerifyResult,
        feats: torch.Tensor | None,
        root_pos: torch.Tensor,
        page_table: torch.Tensor,
        valid: torch.Tensor,
        window: torch.Tensor,
    ) -> torch.Tensor:
        assert feats is None
        return torch.zeros(root_pos.shape[0], 0, dtype=self.state_dtype, device=root_pos.device)

    def extend(
        self,
        starts: list[int],
        page_tables: list[list[int]],
        next_tokens: list[list[int]],
        feats: torch.Tensor | None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise AssertionError("a proposer without state is never fed")

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """CPU, and (marked gpu) CUDA, where every mode's cycle is a graph replay."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("prop"))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # repeated tokens: a tiny random model tends to continue them, so drafts get accepted
    return [
        [rng.randrange(3, 20)] * rng.randint(2, 6)
        + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        for _ in range(n)
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CACHE = CacheConfig(page_size=4, num_pages=512)


@pytest.fixture(scope="module")
def plain_outputs(pair, device: str) -> dict[tuple[int, ...], list[int]]:
    prompts = _prompts(8, seed=3)
    llm = LLM(pair[0], device=device, dtype="float32", cache=CACHE)
    return {tuple(p): o.token_ids for p, o in zip(prompts, llm.generate(prompts, GREEDY))}


@pytest.mark.parametrize(
    "shape", [dict(num_steps=3, topk=1), dict(num_steps=3, topk=3, num_draft_tokens=7)]
)
def test_second_proposer_is_lossless(pair, device: str, plain_outputs, shape: dict) -> None:
    llm = LLM(
        pair[0],
        device=device,
        dtype="float32",
        cache=CACHE,
        proposer=RepeatProposer,
        speculative_config=SpecConfig(**shape),
    )
    prompts = [list(p) for p in plain_outputs]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == plain_outputs[tuple(p)], p
        assert o.spec_cycles > 0
    c = llm.engine.drafter.counters
    assert c.num_accepted_tokens > 0, "no draft was ever accepted: the accept path is untested"
    proposer = llm.engine.drafter.proposer
    assert isinstance(proposer, RepeatProposer)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_total


SWITCHING = {
    "chain3": dict(num_steps=3, topk=1),
    "tree4x3x8": dict(num_steps=3, topk=4, num_draft_tokens=8, modes="chain1,tree2x2x4"),
}


NUM_PAGES = 40  # small enough to force preemptions


def _drive(pair, spec: dict | None, pattern: list[str | None] | None, overlap: str, seed: int,
           device: str, catch_up_tokens: int | None = None, states: list | None = None):
    engine = Engine(
        EngineConfig(
            model=pair[0],
            device=device,
            dtype="float32",
            decode_overlap=overlap,
            spec=SpecConfig(algorithm="eagle3", draft_model=pair[1], **spec)
            if spec
            else SpecConfig(),
            cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6),
        )
    )
    if pattern is not None:
        engine.spec_policy = ScriptedPolicy(pattern)
    if catch_up_tokens is not None:
        engine.drafter.catch_up_tokens = catch_up_tokens
    if states is not None:  # each catch-up's state rows and covered positions, in order
        worker, inner = engine.drafter, engine.drafter._catch_up

        def spy(d, rows):
            due = [rid for rid in rows.request_ids if d.pending.get(rid)]
            inner(d, rows)
            states.extend((rid, d.covered[rid], d.state[rid].clone()) for rid in due)

        worker._catch_up = spy
    preempted = record_preemptions(engine.scheduler)
    params: dict[str, SamplingParams] = {}
    outs = random_workload(
        engine, seed, max_tokens=40, arrival_p=0.25, arrivals_until=60, params_out=params
    )
    return outs, params, engine, preempted


@pytest.fixture(scope="module")
def plain_workload(pair, device: str) -> dict:
    return _drive(pair, None, None, "off", seed=4, device=device)[0]


@pytest.mark.parametrize("name", list(SWITCHING))
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_switching_speculation_off_and_on_is_lossless(
    pair, device: str, plain_workload, name: str, overlap: str
) -> None:
    ref = plain_workload
    spec = SWITCHING[name]
    # on for 3 steps, off for 4, on for 1, off for 2 (every transition, short and long), and
    # with several modes, chain <-> tree <-> off
    extra = [m for m in spec.get("modes", "").split(",") if m]
    pattern = [name] * 3 + [None] * 4 + [name] + [None] * 2 + [m for m in extra for _ in (0, 1)]
    got, params, engine, preempted = _drive(pair, spec, pattern, overlap, seed=4, device=device)
    compared = 0
    for rid, (tokens, reason) in got.items():
        if not params[rid].greedy or "abort" in (reason, ref[rid][1]):
            continue  # sampled tokens differ by design; aborts land at different points
        assert tokens == ref[rid][0], rid
        compared += 1
    assert compared >= 8
    c = engine.drafter.counters
    assert c.num_drafts > 20 and c.num_catch_ups > 5 and c.num_catch_up_tokens > c.num_catch_ups
    assert all(c.mode_steps[m] > 5 for m in [name, "off", *extra]), c.mode_steps
    assert engine.allocator.num_free == engine.allocator.num_total
    assert preempted, "the pool was sized to force preemptions"
    assert not engine.drafter.covered and not engine.drafter.state, "per-request state leaked"


def test_catch_up_pieces_cover_every_position_once() -> None:
    for lengths, budget in [([5, 1, 7, 0, 3], 4), ([10], 3), ([2, 2], 10), ([1] * 5, 1)]:
        forwards = pieces(lengths, budget)
        covered = [[] for _ in lengths]
        for forward in forwards:
            assert 0 < sum(b - a for _, a, b in forward) <= budget
            assert len({r for r, _, _ in forward}) == len(forward)  # a row once a forward
            for r, a, b in forward:
                covered[r].extend(range(a, b))
        assert covered == [list(range(n)) for n in lengths]
        assert len(forwards) == -(-sum(lengths) // budget)  # every forward full but the last


def test_catch_up_in_pieces_is_lossless(pair, device: str, plain_workload) -> None:
    """Long off stretches caught up in forwards of 3 tokens (rows split between forwards):
    greedy output == plain, the pieces really split rows, and the drafter's state rows after
    them are the one-forward catch-up's (losslessness alone would not see a wrong feature or
    position in a piece: the tiny random pair accepts nothing)."""
    pattern = ["chain3"] * 2 + [None] * 6
    one: list = []
    whole = _drive(pair, SWITCHING["chain3"], pattern, "off", seed=4, device=device,
                   states=one)[2]
    split: list = []
    got, params, engine, _ = _drive(pair, SWITCHING["chain3"], pattern, "off", seed=4,
                                    device=device, catch_up_tokens=3, states=split)
    assert len(split) == len(one) > 8
    for (rid, covered, row), (rid1, covered1, row1) in zip(split, one):
        assert (rid, covered) == (rid1, covered1)
        torch.testing.assert_close(row, row1, rtol=1e-5, atol=1e-5)
    compared = 0
    for rid, (tokens, reason) in got.items():
        if params[rid].greedy and "abort" not in (reason, plain_workload[rid][1]):
            assert tokens == plain_workload[rid][0], rid
            compared += 1
    assert compared >= 8
    c = engine.drafter.counters
    assert c.num_catch_up_tokens > 3 * c.num_catch_ups > 0, c  # rows longer than a forward
    w = whole.drafter.counters
    assert (c.num_catch_up_tokens, c.num_drafts) == (w.num_catch_up_tokens, w.num_drafts)
    assert engine.allocator.num_free == engine.allocator.num_total
