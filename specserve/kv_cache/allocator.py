"""Torch-free page allocator for the paged KV cache.

The KV pool is `num_pages` fixed-size pages shared by every layer; a request's block table is
the list of page ids it owns, and token position p of that request lives in slot
`page_ids[p // page_size] * page_size + p % page_size`. This class only hands out and takes
back page ids; the tensors live in kv_cache/pool.py.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    """Fewer free pages than asked for; nothing was allocated."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` KV entries (ceil division)."""
    assert num_tokens >= 0 and page_size > 0
    return -(-num_tokens // page_size)


class PageAllocator:
    """A free list over page ids 0..num_pages-1.

    Freed pages go to the back of the queue and pages are handed out from the front, so a page
    just released is the last to be reused (stale KV stays untouched for as long as possible,
    which makes use-after-free bugs visible in tests rather than silently aliased).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got num_pages={num_pages}")
        self._num_total = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._in_use = [False] * num_pages  # in_use[p] iff page p is owned by someone

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used / self._num_total

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; raise OutOfPages (allocating nothing) if fewer are free."""
        assert n >= 0, n
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            assert not self._in_use[p], f"page {p} handed out twice"
            self._in_use[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; each must currently be allocated (no double free)."""
        for p in pages:
            assert 0 <= p < self._num_total, f"page id {p} out of range"
            assert self._in_use[p], f"double free of page {p}"
            self._in_use[p] = False
            self._free.append(p)
