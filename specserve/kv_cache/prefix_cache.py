"""Automatic prefix caching: keys of full KV pages as a hash chain (torch-free).

Page j of a token sequence holds the KV of positions [j*ps, (j+1)*ps). Its key chains the
key of page j-1 with the page's tokens, so equal keys mean equal prefixes up to the page's
end, and the first key starts from the engine's identity (model, dtype, draft head), so
nothing computed by another model can match:

    key[-1] = sha256(identity)
    key[j]  = sha256(key[j-1] | tokens[j*ps : (j+1)*ps] | tokens[(j+1)*ps]  (next-token keying))

Next-token keying, with a drafter that keeps KV of its own (EAGLE-3): draft position i pairs
the target's feature f_i with token t_{i+1}, so the draft KV in a page's LAST slot depends on
the FIRST token of the next page. Such a page is keyed with that token too: a hit needs it to
match as well (a prefix shared up to exactly a page boundary reuses one page less), and in
exchange the draft KV of every cached page is exact and never recomputed (recomputing the
slot would mean writing a page other requests read).

Lookups leave the last token of a sequence out (at least one token is always run, so the page
it lands in is private: speculative verify writes and KV compaction past the valid KV can never
reach a shared page). The page table lives in kv_cache/allocator.py; the scheduler decides
when a page's KV is complete (target, and draft when keyed) and registers it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.kv_cache.allocator import PageAllocator


@dataclass
class PrefixCacheStats:
    """Counters with the meaning of vLLM's prefix-cache metrics (both in tokens): every
    admission of a request queries its whole length and hits its cached prefix."""

    queries: int = 0  # tokens of the requests looked up
    hits: int = 0  # of which were found cached
    requests: int = 0  # lookups (admissions, re-admissions after preemption included)


class PrefixCache:
    def __init__(
        self, allocator: PageAllocator, page_size: int, identity: str, key_next_token: bool = False
    ) -> None:
        """identity: everything besides the tokens that changes a page's KV (model, dtype,
        draft head and its aux layers). key_next_token: the pages hold draft KV that depends
        on the token after the page."""
        assert page_size >= 1
        self.allocator = allocator
        self.page_size = page_size
        self.stats = PrefixCacheStats()
        self.rekey(identity, key_next_token)

    def rekey(self, identity: str, key_next_token: bool) -> None:
        """Change what pages hold (speculation switched on or off) with no request in flight:
        pages cached before stay in the pool under keys nothing derives any more, and age out
        through the eviction order."""
        self.identity = identity
        self.key_next_token = key_next_token
        flag = b"\x01" if key_next_token else b"\x00"
        self._root = hashlib.sha256(identity.encode() + flag).digest()

    # -- keys ----------------------------------------------------------------------------------
    def num_keyable(self, num_tokens: int) -> int:
        """Full pages of a sequence of num_tokens tokens whose key is known."""
        return max(num_tokens - int(self.key_next_token), 0) // self.page_size

    def num_lookup(self, num_tokens: int) -> int:
        """Pages a lookup may match: full pages before the sequence's last token."""
        return max(num_tokens - 1, 0) // self.page_size

    def extend_keys(self, tokens: Sequence[int], keys: list[bytes], num_pages: int) -> None:
        """Grow `keys` (the keys of tokens' first pages, computed earlier) to num_pages."""
        ps, extra = self.page_size, int(self.key_next_token)
        assert num_pages * ps + extra <= len(tokens), (num_pages, len(tokens))
        prev = keys[-1] if keys else self._root
        for j in range(len(keys), num_pages):
            chunk = array("q", tokens[j * ps : (j + 1) * ps + extra]).tobytes()
            prev = hashlib.sha256(prev + chunk).digest()
            keys.append(prev)

    # -- lookup --------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], keys: list[bytes]) -> list[int]:
        """The cached pages of the longest cached prefix of `tokens` (its last token left
        out); `keys` is the sequence's key list, grown as needed. Nothing is referenced."""
        n = self.num_lookup(len(tokens))
        self.extend_keys(tokens, keys, n)
        return self.allocator.lookup(keys[:n])

    # -- registration --------------------------------------------------------------------------
    def cache_pages(
        self,
        tokens: Sequence[int],
        keys: list[bytes],
        pages: list[int],
        num_done: int,
        num_valid: int,
    ) -> int:
        """Register the full pages of a sequence whose KV covers [0, num_valid) and whose key
        is known, past the first num_done (done before); returns the new num_done. A page
        whose key another page holds already stays private (and uncached)."""
        n = min(num_valid // self.page_size, self.num_keyable(len(tokens)), len(pages))
        if n <= num_done:
            return num_done
        self.extend_keys(tokens, keys, n)
        for j in range(num_done, n):
            self.allocator.cache(pages[j], keys[j])
        return n

    def record(self, num_tokens: int, num_hit: int) -> None:
        """An admission looked up num_tokens tokens and reuses the first num_hit."""
        self.stats.requests += 1
        self.stats.queries += num_tokens
        self.stats.hits += num_hit
