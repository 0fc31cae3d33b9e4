"""Torch-free page allocator for the paged KV cache, with reference counts and cached pages.

The KV pool is `num_pages` fixed-size pages shared by every layer; a request's block table is
the list of page ids it owns, and token position p of that request lives in slot
`page_ids[p // page_size] * page_size + p % page_size`. This class only hands out and takes
back page ids; the tensors live in kv_cache/pool.py.

Every page is in exactly one of three states:

    free         in the free list, holds nothing anyone can find
    referenced   refcount >= 1: in the block table of that many requests
    evictable    refcount 0 but cached under a key (kv_cache/prefix_cache.py): its KV stays
                 until the page is needed, least recently released first

A page carries a key once `cache` registered it (its KV is complete and will never be written
again); requests whose prefix has that key `share` it instead of computing it. A free or
evictable page is allocatable: `num_free` counts both, and `allocate` takes free pages first,
then evicts the least recently used evictable ones (dropping their keys).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable


class OutOfPages(Exception):
    """Fewer allocatable pages than asked for; nothing was allocated."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` KV entries (ceil division)."""
    assert num_tokens >= 0 and page_size > 0
    return -(-num_tokens // page_size)


class PageAllocator:
    """Free list, reference counts and the key -> page table of cached pages.

    Freed pages without a key go to the back of the free list and pages are handed out from
    the front, so a page just released is the last to be reused (stale KV stays untouched for
    as long as possible, which makes use-after-free bugs visible in tests rather than silently
    aliased).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got num_pages={num_pages}")
        self._num_total = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages  # requests holding each page
        self._key: list[Hashable | None] = [None] * num_pages  # the key a cached page is under
        self._by_key: dict[Hashable, int] = {}
        # cached pages no request holds, least recently released first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # cached pages whose KV was dropped to reuse the page

    # -- counts --------------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some request holds."""
        return self._num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages holding cached KV (held or evictable)."""
        return len(self._by_key)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1] (evictable pages count as free)."""
        return self.num_used / self._num_total

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return self._key[page] is not None

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- private pages -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1); raise OutOfPages (allocating nothing) if fewer are
        allocatable. Free pages go first, then the least recently released cached ones."""
        assert n >= 0, n
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key[p]]
                self._key[p] = None
                self.num_evictions += 1
            assert self._refs[p] == 0, f"page {p} handed out twice"
            self._refs[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page (no double free). A page nobody holds any more goes
        back to the free list, or, when cached, to the most recent end of the eviction order.
        Give a block table in order: its pages are released last to first, so the deeper pages
        of a prefix (the least shareable) are evicted before the pages they extend."""
        pages = list(pages)
        for p in reversed(pages):
            assert 0 <= p < self._num_total, f"page id {p} out of range"
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            if self._key[p] is None:
                self._free.append(p)
            else:
                self._evictable[p] = None

    # -- cached pages --------------------------------------------------------------------------
    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The cached pages of the longest prefix of `keys` found (nothing is referenced)."""
        pages = []
        for key in keys:
            p = self._by_key.get(key)
            if p is None:
                break
            pages.append(p)
        return pages

    def num_evictable(self, pages: Iterable[int]) -> int:
        """How many of these pages nobody holds (sharing them takes them off the free count)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def share(self, pages: Iterable[int]) -> None:
        """Take one reference to each cached page (as found by `lookup`)."""
        for p in pages:
            assert self._key[p] is not None, f"page {p} is not cached: it cannot be shared"
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def cache(self, page: int, key: Hashable) -> bool:
        """Register a held page's (complete, never again written) KV under `key`. False, and
        nothing changes, when another page holds that key already (the page stays private)."""
        assert self._refs[page] > 0, f"page {page} is not held"
        if key in self._by_key:
            return self._by_key[key] == page
        assert self._key[page] is None, f"page {page} is cached under another key"
        self._key[page] = key
        self._by_key[key] = page
        return True

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        for p in range(self._num_total):
            in_free, in_lru = p in free, p in self._evictable
            if self._refs[p] > 0:
                assert not in_free and not in_lru, p
            else:
                assert in_free != in_lru, p
                assert in_lru == (self._key[p] is not None), p
        assert all(self._by_key[k] == p for p, k in enumerate(self._key) if k is not None)
        assert len(self._by_key) == sum(k is not None for k in self._key)
