from __future__ import annotations

import math
import random

import pytest

from specserve.kv_cache.allocator import OutOfPages, PageAllocator, pages_for


def test_pages_for_matches_ceil() -> None:
    for page_size in (1, 2, 3, 16):
        for n in range(0, 70):
            assert pages_for(n, page_size) == math.ceil(n / page_size)


def test_allocate_free_counts() -> None:
    alloc = PageAllocator(5)
    assert (alloc.num_total, alloc.num_free) == (5, 5)
    a = alloc.allocate(3)
    assert len(a) == 3 and len(set(a)) == 3 and all(0 <= p < 5 for p in a)
    assert alloc.num_free == 2 and alloc.num_used == 3
    assert alloc.usage == pytest.approx(0.6)
    b = alloc.allocate(2)
    assert set(a).isdisjoint(b)
    assert alloc.num_free == 0 and alloc.allocate(0) == []
    alloc.free(a)
    assert alloc.num_free == 3


def test_out_of_pages_allocates_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)


def test_double_free_and_bad_ids_assert() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages[:1])
    with pytest.raises(AssertionError):
        alloc.free(pages[:1])
    with pytest.raises(AssertionError):
        alloc.free([pages[1], pages[1]])
    with pytest.raises(AssertionError):
        alloc.free([7])


def test_zero_pages_rejected() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)


def test_random_against_set_model() -> None:
    rng = random.Random(0)
    num_pages = 13
    alloc = PageAllocator(num_pages)
    owned: list[list[int]] = []  # reference model: the lists handed out and not yet freed
    for _ in range(2000):
        if owned and rng.random() < 0.5:
            alloc.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randint(0, 5)
            held = sum(len(x) for x in owned)
            if n > num_pages - held:
                with pytest.raises(OutOfPages):
                    alloc.allocate(n)
            else:
                owned.append(alloc.allocate(n))
        flat = [p for x in owned for p in x]
        assert len(flat) == len(set(flat)), "a page is owned twice"
        assert alloc.num_free == num_pages - len(flat)
    for x in owned:
        alloc.free(x)
    assert alloc.num_free == num_pages
