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
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
from functools import cache

import llvmlite.binding as llvm
import numpy as np

from dynalm.core.buffers import require
from dynalm.kernel import jit

# futex(2) syscall number per machine; FUTEX_WAIT_PRIVATE = 128, FUTEX_WAKE_PRIVATE = 129.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
_PAUSE = {
    "x86_64": ("declare void @llvm.x86.sse2.pause()", "call void @llvm.x86.sse2.pause()"),
    "aarch64": ("declare void @llvm.aarch64.hint(i32)", "call void @llvm.aarch64.hint(i32 1)"),
}
# Spin this many pause instructions before sleeping: ~110 us on Zen 3, longer than the
# gaps between the matmuls of a decode step, short enough not to starve a busy machine.
SPIN = 1 << 12
# When the caller waited for a worker's chunk longer than it takes for 8 of its own (the
# OS descheduled that worker: the machine is oversubscribed), run this many jobs alone
# before trying the workers again.
SOLO_JOBS = 1000
# Kinds of the records of a native program (``Program``).
PLAIN, RANGE, SPLIT = 0, 1, 2

# State, one cache line per word. GEN: job generation (the workers' futex word); NEXT: the
# job generation << 32 | next free row (CLOSED while the job fields are rewritten); DONE:
# rows finished (the caller's futex word); JOB: fn, args, total, chunk, then 2 x threads
# (set once); SOLO: jobs left to run on the caller alone (only the caller touches it).
_GEN, _SLEEPERS, _NEXT, _DONE, _MAIN_WAITS, _JOB, _SOLO = 0, 64, 128, 192, 256, 320, 384
_STATE_BYTES = 448
_CLOSED = 0xFFFFFFFF


