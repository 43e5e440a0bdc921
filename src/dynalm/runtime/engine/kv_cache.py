"""Paged KV cache: one shared pool of fixed-size pages, reference counted.

A page holds ``page_size`` tokens of keys and values for every layer. Sequences
hold lists of page ids (page tables), never contiguous buffers, so pages can be
shared between sequences (prefix sharing) and returned individually.

Storage formats, one row each of ``core.kv_formats.KV_FORMATS``: ``f32``, ``f16``, and
``q8_0`` (int8 values with one f16 scale per 32 values of a slot's kv head, like GGUF Q8_0:
34 bytes per 32 values, ~53 % of f16). Values are quantised on write and dequantised on
read, one gather per sequence.

q8_0 keys are stored rotated, ``k @ H`` per 32-value block (``H`` the 32x32 Walsh-Hadamard
matrix, QuaRot-style): a few outlier channels would otherwise set every block's scale and
crush the other values to a few levels; rotated, each block's energy is spread evenly.
Attention rotates the query the same way (``q @ H . k @ H = 32 q . k``), so scores need no
inverse; ``read`` returns the keys un-rotated. This halves the logit error of q8_0 KV on
SmolLM2; rotating the values too gained ~3 % more, not worth an inverse per output.

A q8_0 pool also keeps each running sequence's last ``RECENT`` (32) tokens in f16, in a *recent
buffer* of its own (KIVI's full-precision residual): attention reads a query's keys and
values within ``RECENT`` positions of it from there (or, for the step's own tokens, from the
step's f32 keys rounded to f16), older ones from the q8_0 pages. Nearby tokens carry most of
the attention weight, so their quantisation error dominated. On SmolLM2 (exact mode, vs f16
KV, ``benchmarks/kv_fidelity.py``: 40 prompts x 64 tokens) the mean worst logit error per
token fell from 0.17 to 0.036, and free-running greedy text agreed on 98 % of tokens
instead of 69 %. The rule depends only on the query's and key's positions, so chunking and
batching do not change a result. A sequence's buffer holds the positions it computed itself
(from ``recent_from``, after a prefix-cache hit): keys from the cache are read as q8_0. A
buffer costs ``RECENT`` tokens of f16 per running sequence (a default pool of 16 x 4096
tokens: 0.539 of f16's bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dynalm.core.kv_formats import kv_format
from dynalm.core.kv_storage import HostKVStorage, KVGeometry
from dynalm.errors import InvalidRequest

if TYPE_CHECKING:
    from dynalm.core.device import Device
    from dynalm.core.kv_storage import KVStorage


class OutOfPages(Exception):
    """The pool has no free page left (the scheduler evicts, preempts or waits)."""


class PagePool:
    """The page accounting of the KV cache: page ids, refcounts, free pages and recent
    buffers. The bytes are the device's (``storage``, from ``Device.kv_storage``; without a
    device, host memory as the CPU keeps it): the attention op reads ``storage`` through the
    step's ``AttentionBatch.kv``. With ``n_layers=0`` the storage is empty and the pool only
    does the bookkeeping (unit tests, simulation)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int = 16,
        dtype: str = "f16",
        n_seqs: int = 1,
        device: Device | None = None,
    ):
        kv_format(dtype).check(head_dim)
        if n_pages < 1:
            raise InvalidRequest("the KV cache must hold at least one page")
        self.page_size = page_size
        self.n_pages = n_pages
        self.dtype = dtype
        geometry = KVGeometry(n_layers, n_kv_heads, head_dim, n_pages, page_size, dtype, n_seqs)
        self.storage: KVStorage = (
            device.kv_storage(geometry) if device is not None else HostKVStorage(geometry)
        )
        self.refcount = np.zeros(n_pages, np.int32)
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first
        self.recent = self.storage.recent  # tokens per recent buffer (0: none)
        self._free_recent = list(range(n_seqs - 1, -1, -1)) if self.recent else []

    @property
    def nbytes(self) -> int:
        """Bytes of the device's KV memory: pages (values and scales) and recent buffers."""
        return self.storage.nbytes

    @property
    def page_nbytes(self) -> int:
        return self.storage.page_nbytes

    @property
    def n_free(self) -> int:
        return len(self._free)

    # -- page bookkeeping ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        for page in pages:  # one at a time: a page may appear twice
            self.refcount[page] += 1

    def release(self, pages: Sequence[int]) -> int:
        """Drop one reference to each page; returns how many became free."""
        freed = 0
        for page in pages:
            self.refcount[page] -= 1
            if self.refcount[page] < 0:
                raise RuntimeError(f"page {page} released twice")
            if self.refcount[page] == 0:
                self._free.append(page)
                freed += 1
        return freed

    @property
    def n_free_recent(self) -> int:
        return len(self._free_recent)

    def open_recent(self) -> int:
        """A recent buffer for a sequence entering the running batch (q8_0 pools)."""
        if not self._free_recent:
            raise OutOfPages("every recent buffer is in use (one per running sequence)")
        return self._free_recent.pop()

    def close_recent(self, buffer: int) -> None:
        self._free_recent.append(buffer)

    def slots(self, pages: Sequence[int], start: int, stop: int) -> np.ndarray:
        """KV slots of token positions ``start..stop-1`` of a sequence with ``pages``."""
        pos = np.arange(start, stop)
        table = np.asarray(pages, np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size
