"""One engine, several drafters: the primary EAGLE-3 head plus the model-free ngram and
suffix drafters (modes 'ngram:chain3', 'suffix:tree2x3x6'), the policy choosing per step.

- config: a bad prefix, a drafter needing its own model as an extra, a bad shape: one line
  each; method keys of an extra method are allowed with the primary;
- the adaptive choice (cost model, no engine) picks ngram where its per-request acceptance is
  high and EAGLE-3 where ngram's is low;
- through the engine, on the bundled tiny-code pair: greedy output == plain decoding token
  for token while a scripted policy switches among eagle3 chain and tree, ngram chain, suffix
  tree and off (staggered arrivals, an abort, forced preemptions, prefix caching on); the
  head is caught up after ngram/suffix cycles and ngram after eagle3's; no state is left;
- the adaptive policy on copy-heavy prompts runs ngram steps and stays lossless;
- overlap launches ahead within a mode only; MTP as the primary with model-free extras, and
  as an extra next to EAGLE-3 (one capture, two feature views, its KV after the head's): the
  MTP extra drafts exactly the trees an MTP-only engine drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_drivers import record_preemptions
from test_mtp import spy_trees

from specserve import defaults
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import Engine
from specserve.engine.spec_policy import AdaptivePolicy, ScriptedPolicy
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_config import speculative_config

TINY, HEAD = defaults.tiny_code_path(), defaults.tiny_code_draft_path()
needs_head = pytest.mark.skipif(HEAD is None, reason="the tiny-code EAGLE-3 head is missing")
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
HYBRID = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3,
          "modes": "tree2x3x6,ngram:chain3,suffix:tree2x3x6", "prompt_lookup_max": 3}


@pytest.mark.parametrize("modes, why", [
    ("foo:chain2", "unknown method 'foo'"),
    ("eagle3:chain2", "method eagle3 needs a model of its own"),
    ("suffix:tree9", "write chainS"),
    ("ngram:tree2x3x6", "ngram drafts a chain"),
    ("draft_model:chain2", "method draft_model needs a model of its own"),
])
def test_bad_modes_are_one_line_errors(modes: str, why: str) -> None:
    with pytest.raises(ValueError) as exc:
        speculative_config({"method": "suffix", "modes": f"chain1,{modes}"})
    msg = str(exc.value)
    assert why in msg and repr(modes) in msg and "\n" not in msg, msg


def test_extra_methods_and_their_keys() -> None:
    spec = speculative_config({**HYBRID, "model": "dummy", "suffix_max_match_len": 5})
    assert spec.extra_methods == ["ngram", "suffix"]
    ngram, suffix = spec.for_method("ngram"), spec.for_method("suffix")
    assert (ngram.algorithm, ngram.num_steps, ngram.topk, ngram.lookup_range) == \
        ("ngram", 3, 1, (1, 3))
    assert (suffix.topk, suffix.verify_tokens, suffix.suffix_settings[0]) == (2, 6, 5)
    assert spec.for_method("eagle3").mode_names == ["tree2x3x6"]
    assert "extra drafters: ngram, suffix" in spec.describe()
    with pytest.raises(ValueError, match="prompt_lookup_max.*applies to method ngram"):
        speculative_config({"method": "eagle3", "model": "dummy", "prompt_lookup_max": 3})


def test_adaptive_choice_follows_each_drafters_acceptance() -> None:
    modes = {"chain3": ("eagle3", 1, 3), "ngram:chain3": ("ngram", 1, 3)}
    costs = {"off": {1: 1.0, 8: 2.0}, "chain3": {1: 1.3, 8: 3.0},
             "ngram:chain3": {1: 1.1, 8: 2.4}}  # ngram drafts cheaper (no head forwards)
    policy = AdaptivePolicy(modes, costs, dwell=1, explore_every=1000, rescale=0.0)
    for _ in range(20):
        policy.observe("chain3", {"copy": 1, "prose": 2}, None, 2)
        policy.observe("ngram:chain3", {"copy": 3, "prose": 0}, None, 2)
    est = policy.acceptance
    assert est.expected_tokens("copy", 1, 3, "ngram") > est.expected_tokens("copy", 1, 3)
    assert est.expected_tokens("prose", 1, 3, "ngram") < est.expected_tokens("prose", 1, 3)
    assert policy.choose(["copy"]) == "ngram:chain3", policy.last_scores
    for _ in range(2):
        pick = policy.choose(["prose"])
    assert pick == "chain3", policy.last_scores
    est.forget("copy")
    assert not est.tracks("copy")


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy outputs): slices of a source file, two that repeat a function
    (copy-heavy: the model copies it on), and one extending the first by 9 output tokens
    (cached prefix)."""
    llm = LLM(TINY, device="cpu", dtype="float32", enable_prefix_caching=False)
    src = Path(defaults.__file__).read_text()  # (not this file: its edits would move them)
    tok = llm.engine.tokenizer
    ids = tok.encode(src, add_special_tokens=False)
    prompts = [ids[:16]] + [ids[40 * i: 40 * i + 12 + 5 * i] for i in range(1, 5)]
    fn = src[src.index("def tiny_code_path"):][:150]  # ~50 tokens
    prompts += [tok.encode(t, add_special_tokens=False) for t in (fn + fn, fn + fn[:40])]
    first = llm.generate([prompts[0]], GREEDY)[0].token_ids
    prompts.append(prompts[0] + first[:9])
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


