"""The start-up warm-up of eager extends (worker/eager_warm.py): its forwards meet every
compiled specialization of the attention and split-combine kernels that a random eager extend
within the same limits meets, so nothing compiles inside a serving step.

The kernels are replaced by recorders of Triton's specialization key (constexpr values, launch
options, integer arguments' classes 1 / multiple of 16 / other unless not specialized, tensor
dtypes and 16-byte alignment); launches go through the Triton backend's own dispatch (decode
or extend, MHA/GQA or MLA) on CPU tensors, with an H200's 132 SMs for the split counts."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels import kv_store, mla_attention, mla_store, split_kv  # noqa: E402
from specserve.kernels import paged_attention as pa  # noqa: E402
from specserve.layers.backends.triton_backend import TritonBackend  # noqa: E402
from specserve.worker.eager_warm import extend_shapes, warm_extends  # noqa: E402
from specserve.worker.forward_batch import build_attention_metadata  # noqa: E402

MAX_TOKENS, MAX_ROWS, PAGE = 2048, 256, 16


class Recorder:
    """Stands in for a @jit kernel: kernel[grid](*args, **kwargs) records the key Triton would
    compile under."""

    def __init__(self, kernel, keys: set) -> None:
        fn = getattr(kernel, "fn", kernel)
        self.name = fn.__name__
        self.arg_names = list(kernel.arg_names)
        self.skip = {i if isinstance(i, int) else self.arg_names.index(i)
                     for i in kernel.do_not_specialize}
        self.keys = keys

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs) -> None:
        spec = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                spec.append((str(a.dtype), a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or not isinstance(a, int) or i in self.skip:
                spec.append(type(a).__name__)
            else:
                spec.append(1 if a == 1 else 16 if a % 16 == 0 else 0)
        self.keys.add((self.name, tuple(spec), tuple(sorted(kwargs.items()))))


@pytest.fixture
def keys(monkeypatch) -> set:
    out: set = set()
    monkeypatch.setattr(split_kv, "_num_sms", lambda device: 132)
    for mod, name in ((pa, "_paged_attention_kernel"), (split_kv, "_combine_splits_kernel"),
                      (mla_attention, "_mla_attention_kernel")):
        monkeypatch.setattr(mod, name, Recorder(getattr(mod, name), out))
    monkeypatch.setattr(kv_store, "store_kv", lambda *a, **k: None)
    monkeypatch.setattr(mla_store, "mla_store", lambda *a, **k: None)
    return out


def _mha(heads: int, kv_heads: int, dim: int):
    backend = TritonBackend()
    k_cache = torch.empty(4, PAGE, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)

    def run(q_lens: list[int], pages, md) -> None:
        t = sum(q_lens)
        q = torch.empty(t, heads, dim, dtype=torch.bfloat16)
        kv = torch.empty(t, kv_heads, dim, dtype=torch.bfloat16)
        backend.forward(q, kv, kv, k_cache, v_cache, md, 0.1)
    return run


def _mla(heads: int, rank: int = 512, rope: int = 64):
    backend = TritonBackend()
    cache = torch.empty(4, PAGE, rank + rope, dtype=torch.bfloat16)

    def run(q_lens: list[int], pages, md) -> None:
        t = sum(q_lens)
        backend.mla.absorbed(torch.empty(t, heads, rank, dtype=torch.bfloat16),
                             torch.empty(t, heads, rope, dtype=torch.bfloat16), cache, md, 0.1)
    return run


def _random_extends(run, rng: random.Random, n: int, max_tokens: int = MAX_TOKENS,
                    max_rows: int = MAX_ROWS) -> None:
    """n eager extends within the limits: rows of random query lengths (mostly short, as a
    catch-up's or a prompt tail's; all ones now and then: a decode-shaped launch)."""
    for _ in range(n):
        rows = min(max_rows, rng.choice([1, 2, 3, 5, 16, 40, 100, MAX_ROWS]))
        longest = rng.choice([1, 3, 7, 12, 20, 34, 64, 100, 300, 1000])
        q_lens = [rng.randint(1, longest) for _ in range(rows)]
        while sum(q_lens) > max_tokens:
            q_lens.pop()
        pages = [[0] * -(-q // PAGE) for q in q_lens]
        run(q_lens, pages, build_attention_metadata(q_lens, q_lens, pages, PAGE, "cpu"))


@pytest.mark.parametrize("limits", [(MAX_TOKENS, MAX_ROWS), (MAX_TOKENS, 16)],
                         ids=["256-rows", "16-rows"])
@pytest.mark.parametrize("make", [
    lambda: _mha(32, 8, 128),  # Llama-3.1-8B
    lambda: _mha(4, 2, 64),  # the bundled pair
    lambda: _mha(8, 1, 64),  # MQA
    lambda: _mha(16, 16, 64),  # MHA
    lambda: _mla(16),  # DeepSeek-V3's MLA on a TP-8 rank
    lambda: _mla(128),
], ids=["llama8b", "tiny-code", "mqa", "mha", "mla16", "mla128"])
def test_warm_up_meets_every_eager_specialization(keys, make, limits) -> None:
    """At 16 rows (a server or benchmark run with max_num_seqs 16) the grids that split no
    KV come only from long queries (a catch-up over hundreds of missed positions a row): on
    an H100 one compiled inside the bundled pair's timed adaptive run at C = 16."""
    run = make()
    max_tokens, max_rows = limits
    assert warm_extends(run, 0, PAGE, torch.device("cpu"), max_tokens, max_rows, "test") \
        == len(extend_shapes(max_tokens, max_rows))
    warmed = set(keys)
    assert {k[0] for k in warmed} >= {"_combine_splits_kernel"}
    _random_extends(run, random.Random(0), 400, max_tokens, max_rows)
    missing = keys - warmed
    assert not missing, f"{len(missing)} specializations compile after the warm-up: " \
        f"{sorted(missing)[:2]}"


