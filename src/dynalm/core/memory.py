"""Process memory: hand freed heap back to the operating system.

Loading builds large short-lived Python and numpy objects (a 262k-token vocabulary's
merges, repack temporaries). glibc keeps the freed memory in its arenas, where it still
counts in the resident set: 56 MB after loading a 262k-vocabulary tokenizer.
``malloc_trim`` returns it; elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache


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