PATTERN = (["chain3"] * 2 + ["ngram:chain3"] * 3 + ["chain3"] + ["tree2x3x6"] * 2
           + ["suffix:tree2x3x6"] * 2 + [None] * 2 + ["ngram:chain3"] + ["tree2x3x6"]
           + ["suffix:tree2x3x6"] + ["ngram:chain3"] * 2)


@needs_head
@pytest.mark.slow
def test_switching_drafters_greedy_equals_plain(workload) -> None:
    prompts, plain = workload
    engine = Engine(EngineConfig(
        model=TINY, device="cpu", dtype="float32", spec=speculative_config(HYBRID),
        cache=CacheConfig(page_size=8, num_pages=20, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)))
    drafter = engine.drafter
    assert set(drafter.modes) == {"chain3", "tree2x3x6", "ngram:chain3", "suffix:tree2x3x6"}
    engine.spec_policy = ScriptedPolicy(PATTERN)
    preempted = record_preemptions(engine.scheduler)
    arrivals = {0: [0, 1], 3: [2], 5: [3, 4], 9: [5], 20: [6], 34: [7]}
    outputs: dict[int, list[int]] = {}
    aborted = None
    for step in range(2000):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], GREEDY)
            outputs[i] = []
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
        if step == 12 and engine.get_request("3") is not None:
            engine.abort_request("3")
            aborted = 3
        if step > max(arrivals) and not engine.has_unfinished():
            break
    for i, want in enumerate(plain):
        if i == aborted:
            assert want[:len(outputs[i])] == outputs[i]
        else:
            assert outputs[i] == want, i
    c = drafter.counters
    assert all(c.mode_steps[m] > 3 for m in ["off", *drafter.modes]), c.mode_steps
    assert all(c.method_drafts[m] > 5 for m in ("eagle3", "ngram", "suffix")), c.method_drafts
    # the head caught up over positions ngram/suffix cycles made, ngram over eagle3's
    assert c.method_catch_ups["eagle3"] > 3 and c.method_catch_ups["ngram"] > 3, c
    assert c.num_accepted_tokens > 10, c
    assert preempted, "the pool was sized to force preemptions"
    assert engine.prefix_cache is not None and engine.stats()["prefix_cache_hits"] > 0
    assert engine.allocator.num_free == engine.allocator.num_total
    assert not drafter.has_request_state(), "per-request state leaked"
    assert not drafter.proposers["suffix"].requests


