"""Paged KV cache: one shared pool of fixed-size pages, reference counted.

A page holds ``page_size`` tokens of keys and values for every layer. Sequences
hold page tables (lists of page ids), never contiguous buffers, so pages can be
shared between sequences (prefix sharing) and returned individually.
"""

from __future__ import annotations

import numpy as np

from dynalm.errors import InvalidRequest

KV_DTYPES = {"f32": np.float32, "f16": np.float16}


class OutOfPages(Exception):
    """The pool has no free page left (the scheduler preempts or waits)."""


class PagePool:
    """KV memory for all sequences: ``k[layer]``/``v[layer]`` are
    ``[n_pages * page_size, n_kv_heads, head_dim]`` arrays indexed by slot."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int = 16,
        dtype: str = "f32",
    ):
        if dtype not in KV_DTYPES:
            raise InvalidRequest(
                f"unknown KV cache dtype '{dtype}' (choose from {', '.join(KV_DTYPES)})"
            )
        if n_pages < 1:
            raise InvalidRequest("the KV cache must hold at least one page")
        self.page_size = page_size
        self.n_pages = n_pages
        self.dtype = dtype
        shape = (n_pages * page_size, n_kv_heads, head_dim)
        self.k = [np.zeros(shape, KV_DTYPES[dtype]) for _ in range(n_layers)]
        self.v = [np.zeros(shape, KV_DTYPES[dtype]) for _ in range(n_layers)]
        self.refcount = np.zeros(n_pages, np.int32)
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        self.refcount[pages] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0, f"page {page} released twice"
            if self.refcount[page] == 0:
                self._free.append(page)


class PageTable:
    """The pages of one sequence, in token order; grows a page at a time."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    def reserve(self, n_tokens: int) -> None:
        """Make room for ``n_tokens`` tokens in total (raises OutOfPages)."""
        missing = -(-n_tokens // self.pool.page_size) - len(self.pages)
        if missing > 0:
            self.pages += self.pool.allocate(missing)

    def slots(self, start: int, stop: int) -> np.ndarray:
        """KV slots of token positions ``start..stop-1``."""
        pos = np.arange(start, stop)
        pages = np.asarray(self.pages, np.int64)
        return pages[pos // self.pool.page_size] * self.pool.page_size + pos % self.pool.page_size

    def as_array(self) -> np.ndarray:
        return np.asarray(self.pages, np.int64)

    def free(self) -> None:
        self.pool.release(self.pages)
        self.pages = []
