"""The radix prefix cache on a pool without KV memory (page size 4 keeps ids readable):
token-exact matching with node splits and partial pages, insert, locks, LRU eviction,
and copy-on-write of a shared page through the KV manager."""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.core.kv_formats import kv_format
from dynalm.core.kv_storage import hadamard
from dynalm.errors import InvalidRequest
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.scheduler import KVCacheManager, Request

PS = 4


def make(n_pages: int = 16, n_layers: int = 0) -> tuple[PagePool, RadixCache]:
    pool = PagePool(n_layers, 1, 32, n_pages=n_pages, page_size=PS, dtype="f32")
    return pool, RadixCache(pool)


def cache_tokens(pool: PagePool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` (whole pages) as a finished sequence would: returns its pages."""
    pages = pool.allocate(len(tokens) // PS)
    cache.insert(tokens, pages)
    pool.release(pages)  # the sequence is gone; the cache keeps them
    return pages


def test_match_whole_pages_and_partial_page():
    pool, cache = make()
    seq = list(range(100, 112))  # three pages
    pages = cache_tokens(pool, cache, seq)
    assert cache.n_pages == 3 and (pool.refcount[pages] == 1).all()

    hit = cache.match(seq + [7])
    assert (hit.n_tokens, hit.pages) == (12, pages)
    hit = cache.match(seq[:10] + [7, 7, 7])  # diverges inside the third page
    assert (hit.n_tokens, hit.pages) == (10, pages)
    hit = cache.match([1, 2, 3])
    assert (hit.n_tokens, hit.pages) == (0, [])


def test_match_ending_inside_a_node_splits_it():
    pool, cache = make()
    seq = list(range(12))
    pages = cache_tokens(pool, cache, seq)
    hit = cache.match(seq[:8] + [50, 51, 52, 53, 54])
    assert (hit.n_tokens, hit.pages) == (8, pages[:2])
    (upper,) = cache.root.children.values()
    assert upper.pages == pages[:2] and upper is hit.node
    (lower,) = upper.children.values()
    assert lower.pages == pages[2:] and lower.tokens == tuple(seq[8:])
    # a branch below the split shares the upper part
    branch = seq[:8] + [50, 51, 52, 53]
    other = pool.allocate(3)
    node = cache.insert(branch, other)
    pool.release(other)
    assert len(upper.children) == 2 and node.pages == [other[2]]
    assert pool.n_free == 16 - 4  # other[:2] were duplicates: not taken by the cache
    assert cache.match(branch + [0]).pages == pages[:2] + [other[2]]


def test_locked_paths_survive_eviction_and_lru_order():
    pool, cache = make(n_pages=8)
    a = cache_tokens(pool, cache, [1] * 4 + [2] * 4)
    b = cache_tokens(pool, cache, [3] * 8)
    c = cache_tokens(pool, cache, [5] * 8)
    assert pool.n_free == 2 and cache.evictable_pages == 6
    cache.match([3] * 8 + [0])  # b is now more recent than a
    lock = cache.match([5] * 8 + [0]).node
    cache.lock(lock)
    assert cache.evictable_pages == 4

    assert cache.evict(1) == 2  # a whole leaf goes: the least recently used one (a)
    assert set(a) <= set(pool._free)
    assert cache.evict(100) == 2  # then b; c is locked
    assert set(b) <= set(pool._free) and (pool.refcount[c] == 1).all()
    cache.unlock(lock)
    assert cache.evictable_pages == 2
    assert cache.evict(100) == 2 and pool.n_free == 8 and cache.n_pages == 0


def test_eviction_frees_nothing_while_a_sequence_holds_the_page():
    pool, cache = make(n_pages=4)
    pages = cache_tokens(pool, cache, list(range(8)))
    pool.retain(pages)  # a running sequence shares them
    assert cache.evict(4) == 0 and cache.n_pages == 0
    assert pool.release(pages) == 2 and pool.n_free == 4


def test_copy_on_write_when_writing_into_a_shared_partial_page():
    """Two sequences share 6 tokens: one whole page and 2 tokens of the next, which the
    second sequence copies before its first write; the cached page stays intact."""
    pool, cache = make(n_pages=8, n_layers=1)
    kv = KVCacheManager(pool, cache)
    first = Request("a", [10, 11, 12, 13, 14, 15, 16, 17, 18], max_tokens=1)
    assert kv.match(first) == 0 and kv.allocate(first, first.num_tokens)
    values = np.asarray(first.token_ids, np.float32)[:, None, None] * np.ones((1, 1, 32))
    pool.storage.write(0, pool.slots(first.pages, 0, 9), values, values)
    first.num_computed_tokens = 9
    kv.cache_full_pages(first)  # pages 0 and 1 (8 tokens)
    kv.free(first)
    shared = list(cache.match(first.token_ids).pages)

    second = Request("b", [10, 11, 12, 13, 14, 15, 99, 98], max_tokens=1)
    assert kv.match(second) == 6
    assert second.pages == shared and pool.refcount[shared[1]] == 2
    assert kv.allocate(second, second.num_tokens)
    assert second.pages[0] == shared[0] and second.pages[1] != shared[1]
    assert pool.refcount[shared[1]] == 1  # back to the cache alone
    copied, _ = pool.storage.read(0, pool.slots(second.pages, 0, 8))
    np.testing.assert_array_equal(copied[:6, 0, 0], [10, 11, 12, 13, 14, 15])
    new = np.full((2, 1, 32), 99, np.float32)
    pool.storage.write(0, pool.slots(second.pages, 6, 8), new, new)
    original, _ = pool.storage.read(0, pool.slots(shared, 0, 8))
    np.testing.assert_array_equal(original[:, 0, 0], first.token_ids[:8])
    kv.free(second)
    assert cache.evict(100) == 2 and pool.n_free == 8


def test_disabled_cache_matches_nothing():
    pool = PagePool(0, 1, 32, n_pages=4, page_size=PS)
    cache = RadixCache(pool, enabled=False)
    pages = pool.allocate(2)
    cache.insert(list(range(8)), pages)
    assert cache.match(list(range(9))).n_tokens == 0 and cache.n_pages == 0


def test_q8_0_pages_round_trip_at_about_half_the_bytes_of_f16():
    rng = np.random.default_rng(0)
    f16 = PagePool(2, 3, 64, n_pages=4, page_size=PS, dtype="f16")
    q8 = PagePool(2, 3, 64, n_pages=4, page_size=PS, dtype="q8_0")
    assert q8.page_nbytes / f16.page_nbytes == 34 / 64
    # plus one recent buffer: 32 tokens of f16, 2 layers x 3 heads x 64 for k and v
    assert q8.nbytes - q8.page_nbytes == 32 * 2 * (2 * 3 * 64) * 2 and f16.nbytes == f16.page_nbytes
    k = rng.standard_normal((5, 3, 64)).astype(np.float32)
    slots = q8.slots([2, 0], 1, 6)
    q8.storage.write(1, slots, k, k)
    keys, values = q8.storage.read(1, slots)
    # values are quantised as they are, keys Hadamard-rotated: within half a step of the
    # quantised block either way (the inverse rotation averages a block's errors)
    for x, quantised in ((values, k), (keys, hadamard(k))):
        step = np.abs(quantised).reshape(5, 3, 2, 32).max(-1) / 127  # per block
        err = np.abs(x - k).reshape(5, 3, 2, 32).max(-1)
        assert (err <= 0.5 * step * 1.01 + 1e-6).all()


def test_unknown_kv_dtype_is_refused_by_name() -> None:
    for make in (
        lambda: PagePool(1, 1, 32, 4, dtype="bogus"),
        lambda: kv_format("bogus"),
    ):
        with pytest.raises(InvalidRequest, match="unknown KV cache dtype 'bogus'"):
            make()