@needs_head
@pytest.mark.slow
def test_adaptive_policy_runs_ngram_on_copy_heavy_prompts(workload) -> None:
    prompts, plain = workload
    copy = [5, 6]  # the prompts that repeat a stretch
    llm = LLM(TINY, device="cpu", dtype="float32",
              speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3,
                                  "modes": "ngram:chain3", "policy": "adaptive"})
    assert set(llm.engine.spec_cost_table) == {"off", "chain3", "ngram:chain3"}
    # a table where speculation pays (on this CPU it does not), exploring every 6 steps
    costs = {"off": {1: 1.0, 4: 1.2}, "chain3": {1: 1.2, 4: 1.5},
             "ngram:chain3": {1: 1.1, 4: 1.3}}
    modes = {n: (m.method, m.shape.topk, m.shape.num_steps)
             for n, m in llm.engine.drafter.modes.items()}
    llm.engine.spec_policy = AdaptivePolicy(modes, costs, dwell=2, explore_every=6,
                                            rescale=0.0, probe_budget=1.0)
    outs = llm.generate([prompts[i] for i in copy], GREEDY)
    assert [o.token_ids for o in outs] == [plain[i] for i in copy]
    c = llm.engine.drafter.counters
    assert c.mode_steps["ngram:chain3"] > 0 and c.method_drafts["ngram"] > 0, c.mode_steps
    assert c.method_accepted_tokens["ngram"] > 0, c


@needs_head
@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlap_launches_ahead_within_a_mode_only(workload, device: str) -> None:
    """--decode-overlap on: a cycle is launched ahead only for the next step of the same mode
    (a switch discards it) and output stays plain decoding's; a suffix extra (host-built
    trees) turns overlap off for the whole engine. On CUDA the cycles are graph replays."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    prompts, plain = workload
    if device == "cuda":
        ref = LLM(TINY, device=device, dtype="float32", enable_prefix_caching=False,
                  cache=CacheConfig(page_size=16, num_pages=128))
        plain = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    spec = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3,
            "modes": "ngram:chain3"}
    # fixed KV pools: three engines share one GPU in this process (sized by free memory, the
    # third found none left)
    pool = CacheConfig(page_size=16, num_pages=128)
    llm = LLM(TINY, device=device, dtype="float32", decode_overlap="on",
              speculative_config=spec, cache=pool)
    llm.engine.spec_policy = ScriptedPolicy(["chain3"] * 4 + ["ngram:chain3"] * 4 + [None])
    outs = llm.generate(prompts[:6], GREEDY)
    assert [o.token_ids for o in outs] == plain[:6]
    drafter = llm.engine.drafter
    assert drafter.overlap and drafter.cycles_launched_ahead > 5
    assert all(drafter.modes[m].cycles.cycles_launched_ahead > 0 for m in drafter.modes)
    assert drafter.counters.method_catch_ups.get("ngram", 0) > 0
    hybrid = LLM(TINY, device=device, dtype="float32", decode_overlap="on", cache=pool,
                 speculative_config={**spec, "modes": "ngram:chain3,suffix:tree2x3x6"})
    assert not hybrid.engine.drafter.overlap
    assert not any(m.cycles.overlap for m in hybrid.engine.drafter.modes.values())


@pytest.mark.slow
def test_mtp_primary_with_model_free_extras(tmp_path) -> None:
    """MTP (the target's own layer, reading its final hidden state) as the primary drafter and
    ngram / suffix as extras: greedy == plain while the script switches among them and off;
    MTP is caught up after the extras' cycles; no state is left."""
    import random

    from tiny_mtp import make_mtp_checkpoint

    path, _ = make_mtp_checkpoint(str(tmp_path / "ds"), "deepseek_v3")
    rng = random.Random(3)
    stretch = [rng.randrange(3, 500) for _ in range(10)]
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    prompts += [stretch * 3, stretch * 2 + stretch[:4]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, device="cpu", dtype="float32").generate(prompts,
                                                                                  params)]
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                  "modes": "ngram:chain3,suffix:tree2x3x6"})
    llm.engine.spec_policy = ScriptedPolicy(["chain2"] * 2 + ["ngram:chain3"] * 2
                                            + ["suffix:tree2x3x6"] * 2 + [None])
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    c = llm.engine.drafter.counters
    assert all(c.method_drafts[m] > 3 for m in ("mtp", "ngram", "suffix")), c.method_drafts
    assert c.method_catch_ups["mtp"] > 0, c
    assert not llm.engine.drafter.has_request_state()


