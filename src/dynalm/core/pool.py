"""A native persistent worker pool for JIT kernels (Linux futexes, no per-call Python).

Each worker is a Python thread that makes one ctypes call into a JIT-compiled loop and
never comes back: it spins briefly on a generation counter, then sleeps on a futex. A job
is ``fn(args, lo, hi)`` over rows ``[0, total)``; every thread, the caller included, grabs
rows with one atomic compare-and-swap until none are left, then the caller waits for the
chunks still running. Grabs are guided: a quarter (with 2 threads) of the rows left, in
whole ``chunk``s, so each thread streams long runs of weights first (fewer cold starts of
the prefetchers: ~8 % faster decode than fixed chunks) and small grabs even out the end.
Publishing a job is a few stores and, only when someone sleeps, one futex wake, so a split
matmul costs microseconds, not a Python lock hand-off. A worker that the OS has not
scheduled simply gets no rows. A worker descheduled while holding a chunk makes the caller
wait; when that happens (the machine is oversubscribed) the caller runs the next jobs
alone for a while instead of collapsing (libgomp's long spin-wait did, see DESIGN.md).

The native code (the workers' loop, a job's publication, the program runner) is the
DynaKernel program ``kernel.pool_program``; this module owns the threads, the state buffer and
the records of native programs.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
from functools import cache

import numpy as np

from dynalm.core.buffers import require
from dynalm.kernel import backends, jit
from dynalm.kernel.pool_program import (
    FUNCTIONS,
    JOB_PARTS,
    PLAIN,
    POOL,
    RANGE,
    SPLIT,
    STATE_BYTES,
    SYS_FUTEX,
    SYSCALL,
)

__all__ = ["PLAIN", "RANGE", "SPLIT", "Pool", "Program", "available", "pool"]

_Worker = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Run = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
)
_Program = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@cache
def _request() -> backends.Request | None:
    """The pool's program for this platform (None where it has none); the symbol its
    code calls is made known to the JIT first."""
    machine = platform.machine().lower().replace("arm64", "aarch64").replace("amd64", "x86_64")
    if not sys.platform.startswith("linux") or machine not in SYS_FUTEX:
        return None
    libc_syscall = ctypes.CDLL(None).syscall
    jit.add_symbol(SYSCALL, ctypes.cast(libc_syscall, ctypes.c_void_p).value)
    # The pool's code uses no ISA extension: the portable backend lowers it, once.
    return backends.GENERIC, POOL, {"machine": machine}


@cache
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    request = _request()
    if request is None:
        return None
    backend, program, spec = request
    done = backend.lower(program, spec)
    kinds = (_Worker, _Run, _Program)
    return tuple(t(done.addresses[n]) for t, n in zip(kinds, FUNCTIONS, strict=True))


def available() -> bool:
    """Whether this platform has the native pool (Linux on x86-64 or AArch64); its code
    is compiled when a pool or program is first made."""
    return _request() is not None


def pending() -> list[backends.Request]:
    """The pool's program if it is not compiled yet (see ``backends.lower_all``)."""
    request = _request()
    return [request] if request and not request[0].lowered(*request[1:]) else []


class Pool:
    """``n_threads - 1`` native workers plus the calling thread."""

    def __init__(self, n_threads: int) -> None:
        functions = _functions()
        if functions is None:
            raise RuntimeError("the native worker pool needs Linux on x86-64 or AArch64")
        require(n_threads >= 1, f"a pool of {n_threads} threads")
        worker, self._run, self._program = functions
        self.n_threads = n_threads
        buf = np.zeros(STATE_BYTES + 64, np.uint8)  # cache-line aligned state words
        skip = -buf.__array_interface__["data"][0] % 64
        self._state = buf[skip : skip + STATE_BYTES]
        self._addr = self._state.__array_interface__["data"][0]
        self._state[JOB_PARTS : JOB_PARTS + 8].view(np.int64)[0] = 2 * n_threads
        self._lock = threading.Lock()  # one job at a time, whichever Python thread calls
        for k in range(1, n_threads):
            threading.Thread(
                target=worker, args=(self._addr,), daemon=True, name=f"dynalm-worker-{k}"
            ).start()

    def run(self, fn: int, args: int, total: int, chunk: int) -> None:
        """Run ``fn(args, lo, hi)`` over ``[0, total)`` in pieces of ``chunk``; return when
        all are done. ``fn`` is the address of a ``void (ptr, i64, i64)`` function."""
        _check_job(fn, args, total, chunk)
        with self._lock:
            self._run(self._addr, fn, args, total, chunk)

    def run_program(self, records: int, n: int) -> None:
        """Run the ``n`` records at address ``records`` (see ``Program``)."""
        with self._lock:
            self._program(self._addr, records, n)


def _check_job(fn: int, args: int, total: int, chunk: int) -> None:
    require(fn != 0 and args != 0, "a native call with a null function or argument block")
    require(total >= 0 and chunk >= 1, f"a job of {total} rows in chunks of {chunk}")


@cache
def pool(n_threads: int) -> Pool:
    """The process's pool of ``n_threads`` threads (created on first use, never stopped)."""
    return Pool(n_threads)


class Program:
    """Native calls run back to back by one call into the JIT (no Python between them):
    records ``(kind, fn, args, total, chunk)`` of kinds ``PLAIN`` ``fn(args)``, ``RANGE``
    ``fn(args, 0, total)`` and ``SPLIT`` (``fn`` over ``[0, total)`` on the pool of
    ``threads``; only with ``threads > 1``)."""

    def __init__(self, records: list[tuple[int, int, int, int, int]], threads: int) -> None:
        for kind, fn, args, total, chunk in records:
            require(kind in (PLAIN, RANGE, SPLIT), f"a program record of kind {kind}")
            require(kind != SPLIT or threads > 1, "a split record in a one-thread program")
            _check_job(fn, args, total, chunk if kind == SPLIT else 1)
        self._records = np.array(records, np.int64).reshape(-1, 5)
        self._n = len(self._records)
        self._at = self._records.__array_interface__["data"][0]
        split = bool((self._records[:, 0] == SPLIT).any())
        self._pool = pool(threads) if split else None
        self._program = _functions()[2]

    def __call__(self) -> None:
        if self._pool is not None:
            self._pool.run_program(self._at, self._n)
        else:
            self._program(None, self._at, self._n)
