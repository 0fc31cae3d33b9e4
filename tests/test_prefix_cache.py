"""Prefix caching, torch-free: the refcounted allocator, the page keys and the scheduler.

- The allocator against a naive model (refcounts, a key table, LRU of unreferenced cached
  pages) over random mixes of allocate / share / cache / free.
- Page keys: a hash chain of the tokens, with next-token keying when pages hold draft KV.
- The scheduler over random workloads of prompts sharing prefixes at page and non-page
  boundaries, with arrivals, finishes, stop tokens, aborts, preemptions, speculative lookahead
  and a drafter that falls behind (plain steps) and catches up: a simulated runner writes the
  content each slot must hold (the tokens up to its position; for draft KV one more), and
  every check compares the pages a request reads with that content, asserts no write ever
  lands on a shared or cached page, and that the run ends with every page free or cached and
  every refcount zero.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from specserve.config import SchedulerConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache.allocator import OutOfPages, PageAllocator, pages_for
from specserve.kv_cache.prefix_cache import PrefixCache
from specserve.sampling_params import SamplingParams

# -- allocator ---------------------------------------------------------------------------------


def test_shared_page_lives_until_the_last_reference_then_is_evicted_lru() -> None:
    alloc = PageAllocator(4)
    a = alloc.allocate(2)
    assert alloc.cache(a[0], "k0") and alloc.cache(a[1], "k1")
    assert not alloc.cache(a[1], "k0")  # the key is another page's: nothing changes
    assert alloc.lookup(["k0", "k1", "k2"]) == a and alloc.lookup(["k1"]) == [a[1]]
    alloc.share(a)  # a second request holds them
    alloc.free(a)
    assert [alloc.refcount(p) for p in a] == [1, 1] and alloc.num_free == 2
    alloc.free(a)  # unreferenced now, still cached and findable, counted allocatable
    assert alloc.num_free == 4 and alloc.num_cached == 2 and alloc.lookup(["k0"]) == [a[0]]
    b = alloc.allocate(2)  # the never-used pages go first
    assert set(b).isdisjoint(a) and alloc.num_cached == 2
    # then the least recently released cached page: a block table is released last to
    # first, so the page extending the prefix (k1) goes before the one it extends (k0)
    c = alloc.allocate(1)
    assert c == [a[1]] and alloc.lookup(["k0", "k1"]) == [a[0]] and alloc.num_evictions == 1
    assert alloc.num_evictable([a[0], c[0]]) == 1
    alloc.share([a[0]])
    assert alloc.num_free == 0
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(b + c + [a[0]])
    alloc.check()
    assert alloc.num_free == 4 and all(alloc.refcount(p) == 0 for p in range(4))


def test_sharing_an_uncached_page_or_double_free_asserts() -> None:
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    with pytest.raises(AssertionError):
        alloc.share(pages[:1])
    alloc.free(pages)
    with pytest.raises(AssertionError):
        alloc.free(pages[:1])


def test_allocator_random_mixes_against_a_naive_model() -> None:
    rng = random.Random(0)
    for trial in range(40):
        num_pages = rng.randint(1, 12)
        alloc = PageAllocator(num_pages)
        refs = [0] * num_pages
        key_of: dict[int, str] = {}  # page -> key of the cached pages
        lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        held: list[list[int]] = []  # what "requests" hold, one list per reference
        for _ in range(300):
            op = rng.random()
            free_pages = num_pages - sum(r > 0 for r in refs)
            if op < 0.35:
                n = rng.randint(0, 4)
                if n > free_pages:
                    with pytest.raises(OutOfPages):
                        alloc.allocate(n)
                    continue
                never = [p for p in range(num_pages) if refs[p] == 0 and p not in key_of]
                got = alloc.allocate(n)
                # uncached pages first; then evictions in LRU order
                evicted = [p for p in got if p not in never]
                assert evicted == list(lru)[: len(evicted)]
                assert len(got) - len(evicted) == min(n, len(never))
                for p in evicted:
                    del lru[p]
                    del key_of[p]
                for p in got:
                    assert refs[p] == 0
                    refs[p] = 1
                held.append(got)
            elif op < 0.55 and held:
                pages = rng.choice(held)
                for p in pages:
                    if p not in key_of and rng.random() < 0.7:
                        key = f"k{trial}-{rng.randrange(30)}"
                        taken = key in key_of.values()
                        assert alloc.cache(p, key) == (not taken)
                        if not taken:
                            key_of[p] = key
            elif op < 0.7 and key_of:
                keys = [key_of[p] for p in rng.sample(sorted(key_of), rng.randint(1, len(key_of)))]
                found = alloc.lookup(keys)
                want = []
                by_key = {k: p for p, k in key_of.items()}
                for k in keys:
                    want.append(by_key[k])
                assert found == want
                assert alloc.num_evictable(found) == sum(refs[p] == 0 for p in found)
                alloc.share(found)
                for p in found:
                    lru.pop(p, None)
                    refs[p] += 1
                held.append(found)
            elif held:
                pages = held.pop(rng.randrange(len(held)))
                alloc.free(pages)
                for p in reversed(pages):
                    refs[p] -= 1
                    if refs[p] == 0 and p in key_of:
                        lru[p] = None
            alloc.check()
            assert [alloc.refcount(p) for p in range(num_pages)] == refs
            assert alloc.num_free == num_pages - sum(r > 0 for r in refs)
            assert alloc.num_cached == len(key_of)
        for pages in held:
            alloc.free(pages)
        alloc.check()
        assert alloc.num_free == num_pages


# -- page keys ---------------------------------------------------------------------------------


def test_keys_chain_the_tokens_and_the_identity() -> None:
    pc = PrefixCache(PageAllocator(8), 4, "model-a")
    a, b, c = [], [], []
    pc.extend_keys(list(range(12)), a, 3)
    pc.extend_keys(list(range(8)) + [99, 9, 10, 11], b, 3)
    assert a[:2] == b[:2] and a[2] != b[2]
    pc.extend_keys([5] + list(range(1, 12)), c, 3)
    assert all(x != y for x, y in zip(a, c))  # a change in page 0 changes every later key
    other = PrefixCache(PageAllocator(8), 4, "model-b")
    d: list[bytes] = []
    other.extend_keys(list(range(12)), d, 3)
    assert set(d).isdisjoint(a)
    assert pc.num_lookup(9) == 2 and pc.num_lookup(8) == 1  # the last token always runs
    assert pc.num_keyable(8) == 2


def test_next_token_keying_separates_pages_with_different_successors() -> None:
    pc = PrefixCache(PageAllocator(8), 4, "model", key_next_token=True)
    a, b = [], []
    pc.extend_keys([1, 2, 3, 4, 5], a, 1)
    pc.extend_keys([1, 2, 3, 4, 6], b, 1)
    assert a != b  # the draft KV in slot 3 pairs t3's feature with the token after it
    assert pc.num_keyable(8) == 1 and pc.num_keyable(9) == 2
    with pytest.raises(AssertionError):
        pc.extend_keys([1, 2, 3, 4], [], 1)  # the successor is not known yet
    plain = PrefixCache(PageAllocator(8), 4, "model")
    e: list[bytes] = []
    plain.extend_keys([1, 2, 3, 4], e, 1)
    assert e[0] not in (a[0], b[0])


# -- the scheduler -----------------------------------------------------------------------------


def _sched(
    pages: int, page_size: int, max_len: int, budget: int, seqs: int, draft: bool
) -> Scheduler:
    alloc = PageAllocator(pages)
    pc = PrefixCache(alloc, page_size, "sim", key_next_token=draft)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_waiting=1000)
    return Scheduler(cfg, alloc, page_size, max_len, eos_token_ids=(0,), prefix_cache=pc)


def test_cached_tokens_cost_no_budget_and_the_last_token_always_runs() -> None:
    s = _sched(pages=32, page_size=4, max_len=64, budget=6, seqs=4, draft=False)
    first = Request("a", list(range(1, 14)), SamplingParams(max_tokens=2, ignore_eos=True))
    s.add(first)
    while s.has_unfinished:
        out = s.schedule()
        s.update(out, [[7] if e.samples else [] for e in out.scheduled])
    assert s.allocator.num_cached == 3  # 13 prompt + 1 output tokens with KV: 3 full pages
    # the same prompt: 12 tokens cached, 1 run (a 6-token budget would need 3 steps otherwise)
    again = Request("b", list(range(1, 14)), SamplingParams(max_tokens=1))
    s.add(again)
    out = s.schedule()
    (e,) = out.scheduled
    assert (e.start, e.num_new_tokens, e.from_cache, out.num_tokens) == (12, 1, True, 1)
    assert again.num_cached_tokens == 12 and e.samples
    # a prompt that is exactly cached pages: its last page is recomputed (kept private)
    exact = Request("c", list(range(1, 13)), SamplingParams(max_tokens=1))
    s.add(exact)
    out = s.schedule()
    (e,) = [x for x in out.scheduled if x.request is exact]
    assert (e.start, e.num_new_tokens) == (8, 4)
    assert exact.page_ids[:2] == again.page_ids[:2] and exact.page_ids[2] != again.page_ids[2]
    stats = s.prefix_cache.stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 13 + 13 + 12, 12 + 8)


class _Sim:
    """The runner as the scheduler sees it: what each KV slot holds."""

    def __init__(self, s: Scheduler, draft: bool) -> None:
        self.s, self.draft = s, draft
        self.kv: dict[int, tuple] = {}  # slot -> the tokens up to its position
        self.dkv: dict[int, tuple] = {}  # slot -> the tokens up to its position + 1
        self.cov: dict[str, int] = {}  # the drafter's covered prefix per request id
        self.writes = 0

    def slot(self, r: Request, p: int) -> int:
        ps = self.s.page_size
        return r.page_ids[p // ps] * ps + p % ps

    def write(self, table: dict, r: Request, p: int, value: tuple) -> None:
        page = r.page_ids[p // self.s.page_size]
        alloc = self.s.allocator
        assert alloc.refcount(page) == 1 and not alloc.is_cached(page), (
            f"{r.request_id} writes position {p} into shared/cached page {page}"
        )
        table[self.slot(r, p)] = value
        self.writes += 1

    def check(self, running: list[Request]) -> None:
        alloc, ps = self.s.allocator, self.s.page_size
        alloc.check()
        refs: dict[int, int] = {}
        for r in running:
            assert len(set(r.page_ids)) == len(r.page_ids)
            for p in r.page_ids:
                refs[p] = refs.get(p, 0) + 1
            toks = r.all_token_ids
            for p in range(r.num_computed_tokens):
                assert self.kv.get(self.slot(r, p)) == tuple(toks[: p + 1]), (r, p)
            for p in range(self.cov.get(r.request_id, 0) if self.draft else 0):
                assert self.dkv.get(self.slot(r, p)) == tuple(toks[: p + 2]), (r, p)
            for j in range(r.num_cached_pages):
                assert (j + 1) * ps <= r.num_computed_tokens
        for p in range(alloc.num_total):
            assert alloc.refcount(p) == refs.get(p, 0), p
        assert alloc.num_free + len(refs) == alloc.num_total


def _prompts(rng: random.Random, n: int, ps: int, max_len: int, vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes with a few documents, cut at page and non-page boundaries."""
    docs = [[rng.randrange(1, vocab) for _ in range(max_len)] for _ in range(rng.randint(1, 3))]
    out = []
    for _ in range(n):
        doc = rng.choice(docs)
        kind = rng.random()
        if kind < 0.3:
            cut = ps * rng.randint(0, max_len // (2 * ps))  # a page boundary, then a new token
        else:
            cut = rng.randint(0, max_len // 2)
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(0 if cut else 1, 4))]
        out.append(doc[:cut] + tail)
    return out