@pytest.mark.slow
def test_mtp_extra_next_to_eagle3(tmp_path, monkeypatch) -> None:
    """EAGLE-3 (a random head) primary and the target's MTP layer as an extra drafter: the
    pool binds the MTP layer's KV after the head's, one capture serves both (the head's aux
    layers and the final hidden state), greedy == plain through switches; a target without
    an MTP layer is a one-line error."""
    import random

    from tiny_mtp import make_mtp_checkpoint

    path, _ = make_mtp_checkpoint(str(tmp_path / "ds"), "deepseek_v3")
    import specserve.engine.engine as engine_module

    checked = []  # the memory check sees the head and the extra MTP layer
    check_fits = engine_module.check_fits

    def spy(name, target, drafts, *a, **kw):
        checked.append([d.num_layers for d in drafts])
        return check_fits(name, target, drafts, *a, **kw)

    monkeypatch.setattr(engine_module, "check_fits", spy)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, device="cpu", dtype="float32").generate(prompts,
                                                                                  params)]
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": "dummy",
                                  "num_speculative_tokens": 2, "aux_layer_convention": "input",
                                  "modes": "mtp:chain2,ngram:chain3"})
    assert checked[-1] == [1, 1]  # the EAGLE-3 head's layer, then the MTP layer's block
    drafter = llm.engine.drafter
    final = drafter.proposers["mtp"].aux_layer_ids  # the final hidden state, after the head's
    assert drafter.capture.layer_ids[-1:] == final and len(drafter.views) == 2
    pattern = ["chain2", "mtp:chain2", "mtp:chain2", "ngram:chain3", None, "chain2", "chain2",
               "mtp:chain2"]
    llm.engine.spec_policy = ScriptedPolicy(pattern)
    trees = spy_trees(drafter.proposers["mtp"])
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    c = drafter.counters
    assert all(c.method_drafts[m] > 3 for m in ("eagle3", "mtp", "ngram")), c.method_drafts
    assert c.method_catch_ups["mtp"] > 0 and c.method_catch_ups["eagle3"] > 0, c
    # the random head and layer accept nothing: every cycle emits one token, like a plain
    # step, so an MTP-only engine off where the others ran drafts the very same trees (its
    # features then come from the same target positions, through its own capture)
    assert c.num_accepted_tokens == 0
    alone = LLM(path, device="cpu", dtype="float32", max_num_seqs=4,
                speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    alone.engine.spec_policy = ScriptedPolicy(["chain2" if m == "mtp:chain2" else None
                                               for m in pattern])
    want = spy_trees(alone.engine.drafter.proposer)
    assert [o.token_ids for o in alone.generate(prompts, params)] == ref
    assert trees == want and len(trees) > 10
    assert not drafter.has_request_state()
    with pytest.raises(ValueError) as exc:
        LLM(TINY, device="cpu", dtype="float32",
            speculative_config={"method": "ngram", "modes": "chain2,mtp:chain2"})
    assert "\n" not in str(exc.value) and "MTP" in str(exc.value).upper(), exc.value




@needs_head
@pytest.mark.slow
def test_switching_drafters_under_tensor_parallelism(workload) -> None:
    """TP 2 (a gloo worker process): the scripted switches among eagle3 chain/tree, ngram,
    suffix and off reach every rank in the step (each rank keeps its own drafters' state:
    ngram's history in its pages, suffix's host index, the head's KV shard), and the tokens
    are plain's."""
    prompts, plain = workload
    with LLM(TINY, device="cpu", dtype="float32", tensor_parallel_size=2,
             speculative_config=HYBRID, cache=CacheConfig(page_size=8, num_pages=64)) as llm:
        llm.engine.spec_policy = ScriptedPolicy(PATTERN)
        outs = llm.generate(prompts[:6], GREEDY)
        assert [o.token_ids for o in outs] == plain[:6]
        counters = llm.engine.drafter.counters
        ran = {m for m, n in counters.mode_steps.items() if n}
        assert ran >= {"chain3", "tree2x3x6", "ngram:chain3", "suffix:tree2x3x6", "off"}, ran
        assert counters.num_accepted_tokens > 0