def _ir(sys_futex: int, pause_decl: str, pause: str) -> str:
    return f"""
declare i64 @dynalm_syscall(i64, ...)
declare i64 @llvm.readcyclecounter()
declare i64 @llvm.umax.i64(i64, i64)
{pause_decl}

; Wait while *word == old: spin, then sleep on the futex (counted in *sleepers if given).
; Returns whether it had to sleep.
define private i1 @wait_ne(ptr %word, i32 %old, ptr %sleepers) {{
entry:
  br label %spin
spin:
  %i = phi i64 [0, %entry], [%i1, %pause]
  %v = load atomic i32, ptr %word acquire, align 4
  %changed = icmp ne i32 %v, %old
  br i1 %changed, label %quick, label %more
quick:
  ret i1 false
more:
  %i1 = add i64 %i, 1
  %spun = icmp sgt i64 %i1, {SPIN}
  br i1 %spun, label %sleep, label %pause
pause:
  {pause}
  br label %spin
sleep:
  %counted = icmp ne ptr %sleepers, null
  br i1 %counted, label %count, label %check
count:
  atomicrmw add ptr %sleepers, i32 1 seq_cst
  br label %check
check:
  %w = load atomic i32, ptr %word seq_cst, align 4
  %same = icmp eq i32 %w, %old
  br i1 %same, label %futex, label %woke
futex:
  %old64 = zext i32 %old to i64
  call i64 (i64, ...) @dynalm_syscall(i64 {sys_futex}, ptr %word, i64 128, i64 %old64, ptr null)
  br label %woke
woke:
  br i1 %counted, label %uncount, label %recheck
uncount:
  atomicrmw sub ptr %sleepers, i32 1 seq_cst
  br label %recheck
recheck:
  %r = load atomic i32, ptr %word acquire, align 4
  %again = icmp eq i32 %r, %old
  br i1 %again, label %sleep, label %done
done:
  ret i1 true
}}

; Run chunks of job %g until none is left; returns how many this thread ran.
define private i64 @drain(ptr %s, i32 %g) {{
entry:
  %ran = alloca i64
  store i64 0, ptr %ran
  %next = getelementptr i8, ptr %s, i64 {_NEXT}
  %done = getelementptr i8, ptr %s, i64 {_DONE}
  %main_waits = getelementptr i8, ptr %s, i64 {_MAIN_WAITS}
  %fn_at = getelementptr i8, ptr %s, i64 {_JOB}
  %args_at = getelementptr i8, ptr %s, i64 {_JOB + 8}
  %total_at = getelementptr i8, ptr %s, i64 {_JOB + 16}
  %chunk_at = getelementptr i8, ptr %s, i64 {_JOB + 24}
  %parts_at = getelementptr i8, ptr %s, i64 {_JOB + 32}
  br label %grab
grab:
  %w = load atomic i64, ptr %next acquire, align 8
  %wg64 = lshr i64 %w, 32
  %wg = trunc i64 %wg64 to i32
  %row = and i64 %w, {_CLOSED}
  %total = load atomic i64, ptr %total_at monotonic, align 8
  %ours = icmp eq i32 %wg, %g
  %left = icmp slt i64 %row, %total
  %go = and i1 %ours, %left
  br i1 %go, label %take, label %exit
take:
  %chunk = load atomic i64, ptr %chunk_at monotonic, align 8
  %fn = load atomic ptr, ptr %fn_at monotonic, align 8
  %args = load atomic ptr, ptr %args_at monotonic, align 8
  ; Guided: a grab takes 1 / (2 x threads) of the rows left, in whole chunks (at least one).
  %parts = load i64, ptr %parts_at, align 8
  %rest = sub i64 %total, %row
  %share = udiv i64 %rest, %parts
  %units = udiv i64 %share, %chunk
  %units1 = call i64 @llvm.umax.i64(i64 %units, i64 1)
  %size = mul i64 %units1, %chunk
  %w1 = add i64 %w, %size
  %cas = cmpxchg ptr %next, i64 %w, i64 %w1 seq_cst seq_cst
  %won = extractvalue {{ i64, i1 }} %cas, 1
  br i1 %won, label %work, label %grab
work:
  %end0 = add i64 %row, %size
  %short = icmp slt i64 %total, %end0
  %end = select i1 %short, i64 %total, i64 %end0
  call void %fn(ptr %args, i64 %row, i64 %end)
  %ran0 = load i64, ptr %ran
  %ran1 = add i64 %ran0, 1
  store i64 %ran1, ptr %ran
  %rows64 = sub i64 %end, %row
  %rows = trunc i64 %rows64 to i32
  atomicrmw add ptr %done, i32 %rows seq_cst
  %mw = load atomic i32, ptr %main_waits seq_cst, align 4
  %asleep = icmp ne i32 %mw, 0
  br i1 %asleep, label %wake, label %grab
wake:
  call i64 (i64, ...) @dynalm_syscall(i64 {sys_futex}, ptr %done, i64 129, i64 1)
  br label %grab
exit:
  %count = load i64, ptr %ran
  ret i64 %count
}}

define void @dynalm_pool_worker(ptr %s) {{
entry:
  %gen = getelementptr i8, ptr %s, i64 {_GEN}
  %sleepers = getelementptr i8, ptr %s, i64 {_SLEEPERS}
  br label %wait
wait:
  %seen = phi i32 [0, %entry], [%g, %wait]
  call i1 @wait_ne(ptr %gen, i32 %seen, ptr %sleepers)
  %g = load atomic i32, ptr %gen acquire, align 4
  call i64 @drain(ptr %s, i32 %g)
  br label %wait
}}

define void @dynalm_pool_run(ptr %s, ptr %fn, ptr %args, i64 %total, i64 %chunk) {{
entry:
  %gen = getelementptr i8, ptr %s, i64 {_GEN}
  %sleepers = getelementptr i8, ptr %s, i64 {_SLEEPERS}
  %next = getelementptr i8, ptr %s, i64 {_NEXT}
  %done = getelementptr i8, ptr %s, i64 {_DONE}
  %main_waits = getelementptr i8, ptr %s, i64 {_MAIN_WAITS}
  %fn_at = getelementptr i8, ptr %s, i64 {_JOB}
  %args_at = getelementptr i8, ptr %s, i64 {_JOB + 8}
  %total_at = getelementptr i8, ptr %s, i64 {_JOB + 16}
  %chunk_at = getelementptr i8, ptr %s, i64 {_JOB + 24}
  %solo_at = getelementptr i8, ptr %s, i64 {_SOLO}
  %solo = load i64, ptr %solo_at, align 8
  %alone = icmp sgt i64 %solo, 0
  br i1 %alone, label %by_myself, label %publish
by_myself:
  %solo1 = sub i64 %solo, 1
  store i64 %solo1, ptr %solo_at, align 8
  call void %fn(ptr %args, i64 0, i64 %total)
  ret void
publish:
  %g0 = load atomic i32, ptr %gen monotonic, align 4
  %g = add i32 %g0, 1
  %g64 = zext i32 %g to i64
  %tag = shl i64 %g64, 32
  %closed = or i64 %tag, {_CLOSED}
  store atomic i64 %closed, ptr %next seq_cst, align 8
  store atomic ptr %fn, ptr %fn_at monotonic, align 8
  store atomic ptr %args, ptr %args_at monotonic, align 8
  store atomic i64 %total, ptr %total_at monotonic, align 8
  store atomic i64 %chunk, ptr %chunk_at monotonic, align 8
  store atomic i32 0, ptr %done monotonic, align 4
  store atomic i64 %tag, ptr %next seq_cst, align 8
  store atomic i32 %g, ptr %gen seq_cst, align 4
  %asleep = load atomic i32, ptr %sleepers seq_cst, align 4
  %any = icmp ne i32 %asleep, 0
  br i1 %any, label %wake, label %mine
wake:
  call i64 (i64, ...) @dynalm_syscall(i64 {sys_futex}, ptr %gen, i64 129, i64 2147483647)
  br label %mine
mine:
  %t0 = call i64 @llvm.readcyclecounter()
  %mine_n = call i64 @drain(ptr %s, i32 %g)
  %t1 = call i64 @llvm.readcyclecounter()
  %total32 = trunc i64 %total to i32
  br label %check
check:
  %d = load atomic i32, ptr %done acquire, align 4
  %finished = icmp eq i32 %d, %total32
  br i1 %finished, label %exit, label %wait
wait:
  %slept = call i1 @wait_ne(ptr %done, i32 %d, ptr %main_waits)
  %judged = icmp ne i64 %mine_n, 0
  %late = and i1 %slept, %judged
  br i1 %late, label %measure, label %check
measure:
  ; A stall: the wait outlasted 8 of this thread's own chunks (the worker was descheduled).
  %t2 = call i64 @llvm.readcyclecounter()
  %waited = sub i64 %t2, %t1
  %spent = sub i64 %t1, %t0
  %per_chunk = udiv i64 %spent, %mine_n
  %limit = mul i64 %per_chunk, 8
  %stall = icmp ugt i64 %waited, %limit
  br i1 %stall, label %stalled, label %check
stalled:
  store i64 {SOLO_JOBS}, ptr %solo_at, align 8
  br label %check
exit:
  ret void
}}

; Run %n native calls in a row (a compiled stretch of a model step), records of 5 words:
; kind, fn, args, total, chunk. Kind {PLAIN}: fn(args); {RANGE}: fn(args, 0, total) on this
; thread; {SPLIT}: fn over [0, total) in chunks over the pool (%s may be null without it).
define void @dynalm_pool_program(ptr %s, ptr %records, i64 %n) {{
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %next]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %body, label %exit
body:
  %at = mul i64 %i, 5
  %rec = getelementptr i64, ptr %records, i64 %at
  %kind = load i64, ptr %rec, align 8
  %fn_at = getelementptr i64, ptr %rec, i64 1
  %fn = load ptr, ptr %fn_at, align 8
  %args_at = getelementptr i64, ptr %rec, i64 2
  %args = load ptr, ptr %args_at, align 8
  %total_at = getelementptr i64, ptr %rec, i64 3
  %total = load i64, ptr %total_at, align 8
  %chunk_at = getelementptr i64, ptr %rec, i64 4
  %chunk = load i64, ptr %chunk_at, align 8
  switch i64 %kind, label %plain [i64 {RANGE}, label %range i64 {SPLIT}, label %split]
plain:
  call void %fn(ptr %args)
  br label %next
range:
  call void %fn(ptr %args, i64 0, i64 %total)
  br label %next
split:
  call void @dynalm_pool_run(ptr %s, ptr %fn, ptr %args, i64 %total, i64 %chunk)
  br label %next
next:
  %i1 = add i64 %i, 1
  br label %head
exit:
  ret void
}}
"""