def _run_sim(seed: int, draft: bool, totals: dict[str, int]) -> None:
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    max_len = rng.randint(8, 40)
    pages = rng.randint(pages_for(max_len // 2 + 4, ps), pages_for(3 * max_len, ps))
    budget = rng.randint(4, 24)
    s = _sched(pages, ps, max_len, budget, rng.randint(1, 5), draft)
    sim = _Sim(s, draft)
    vocab = 12
    arrivals: dict[int, list[Request]] = {}  # step -> requests arriving then
    for i, prompt in enumerate(_prompts(rng, rng.randint(3, 14), ps, max_len, vocab)):
        params = SamplingParams(
            max_tokens=rng.randint(1, 12),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(1, vocab)] if rng.random() < 0.2 else [],
        )
        arrivals.setdefault(rng.randint(0, 40), []).append(
            Request(f"r{i}", prompt[: max_len - 1], params)
        )
    admitted: list[Request] = []
    for t in range(3000):
        for r in arrivals.pop(t, []):
            try:
                s.add(r)
                admitted.append(r)
            except ValueError:
                pass  # can never fit the pool
        if rng.random() < 0.1:
            s.lookahead = rng.randint(0, min(3, budget - 1))
        if t < 200 and rng.random() < 0.04 and admitted:  # later: all must finish
            s.abort(rng.choice(admitted).request_id)
        out = s.schedule()
        for r in out.preempted:
            sim.cov.pop(r.request_id, None)
        totals["preemptions"] += len(out.preempted)
        plain = draft and rng.random() < 0.3  # the drafter is off for this step
        emitted, computed, covered = [], [], []
        for e in out.scheduled:
            r = e.request
            if e.from_cache:
                sim.cov[r.request_id] = e.start
                totals["hit_rows"] += 1
            elif e.start == 0:
                sim.cov[r.request_id] = 0
            end = e.start + e.num_new_tokens
            toks = r.all_token_ids
            for p in range(e.start, end):
                sim.write(sim.kv, r, p, tuple(toks[: p + 1]))
            for p in range(end, end + e.lookahead):  # verify nodes, draft scratch
                sim.write(sim.kv, r, p, ("node",))
                if draft and not plain:
                    sim.write(sim.dkv, r, p, ("scratch",))
            new: list[int] = []
            if e.samples:
                k = rng.randint(1, 1 + e.lookahead)  # accepted drafts + the bonus token
                new = [rng.choice([0] + list(range(1, vocab)) * 4) for _ in range(k)]
            seq = toks + new  # what the runner saw (tokens past a stop are dropped later)
            valid = end + max(len(new) - 1, 0)
            for p in range(end, valid):  # the accepted path, compacted into place
                sim.write(sim.kv, r, p, tuple(seq[: p + 1]))
            if draft and not plain:  # catch up, then extend over the new positions
                for p in range(sim.cov[r.request_id], valid):
                    sim.write(sim.dkv, r, p, tuple(seq[: p + 2]))
                sim.cov[r.request_id] = valid
            emitted.append(new)
            computed.append(valid - e.start)
            covered.append(sim.cov[r.request_id])
        s.update(out, emitted, computed, covered if draft else None)
        for r in admitted:
            if r.is_finished:
                sim.cov.pop(r.request_id, None)
        sim.check(s.running)
        if not s.has_unfinished and not arrivals:
            break
    assert not s.has_unfinished, "no progress"
    alloc = s.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_total
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_total))
    totals["hits"] += s.prefix_cache.stats.hits
    totals["queries"] += s.prefix_cache.stats.queries
    totals["evictions"] += alloc.num_evictions
    for r in admitted:
        assert r.is_finished and r.page_ids == [] and r.num_cached_pages == 0


@pytest.mark.parametrize("draft", [False, True], ids=["target", "target+draft"])
def test_random_workloads_with_shared_prefixes(draft: bool) -> None:
    totals = dict.fromkeys(("hits", "queries", "preemptions", "hit_rows", "evictions"), 0)
    for seed in range(300):
        _run_sim(seed, draft, totals)
    # the mixes did exercise what they are meant to check
    assert totals["hit_rows"] > 300 and totals["preemptions"] > 50 and totals["evictions"] > 50
    assert 0.1 < totals["hits"] / totals["queries"] < 0.9, totals
