"""Host structures of suffix decoding (speculative/suffix.py): torch-free.

`SequenceIndex` holds one token sequence and, for every n-gram of it with n <= max_len, the
indices right after its occurrences: appending a token costs max_len dict insertions, and the
occurrences of the context's last n tokens are one lookup (a suffix tree's query, truncated
at depth max_len). `OutputCache` keeps the outputs of finished requests in one such index,
LRU-bounded in requests. `draft_tree` turns the continuations of the matched occurrences into
a frequency-scored speculation tree.

Rule (what tests/test_suffix_index.py checks against a naive scan):
- match: the largest n <= max_len (and < the context length) such that the request's own
  sequence or a cached output holds an earlier occurrence of the context's last n tokens
  followed by at least one token;
- occurrences: the request's own, most recent first, then the cached outputs', most recently
  cached first, each capped at MAX_OCCURRENCES;
- counts: every prefix of each occurrence's continuation (up to `depth` tokens) counts once
  per occurrence; a path's probability is its count / the number of occurrences;
- tree: best first by (count desc, depth asc, first seen), a node only once its parent is in,
  at most `topk` children per node, probability >= min_prob, up to `num_nodes` nodes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, defaultdict

MAX_OCCURRENCES = 64  # per source (the request, the cached outputs): bounds a step's work


class SequenceIndex:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.tokens: list[int] = []
        self.ends: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)  # ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        seq, ends = self.tokens, self.ends
        for t in tokens:
            seq.append(t)
            i = len(seq)
            for n in range(1, min(self.max_len, i) + 1):
                ends[tuple(seq[i - n : i])].append(i)

    def keys(self) -> list[tuple[int, ...]]:
        return list(self.ends)


class OutputCache:
    """Outputs of up to `capacity` finished requests, one index over all of them (LRU)."""

    def __init__(self, max_len: int, capacity: int) -> None:
        self.max_len, self.capacity = max_len, capacity
        self.entries: OrderedDict[str, SequenceIndex] = OrderedDict()
        # n-gram -> {entry id: ends in that entry}, entries in insertion order
        self.ends: dict[tuple[int, ...], dict[str, list[int]]] = {}

    def add(self, key: str, tokens: list[int]) -> None:
        if not self.capacity or not tokens:
            return
        self.remove(key)
        entry = SequenceIndex(self.max_len)
        entry.append(tokens)
        self.entries[key] = entry
        for gram, ends in entry.ends.items():
            self.ends.setdefault(gram, {})[key] = ends
        while len(self.entries) > self.capacity:
            self.remove(next(iter(self.entries)))

    def remove(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        for gram in entry.keys():
            holders = self.ends[gram]
            del holders[key]
            if not holders:
                del self.ends[gram]

    def occurrences(self, gram: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(sequence, end) of the gram's occurrences followed by a token, newest entry first."""
        out: list[tuple[list[int], int]] = []
        holders = self.ends.get(gram, {})
        for key in reversed(holders):
            seq = self.entries[key].tokens
            for e in reversed(holders[key]):
                if e < len(seq):
                    out.append((seq, e))
                    if len(out) == MAX_OCCURRENCES:
                        return out
        return out


def own_occurrences(index: SequenceIndex, gram: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """The request's own occurrences followed by a token, most recent first (capped)."""
    seq, out = index.tokens, []
    for e in reversed(index.ends.get(gram, ())):
        if e < len(seq):
            out.append((seq, e))
            if len(out) == MAX_OCCURRENCES:
                break
    return out


def match(index: SequenceIndex, cache: OutputCache | None) -> list[tuple[list[int], int]]:
    """The occurrences of the longest matching suffix of index.tokens (see the module rule)."""
    seq = index.tokens
    for n in range(min(index.max_len, len(seq) - 1), 0, -1):
        gram = tuple(seq[len(seq) - n :])
        occ = own_occurrences(index, gram)
        if cache is not None:
            occ += cache.occurrences(gram)
        if occ:
            return occ
    return []


def draft_tree(occurrences: list[tuple[list[int], int]], depth: int, num_nodes: int,
               topk: int, min_prob: float) -> list[tuple[int, int]]:
    """Nodes (token, parent node index; 0 is the root, node j is index j + 1), parents first."""
    if not occurrences:
        return []
    count: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], int] = {}
    for seq, e in occurrences:
        cont = seq[e : e + depth]
        for d in range(1, len(cont) + 1):
            path = tuple(cont[:d])
            count[path] = count.get(path, 0) + 1
            first.setdefault(path, len(first))
    children: defaultdict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    for path in first:  # first-seen order
        children[path[:-1]].append(path)
    total = len(occurrences)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    kids = defaultdict(int)
    nodes: list[tuple[int, int]] = []
    heap = [(-count[p], 1, first[p], p) for p in children[()]]
    heapq.heapify(heap)
    while heap and len(nodes) < num_nodes:
        _, d, _, path = heapq.heappop(heap)
        parent = path[:-1]
        if kids[parent] >= topk or count[path] < min_prob * total:
            continue
        kids[parent] += 1
        nodes.append((path[-1], node_of[parent]))
        node_of[path] = len(nodes)
        for child in children[path]:
            heapq.heappush(heap, (-count[child], d + 1, first[child], child))
    return nodes
