"""Process memory: hand freed heap back to the operating system, and place weights on
huge pages.

Loading builds large short-lived Python and numpy objects (a 262k-token vocabulary's
merges, repack temporaries). glibc keeps the freed memory in its arenas, where it still
counts in the resident set: 56 MB after loading a 262k-vocabulary tokenizer.
``malloc_trim`` returns it; elsewhere (musl, macOS) this is a no-op.

The matmul kernels' weights are read from memory by every decode step; ``weight_buffer``
gives them anonymous memory on transparent huge pages (the repack cache reads its files
into it rather than mapping them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import threading
from functools import cache
from pathlib import Path

import numpy as np

from dynalm.errors import InvalidRequest


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Collect garbage, then return the heap's free pages to the OS (where glibc can)."""
    gc.collect()
    if (trim := _malloc_trim()) is not None:
        trim(0)


# Weights in memory: on 2 MiB pages where the kernel gives them (see ``weight_buffer``).
HUGE_PAGE = 2 << 20
_CHUNK = 32 << 20  # an arena's mapping: experts of 1-2 MB share one, a larger weight has its own
_ALIGN = 64  # each weight starts on a cache line
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages() -> bool:
    """Whether weights go to anonymous memory on transparent huge pages: unless
    ``$DYNALM_WEIGHT_PAGES=mapped`` (weights stay file-backed maps of the repack cache), when
    the kernel has transparent huge pages and does not say ``never``."""
    choice = os.environ.get("DYNALM_WEIGHT_PAGES", "huge")
    if choice not in ("huge", "mapped"):
        raise InvalidRequest(
            f"$DYNALM_WEIGHT_PAGES: unknown value {choice!r} (choose huge or mapped)"
        )
    return choice == "huge" and transparent_huge_pages()


@cache
def transparent_huge_pages() -> bool:
    """Whether this kernel gives anonymous memory advised ``MADV_HUGEPAGE`` huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


class _Arena:
    """Bump allocation from anonymous private mappings advised ``MADV_HUGEPAGE``. A mapping
    lives while any array cut from it does (each holds it as its base): a model's weights
    free their pages when the model goes, but for the mapping still being filled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: np.ndarray | None = None
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > _CHUNK // 2:  # its own mapping: no chunk left half empty
            return self._mapping(nbytes)[:nbytes]
        with self._lock:
            start = -(-self._used // _ALIGN) * _ALIGN
            if self._chunk is None or start + nbytes > self._chunk.size:
                self._chunk, start = self._mapping(_CHUNK), 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes]

    @staticmethod
    def _mapping(nbytes: int) -> np.ndarray:
        """``nbytes`` of fresh memory starting on a huge page (the kernel maps a huge page
        only where a whole aligned 2 MiB of the range is the mapping's)."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        whole = np.frombuffer(m, np.uint8)
        skip = -whole.ctypes.data % HUGE_PAGE
        return whole[skip : skip + size]


_arena = _Arena()


def weight_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` for a weight the kernels stream, on
    transparent huge pages (``huge_pages()`` says whether they are on). A decode step reads
    every weight once: on 4 KiB pages the hardware prefetcher stops at each page's end and
    every page costs a TLB walk. The OLMoE-shaped Q4_K_M file's decode: 1.11x the 4 KiB
    maps' (49.2 against 44.3 tokens/s, Zen 4, 2 threads; `benchmarks/revision_bench.py`)."""
    return _arena.take(nbytes)