def test_shapes_stay_within_the_limits() -> None:
    for max_tokens, max_rows in ((2048, 256), (64, 8), (5, 300), (1, 1)):
        shapes = extend_shapes(max_tokens, max_rows)
        assert shapes and all(sum(s) <= max_tokens and len(s) <= max_rows for s in shapes)
        # every row count from one to the limit's, doubling, for each query class
        assert [len(s) for s in shapes if s[0] == 1][-1] == min(max_rows, max_tokens)
    for max_len in (300, 64, 40):  # rows within max_len: the longest a power of two below it
        shapes = extend_shapes(2048, 16, max_len)
        assert max(s[0] for s in shapes) == 1 << (max_len.bit_length() - 1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from tiny_eagle import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("warm"))


def test_warm_forwards_write_nothing_the_engine_reads(pair) -> None:
    """The target's and the drafter's warm-up forwards (the engine runs them on a GPU with
    Triton; here on the CPU's torch backend) leave every page the allocator hands out as it
    was and read only K/V they wrote: both write the spare page only, and with every page
    NaN beforehand their outputs are finite. With a token budget past max_model_len + 256
    no row goes past the RoPE tables the CUDA graphs captured (a longer one replaced them,
    and on a GPU the replays read freed memory: wrong tokens from a speculative engine)."""
    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.worker.eager_warm import warm_drafters, warm_target

    llm = LLM(pair[0], speculative_config=dict(algorithm="eagle3", draft_model=pair[1],
                                               num_steps=3),
              device="cpu", dtype="float32", cache=CacheConfig(page_size=4, num_pages=64),
              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                        max_model_len=24))
    runner, drafter = llm.engine.runner, llm.engine.drafter
    proposers = {d.method: d.proposer for d in drafter.stateful}
    assert runner.max_positions == 24 + 256 < 512 < 1024  # 512: the model's own table
    tables = [m.cos_sin_cache for d in [runner.model] + [p.head for p in proposers.values()]
              for m in d.modules() if hasattr(m, "cos_sin_cache")]
    assert len(tables) == 2
    outs = []

    def recorded(fn):
        return lambda *a: outs.append(fn(*a)) or outs[-1]

    runner.forward = recorded(runner.forward)
    for p in proposers.values():
        p.extend = recorded(p.extend)
    pool = [t for g in runner.kv_pool.groups for t in g.tensors.values()]
    for t in pool:
        t.fill_(float("nan"))
    spare = runner.spare_page
    n = len(extend_shapes(1024, 4, runner.max_positions))
    assert n < len(extend_shapes(1024, 4))  # the cap binds: no row of 512 or 1024
    assert warm_target(runner) == n
    assert all(t[:, spare].isfinite().any() for t in pool)  # the target wrote its layers
    assert warm_drafters(runner, proposers) == n
    assert len(outs) == 2 * n and all(o.isfinite().all() and o.is_inference() for o in outs)
    for t in pool:
        assert t[:, :spare].isnan().all()
        assert t[:, spare].isfinite().any()
    after = [m.cos_sin_cache for d in [runner.model] + [p.head for p in proposers.values()]
             for m in d.modules() if hasattr(m, "cos_sin_cache")]
    assert all(a is b for a, b in zip(after, tables, strict=True))  # the same tensors


