"""The native pool's answer to a stalled worker: a few jobs on the caller alone, more while
stalls follow each other, fewer again once the pool runs clean (``kernel.pool``).

The stalling job is a Python callback (ctypes releases the GIL around the pool's call, so
a worker can enter it): on the worker it sleeps, as a virtual CPU whose time the hypervisor
takes; the caller's first chunk waits until the worker holds one, so the caller surely
waits for it. The other jobs are a native kernel (the streaming-read probe), so no GIL
hand-off makes a worker late.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from dynalm.core import pool
from dynalm.kernel import backends, probes
from dynalm.kernel.pool_program import BACKOFF, SOLO, SOLO_FIRST, SOLO_MAX

pytestmark = pytest.mark.skipif(not pool.available(), reason="no native pool here")

ROWS = 64
_JOB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


class Stall:
    """A pool job whose worker chunks sleep ``stall`` seconds."""

    def __init__(self, stall: float = 0.05) -> None:
        self.main = threading.get_ident()
        self.stall = stall
        self.worker_in = threading.Event()
        self.fn = _JOB(self._run)  # kept alive as long as the job
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value
        self.args = np.zeros(1, np.int64)

    def _run(self, _args: int, lo: int, hi: int) -> None:
        if threading.get_ident() != self.main:
            self.worker_in.set()
            time.sleep(self.stall)
        else:
            self.worker_in.wait(1.0)

    def run(self, p: pool.Pool) -> None:
        self.worker_in.clear()
        p.run(self.address, self.args.ctypes.data, ROWS, 1)


class Native:
    """The streaming-read probe over 64 pages: a job no Python takes part in."""

    def __init__(self) -> None:
        self.fn = backends.GENERIC.lower(probes.STREAM, {}).addresses[""]
        self.buf = np.ones(ROWS * probes.PAGE, np.uint8)
        self.sums = np.zeros(ROWS, np.int32)
        self.args = np.array([self.buf.ctypes.data, self.sums.ctypes.data], np.int64)

    def run(self, p: pool.Pool) -> None:
        p.run(self.fn, self.args.ctypes.data, ROWS, 1)


def _word(p: pool.Pool, at: int, value: int | None = None) -> int:
    words = p._state[at : at + 8].view(np.int64)  # noqa: SLF001 - the pool's state
    if value is not None:
        words[0] = value
    return int(words[0])


def _alone_for(p: pool.Pool, job: Native) -> int:
    """How many jobs run alone before the pool is tried again (SOLO counts them down)."""
    n = 0
    while _word(p, SOLO):
        job.run(p)
        n += 1
    return n


def test_a_lone_stall_costs_a_few_jobs_alone() -> None:
    p, native = pool.Pool(2), Native()
    Stall().run(p)
    assert _word(p, BACKOFF) == 2 * SOLO_FIRST
    assert _alone_for(p, native) == SOLO_FIRST
    # then the pool again: a job without a stall halves the next stall's cost (a job the
    # machine itself stalls doubles it: try a few)
    for _ in range(20):
        native.run(p)
        if _word(p, BACKOFF) <= SOLO_FIRST:
            break
        _alone_for(p, native)
    assert _word(p, BACKOFF) <= SOLO_FIRST


def test_stalls_that_follow_each_other_double_the_time_alone() -> None:
    p, native, stall = pool.Pool(2), Native(), Stall()
    for expected in (SOLO_FIRST, 2 * SOLO_FIRST, 4 * SOLO_FIRST):
        stall.run(p)
        assert _alone_for(p, native) == expected
    _word(p, BACKOFF, SOLO_MAX)
    stall.run(p)
    assert _word(p, SOLO) == SOLO_MAX and _word(p, BACKOFF) == SOLO_MAX  # capped