_Worker = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Run = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
)
_Program = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@cache
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    machine = platform.machine().lower().replace("arm64", "aarch64").replace("amd64", "x86_64")
    if not sys.platform.startswith("linux") or machine not in _SYS_FUTEX:
        return None
    libc_syscall = ctypes.CDLL(None).syscall
    llvm.add_symbol("dynalm_syscall", ctypes.cast(libc_syscall, ctypes.c_void_p).value)
    names = ["dynalm_pool_worker", "dynalm_pool_run", "dynalm_pool_program"]
    addrs = jit.compile_ir(_ir(_SYS_FUTEX[machine], *_PAUSE[machine]), names)
    return tuple(t(addrs[n]) for t, n in zip((_Worker, _Run, _Program), names, strict=True))


def available() -> bool:
    """Whether this platform has the native pool (Linux on x86-64 or AArch64)."""
    return _functions() is not None


class Pool:
    """``n_threads - 1`` native workers plus the calling thread."""

    def __init__(self, n_threads: int) -> None:
        functions = _functions()
        if functions is None:
            raise RuntimeError("the native worker pool needs Linux on x86-64 or AArch64")
        require(n_threads >= 1, f"a pool of {n_threads} threads")
        worker, self._run, self._program = functions
        self.n_threads = n_threads
        buf = np.zeros(_STATE_BYTES + 64, np.uint8)  # cache-line aligned state words
        skip = -buf.__array_interface__["data"][0] % 64
        self._state = buf[skip : skip + _STATE_BYTES]
        self._addr = self._state.__array_interface__["data"][0]
        self._state[_JOB + 32 : _JOB + 40].view(np.int64)[0] = 2 * n_threads
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
