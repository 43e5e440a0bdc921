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
import threading
from functools import cache
from pathlib import Path

import numpy as np

from dynalm.core import weight_pages


@cache
def _libc_function(name: str) -> ctypes._CFuncPtr | None:
    """libc's ``name`` (None where there is no such libc function)."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library, use_errno=True), name) if library else None
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Collect garbage, then return the heap's free pages to the OS (where glibc can)."""
    gc.collect()
    if (trim := _libc_function("malloc_trim")) is not None:
        trim(0)


# Weights in memory: on 2 MiB pages where the kernel gives them (see ``weight_buffer``).
HUGE_PAGE = 2 << 20
_CHUNK = 32 << 20  # an arena's mapping: experts of 1-2 MB share one, a larger weight has its own
_ALIGN = 64  # each weight starts on a cache line
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages() -> bool:
    """Whether weights go to anonymous memory on transparent huge pages: unless
    ``$DYNALM_WEIGHT_PAGES=mapped`` (weights stay file-backed maps of the repack cache,
    ``core.weight_pages``), when the kernel has transparent huge pages and does not say
    ``never``."""
    return weight_pages.chosen() == "huge" and transparent_huge_pages()


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
    """Bump allocation from anonymous private mappings advised ``MADV_HUGEPAGE``. A piece
    of a huge page or more is faulted in by a thread of its own (``_populate``) while the
    caller fills it, a reserved run of pieces before the caller reaches them. A mapping
    lives while any array cut from it does (each holds it as its base): a model's weights
    free their pages when the model goes, but for the mapping still being filled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: np.ndarray | None = None
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > _CHUNK // 2:  # its own mapping: no chunk left half empty
            piece = self._mapping(nbytes)[:nbytes]
        else:
            with self._lock:
                start = self._room(nbytes)
                self._used = start + nbytes
                piece = self._chunk[start : start + nbytes]
        if nbytes >= HUGE_PAGE:
            _populate_beside(piece)
        return piece

    def reserve(self, each: int, count: int) -> None:
        """Have the next ``count`` pieces of ``each`` bytes that ``take`` hands out lie in
        one mapping (a new one if the current lacks the room), faulted in meanwhile."""
        if count > 0 and each <= _CHUNK // 2:  # (a larger piece gets a mapping of its own)
            nbytes = count * (-(-each // _ALIGN) * _ALIGN)
            with self._lock:
                start = self._room(nbytes)
                run = self._chunk[start : start + nbytes]
            _populate_beside(run)

    def _room(self, nbytes: int) -> int:
        """Where ``nbytes`` start in the current chunk: a new chunk if it lacks them."""
        start = -(-self._used // _ALIGN) * _ALIGN
        if self._chunk is None or start + nbytes > self._chunk.size:
            self._chunk, self._used, start = self._mapping(max(_CHUNK, nbytes)), 0, 0
        return start

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
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, their contents unchanged


def _populate_beside(region: np.ndarray) -> None:
    threading.Thread(target=_populate, args=(region,), daemon=True).start()


def _populate(region: np.ndarray) -> None:
    """Fault ``region``'s pages in (ctypes lets the GIL go for the call): a huge page's
    first write zeroes 2 MiB, and may wait for the kernel to compact memory or, in a
    virtual machine, for the host to back it (0.05-1.1 s for 700 MiB here, one minute to
    the next), which a thread of its own takes off the loading one. An older kernel
    refuses the advice: the pages then fault as they are written."""
    madvise = _libc_function("madvise")
    if madvise is not None:
        at = region.__array_interface__["data"][0]
        madvise(ctypes.c_void_p(at), ctypes.c_size_t(region.size), _MADV_POPULATE_WRITE)


def reserve_weights(each: int, count: int) -> None:
    """``count`` weights of ``each`` bytes are about to be made one after another (a step's
    newly routed experts): their memory is faulted in beside the making."""
    if huge_pages():
        _arena.reserve(each, count)


def weight_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` for a weight the kernels stream, on
    transparent huge pages (``huge_pages()`` says whether they are on). A decode step reads
    every weight once: on 4 KiB pages the hardware prefetcher stops at each page's end and
    every page costs a TLB walk. The OLMoE-shaped Q4_K_M file's decode: 1.11x the 4 KiB
    maps' (49.2 against 44.3 tokens/s, Zen 4, 2 threads; `benchmarks/revision_bench.py`)."""
    return _arena.take(nbytes)
