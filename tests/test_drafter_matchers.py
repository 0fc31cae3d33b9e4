"""The model-free drafters' matching rules against naive Python references.

- ngram_match (vectorized, device): random token arrays over small vocabularies (many ties,
  repeated n-grams), several [min, max] ranges, rows too short to match and rows with no match,
  against a loop over n and end positions;
- the suffix structures (n-gram index, LRU output cache, frequency-scored tree): proposals
  against a scan of the raw sequences and a selection written as repeated full searches;
- the speculative config's keys for both methods.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.spec_config import speculative_config
from specserve.speculative.ngram import ngram_match
from specserve.speculative.suffix_index import (
    MAX_OCCURRENCES,
    OutputCache,
    SequenceIndex,
    draft_tree,
    match,
)


def naive_ngram(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the last n tokens, largest n
    in [lo, hi] first; [] without one."""
    length = len(seq)
    for n in range(hi, lo - 1, -1):
        if n > length - 1:
            continue
        suffix = seq[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first, before the suffix
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 4), (2, 3), (3, 5)])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_ngram_match_equals_naive_loop(lo: int, hi: int, vocab: int) -> None:
    rng = random.Random(vocab * 100 + lo * 10 + hi)
    bs, width, k = 24, 40, 3
    rows = [[rng.randrange(vocab) for _ in range(rng.randint(0, width - 8))] for _ in range(bs)]
    for row in rows[bs // 2 :]:  # plant a repeat: an earlier span copied to the end
        if len(row) > 2:
            a = rng.randrange(len(row) - 1)
            row += row[a : a + rng.randint(hi, hi + 3)][: width - len(row)]
    rows[0] = list(range(width))  # all distinct: no match
    rows[1] = [7]  # one token: nothing before it
    seq = torch.randint(0, vocab, (bs, width))  # stale values past each length: ignored
    for r, row in enumerate(rows):
        seq[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    length = torch.tensor([len(r) for r in rows])
    drafts, found = ngram_match(seq, length, k, lo, hi)
    for r, row in enumerate(rows):
        want = naive_ngram(row, k, lo, hi)
        assert found[r].item() == len(want), (r, row)
        assert drafts[r, : len(want)].tolist() == want, (r, row)
        assert (drafts[r, len(want) :] == -1).all()
    assert found[0] == 0 and found[1] == 0
    assert (found > 0).sum() >= bs // 3, "too few rows matched to test the rule"


def test_ngram_prefers_longest_then_most_recent() -> None:
    # the context ends "0 1 2": "0 1 2" occurred once (then 9 8), "1 2" also later (then 5 6)
    seq = [0, 1, 2, 9, 8, 3, 1, 2, 5, 6, 0, 1, 2]
    drafts, found = ngram_match(torch.tensor([seq]), torch.tensor([len(seq)]), 2, 1, 3)
    assert drafts[0].tolist() == [9, 8] == naive_ngram(seq, 2, 1, 3)  # "0 1 2" beats "1 2"
    drafts, _ = ngram_match(torch.tensor([seq]), torch.tensor([len(seq)]), 2, 1, 2)
    assert drafts[0].tolist() == [5, 6] == naive_ngram(seq, 2, 1, 2)  # most recent "1 2"


# -- suffix decoding ---------------------------------------------------------------------------
def naive_occurrences(own: list[int], outputs: list[list[int]],
                      max_len: int) -> list[tuple[list[int], int]]:
    """Scan the raw sequences: the longest suffix of `own` that occurs earlier in it or in an
    output with a token after it; own occurrences newest first, then outputs newest first."""
    for n in range(min(max_len, len(own) - 1), 0, -1):
        gram = own[len(own) - n :]
        mine = [(own, e) for e in range(len(own) - 1, n - 1, -1) if own[e - n : e] == gram]
        theirs = [(seq, e) for seq in reversed(outputs)
                  for e in range(len(seq) - 1, n - 1, -1) if seq[e - n : e] == gram]
        occ = mine[:MAX_OCCURRENCES] + theirs[:MAX_OCCURRENCES]
        if occ:
            return occ
    return []


def naive_tree(occ: list[tuple[list[int], int]], depth: int, num_nodes: int, topk: int,
               min_prob: float) -> list[tuple[int, int]]:
    """Each round, search every continuation path for the best one that may join."""
    paths: list[tuple[int, ...]] = []  # in first-seen order
    for seq, e in occ:
        cont = tuple(seq[e : e + depth])
        paths += [cont[:d] for d in range(1, len(cont) + 1) if cont[:d] not in paths]

    def count(p):
        return sum(1 for seq, e in occ if tuple(seq[e : e + len(p)]) == p)

    chosen: list[tuple[int, ...]] = []
    while len(chosen) < num_nodes:
        ok = [p for p in paths if p not in chosen
              and (len(p) == 1 or p[:-1] in chosen)
              and sum(1 for c in chosen if c[:-1] == p[:-1]) < topk
              and count(p) >= min_prob * len(occ)]
        if not ok:
            break
        chosen.append(min(ok, key=lambda p: (-count(p), len(p), paths.index(p))))
    return [(p[-1], 0 if len(p) == 1 else chosen.index(p[:-1]) + 1) for p in chosen]


@pytest.mark.parametrize("seed", range(6))
def test_suffix_proposals_equal_naive_scan(seed: int) -> None:
    rng = random.Random(seed)
    vocab, max_len = rng.choice([3, 6, 12]), rng.choice([2, 4, 8])
    cache = OutputCache(max_len, capacity=3)
    outputs: list[tuple[str, list[int]]] = []
    for i in range(5):  # two of five are evicted (LRU), one id is cached twice
        key = "dup" if i in (1, 3) else f"o{i}"
        out = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        cache.add(key, out)
        outputs = [(k, o) for k, o in outputs if k != key] + ([(key, out)] if out else [])
    kept = [o for _, o in outputs][-3:]
    assert len(cache.entries) == len(kept)
    index = SequenceIndex(max_len)
    own: list[int] = []
    for _ in range(8):  # grows in chunks, as the worker feeds it
        chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        index.append(chunk)
        own += chunk
        got_occ = match(index, cache)
        want_occ = naive_occurrences(own, kept, max_len)
        assert [(s is own or s == own, e) for s, e in got_occ] == [
            (s is own, e) for s, e in want_occ]
        for depth, nodes, topk, min_prob in [(3, 6, 2, 0.0), (4, 10, 3, 0.2), (2, 4, 1, 0.5)]:
            assert draft_tree(got_occ, depth, nodes, topk, min_prob) == naive_tree(
                want_occ, depth, nodes, topk, min_prob), (depth, nodes, topk, min_prob)


def test_suffix_tree_counts_and_no_match() -> None:
    index = SequenceIndex(4)
    index.append([5, 1, 2, 5, 1, 3, 5, 1, 2, 9, 5, 1])
    occ = match(index, None)  # "5 1" occurred 3 times: continued by 2, 3, 2
    assert [e for _, e in occ] == [8, 5, 2]
    assert draft_tree(occ, 2, 3, 2, 0.0) == [(2, 0), (3, 0), (9, 1)]  # 2 (x2) first
    assert draft_tree(occ, 2, 3, 2, 0.5) == [(2, 0)]  # 3 and "2 9" have 1/3 < 0.5
    fresh = SequenceIndex(4)
    fresh.append([1, 2, 3])
    assert match(fresh, None) == [] and draft_tree([], 3, 4, 2, 0.0) == []


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,msg", [
    ({"method": "ngram", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 4},
     "'topk': ngram drafts a chain"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "'prompt_lookup_min': 5 is above prompt_lookup_max 3"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "'prompt_lookup_max': must be >= 1"),
    ({"method": "eagle3", "model": "dummy", "prompt_lookup_max": 3},
     "'prompt_lookup_max': applies to method ngram only"),
    ({"method": "ngram", "suffix_max_match_len": 3}, "'suffix_max_match_len': applies to "
     "method suffix only"),
    ({"method": "suffix", "model": "x"}, "'model': 'x': method suffix takes no draft model"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2.0},
     "'suffix_decoding_min_token_prob': must be <= 1"),
    ({"method": "ngram", "lookup_max": 3}, "has an unknown key 'lookup_max'"),
])
def test_drafter_config_errors_name_the_key(cfg: dict, msg: str) -> None:
    with pytest.raises(ValueError, match="speculative_config " + msg.replace("(", r"\(")):
        speculative_config(cfg)


def test_drafter_config_defaults() -> None:
    ngram = speculative_config({"method": "ngram", "num_speculative_tokens": 5,
                                "prompt_lookup_max": 3})
    assert (ngram.lookup_range, ngram.num_steps, ngram.draft_model) == ((1, 3), 5, "")
    suffix = speculative_config({"method": "suffix", "topk": 2, "num_draft_tokens": 8,
                                 "suffix_decoding_max_cached_requests": 0})
    assert suffix.suffix_settings == (8, 0, 0.1)