@pytest.mark.gpu
def test_no_kernel_compiles_while_serving_after_start_up() -> None:
    """The bundled pair on a GPU, speculation switched off and on every few steps (each
    switch on a catch-up of a few to a few dozen positions a row, eager), requests of mixed
    prompt lengths arriving together: no Triton kernel compiles after the engine started."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from specserve import defaults
    from specserve.bench.jit_watch import triton_compiles
    from specserve.engine.spec_policy import ScriptedPolicy
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    model, head = defaults.tiny_code_path(), defaults.tiny_code_draft_path()
    if head is None:
        pytest.skip("the tiny-code EAGLE-3 head is missing")
    llm = LLM(model, device="cuda", speculative_config={
        "method": "eagle3", "model": head, "num_speculative_tokens": 3})
    llm.engine.spec_policy = ScriptedPolicy([False] * 7 + [True] * 3 + [False] * 19 + [True])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.choice([5, 17, 40, 129, 300]))]
               for _ in range(48)]
    with triton_compiles() as compiles:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert llm.engine.drafter.counters.num_catch_ups > 0
    assert not compiles, f"compiled while serving: {dict(compiles)} {compiles.details[:3]}"


def test_engine_start_up_warms_and_serves_as_before(pair, monkeypatch) -> None:
    """With the warm-up's GPU gate forced open on the CPU, an engine starts by warming the
    target and its drafter (through the runner's and the speculative worker's own hooks), then
    generates greedily what an engine without the warm-up does, token for token."""
    from specserve.config import CacheConfig, SchedulerConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    from specserve.speculative import worker as spec_worker
    from specserve.worker import eager_warm, model_runner

    def make() -> LLM:
        return LLM(pair[0], speculative_config=dict(algorithm="eagle3", draft_model=pair[1],
                                                    num_steps=3),
                   device="cpu", dtype="float32",
                   cache=CacheConfig(page_size=4, num_pages=128),
                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))

    prompts = [list(range(3, 3 + n)) for n in (5, 11, 23)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in make().generate(prompts, params)]
    labels = []
    real = eager_warm.warm_extends

    def counted(run, page, page_size, device, max_tokens, max_rows, label, max_len):
        labels.append(label)
        return real(run, page, page_size, device, max_tokens, max_rows, label, max_len)

    monkeypatch.setattr(eager_warm, "warm_extends", counted)
    for mod in (model_runner, spec_worker):
        monkeypatch.setattr(mod, "warms", lambda runner: True)
    warmed = [o.token_ids for o in make().generate(prompts, params)]
    assert labels == ["target", "drafter eagle3"]
    assert warmed == plain
