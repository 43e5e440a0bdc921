"""The native worker pool's code: the workers' wait-and-grab loop, a job's publication and
the runner of native programs (``core.pool`` owns the threads and the state buffer).

The state is one cache line per word. GEN: job generation (the workers' futex word);
NEXT: the job generation << 32 | next free row (CLOSED while the job fields are
rewritten); DONE: rows finished (the caller's futex word); JOB: fn, args, total, chunk,
then 2 x threads (set once); SOLO: jobs left to run on the caller alone, and BACKOFF: how
many the next stall gives (only the caller touches them). Waiting spins ``SPIN`` pause
instructions, then sleeps on a futex (Linux ``futex(2)`` through libc's varargs
``syscall``, which the JIT knows as ``dynalm_syscall``). Grabs are one compare-and-swap of
NEXT, guided: ``1 / (2 x threads)`` of the rows left in whole chunks.

Functions (exported): ``worker(state)`` never returns; ``run(state, fn, args, total,
chunk)`` runs one job over the pool; ``program(state, records, n)`` runs ``n`` records of
5 words ``(kind, fn, args, total, chunk)``: kind ``PLAIN`` ``fn(args)``, ``RANGE``
``fn(args, 0, total)`` on the calling thread, ``SPLIT`` ``fn`` over ``[0, total)`` on the
pool (``state`` may be null without it).
"""

from __future__ import annotations

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import I1, I32, I64, PTR, VOID, Kernel, Module, const

# futex(2) syscall number per machine; FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE.
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129
# Spin this many pause instructions before sleeping: ~110 us on Zen 3, longer than the
# gaps between the matmuls of a decode step, short enough not to starve a busy machine.
SPIN = 1 << 12
# When the caller waited for a worker's chunk longer than it takes for 8 of its own (the
# OS or the hypervisor descheduled that worker), it runs the next jobs alone before trying
# the workers again: SOLO_FIRST jobs after a lone stall (a virtual CPU's stolen
# milliseconds: running alone for long would halve the speed for nothing), twice as many
# after each stall that follows, up to SOLO_MAX (an oversubscribed machine: every try
# stalls); each job the pool finishes without a stall halves it again.
SOLO_FIRST, SOLO_MAX = 8, 1024
# Kinds of the records of a native program.
PLAIN, RANGE, SPLIT = 0, 1, 2
# Byte offsets of the state words.
GEN, SLEEPERS, NEXT, DONE, MAIN_WAITS, JOB, SOLO, BACKOFF = 0, 64, 128, 192, 256, 320, 384, 392
JOB_FN, JOB_ARGS, JOB_TOTAL, JOB_CHUNK, JOB_PARTS = (JOB + 8 * i for i in range(5))
STATE_BYTES = 448
CLOSED = 0xFFFFFFFF
SYSCALL = "dynalm_syscall"  # libc's syscall(), registered with the JIT by core.pool


def _pause(k: Kernel, machine: str) -> None:
    if machine == "x86_64":
        k.call("llvm.x86.sse2.pause", VOID)
    else:
        k.call("llvm.aarch64.hint", VOID, const(I32, 1))


def _futex(k: Kernel, machine: str, word: ir.Value, op: int, *rest: ir.Value) -> None:
    k.call(SYSCALL, I64, k.i64(SYS_FUTEX[machine]), word, k.i64(op), *rest)


def _blocks(k: Kernel, *names: str) -> list[ir.Block]:
    return [k.b.append_basic_block(name) for name in names]


def _wait_ne(module: Module, machine: str) -> Kernel:
    """``wait_ne(word, old, sleepers)``: wait while ``*word == old``: spin, then sleep on
    the futex (counted in ``*sleepers`` if not null). Returns whether it had to sleep."""
    k = module.kernel(f"{module.ir.name}_wait_ne", (PTR, I32, PTR), ret=I1, private=True)
    b, (word, old, sleepers) = k.b, k.args
    spin, quick, more, pause, sleep, done = _blocks(
        k, "spin", "quick", "more", "pause", "sleep", "done"
    )
    entry = b.block
    b.branch(spin)
    b.position_at_end(spin)
    i = b.phi(I64)
    i.add_incoming(k.i64(0), entry)
    v = k.load_atomic(I32, word, 0, "acquire", 4)
    b.cbranch(b.icmp_unsigned("!=", v, old), quick, more)
    b.position_at_end(quick)
    k.ret(const(I1, 0))
    b.position_at_end(more)
    i1 = k.add(i, 1)
    b.cbranch(b.icmp_signed(">", i1, k.i64(SPIN)), sleep, pause)
    b.position_at_end(pause)
    i.add_incoming(i1, pause)
    _pause(k, machine)
    b.branch(spin)
    b.position_at_end(sleep)  # until *word changes: counted as a sleeper, on the futex
    counted = b.icmp_unsigned("!=", sleepers, ir.Constant(PTR, None))
    k.branch(counted, lambda: b.atomic_rmw("add", sleepers, const(I32, 1), "seq_cst"))
    same = b.icmp_unsigned("==", k.load_atomic(I32, word, 0, "seq_cst", 4), old)
    wait = k.convert(old, I64, signed=False), ir.Constant(PTR, None)
    k.branch(same, lambda: _futex(k, machine, word, _FUTEX_WAIT, *wait))
    k.branch(counted, lambda: b.atomic_rmw("sub", sleepers, const(I32, 1), "seq_cst"))
    again = b.icmp_unsigned("==", k.load_atomic(I32, word, 0, "acquire", 4), old)
    b.cbranch(again, sleep, done)
    b.position_at_end(done)
    k.ret(const(I1, 1))
    return k


def _drain(module: Module, machine: str) -> Kernel:
    """``drain(state, g)``: run chunks of job ``g`` until none is left; returns how many
    this thread ran."""
    k = module.kernel(f"{module.ir.name}_drain", (PTR, I32), ret=I64, private=True)
    b, (s, g) = k.b, k.args
    ran = k.var(0)
    grab, take, work, wake, leave = _blocks(k, "grab", "take", "work", "wake", "exit")
    b.branch(grab)
    b.position_at_end(grab)
    w = k.load_atomic(I64, s, NEXT, "acquire", 8)
    row = k.and_(w, CLOSED)
    total = k.load_atomic(I64, s, JOB_TOTAL, "monotonic", 8)
    ours = b.icmp_unsigned("==", k.convert(k.lshr(w, 32), I32), g)
    b.cbranch(b.and_(ours, k.lt(row, total)), take, leave)
    b.position_at_end(take)
    chunk = k.load_atomic(I64, s, JOB_CHUNK, "monotonic", 8)
    fn = k.load_atomic(PTR, s, JOB_FN, "monotonic", 8)
    args = k.load_atomic(PTR, s, JOB_ARGS, "monotonic", 8)
    # Guided: a grab takes 1 / (2 x threads) of the rows left, in whole chunks (at least one).
    parts = k.load(I64, s, JOB_PARTS, 8)
    units = b.udiv(b.udiv(k.sub(total, row), parts), chunk)
    size = k.mul(k.call("llvm.umax.i64", I64, units, k.i64(1)), chunk)
    cas = b.cmpxchg(k.at(s, NEXT), w, k.add(w, size), "seq_cst", "seq_cst")
    b.cbranch(b.extract_value(cas, 1), work, grab)
    b.position_at_end(work)
    end0 = k.add(row, size)
    end = k.select(k.lt(total, end0), total, end0)
    k.call_at(fn, VOID, args, row, end)
    ran.set(k.add(ran.get(), 1))
    b.atomic_rmw("add", k.at(s, DONE), k.convert(k.sub(end, row), I32), "seq_cst")
    waits = k.load_atomic(I32, s, MAIN_WAITS, "seq_cst", 4)
    b.cbranch(b.icmp_unsigned("!=", waits, const(I32, 0)), wake, grab)
    b.position_at_end(wake)
    _futex(k, machine, k.at(s, DONE), _FUTEX_WAKE, k.i64(1))
    b.branch(grab)
    b.position_at_end(leave)
    k.ret(ran.get())
    return k


def _worker(module: Module, wait_ne: Kernel, drain: Kernel) -> None:
    """``worker(state)``: wait for each new job generation and drain it, forever."""
    k = module.kernel(f"{module.ir.name}_worker", (PTR,))
    b, s = k.b, k.args[0]
    gen = k.at(s, GEN)
    entry, (wait,) = b.block, _blocks(k, "wait")
    b.branch(wait)
    b.position_at_end(wait)
    seen = b.phi(I32)
    seen.add_incoming(const(I32, 0), entry)
    b.call(wait_ne.fn, [gen, seen, k.at(s, SLEEPERS)])
    g = k.load_atomic(I32, gen, 0, "acquire", 4)
    seen.add_incoming(g, wait)
    b.call(drain.fn, [s, g])
    b.branch(wait)


def _run(module: Module, machine: str, wait_ne: Kernel, drain: Kernel) -> Kernel:
    """``run(state, fn, args, total, chunk)``: publish the job, drain it with the workers,
    wait for their chunks; after a stall, the next jobs run here alone (``SOLO_FIRST``,
    doubling while stalls follow each other)."""
    k = module.kernel(f"{module.ir.name}_run", (PTR, PTR, PTR, I64, I64))
    b, (s, fn, args, total, chunk) = k.b, k.args
    gen, done = k.at(s, GEN), k.at(s, DONE)
    by_myself, publish, wake, mine, check, wait, measure, stalled, leave = _blocks(
        k, "by_myself", "publish", "wake", "mine", "check", "wait", "measure", "stalled", "exit"
    )
    stalls = k.var(0)  # whether this job stalled
    solo = k.load(I64, s, SOLO, 8)
    b.cbranch(b.icmp_signed(">", solo, k.i64(0)), by_myself, publish)
    b.position_at_end(by_myself)
    k.store(k.sub(solo, 1), s, SOLO, 8)
    k.call_at(fn, VOID, args, k.i64(0), total)
    k.ret()
    b.position_at_end(publish)
    g = k.add(k.load_atomic(I32, gen, 0, "monotonic", 4), 1)
    tag = k.shl(k.convert(g, I64, signed=False), 32)
    k.store_atomic(k.or_(tag, CLOSED), s, NEXT, "seq_cst", 8)
    k.store_atomic(fn, s, JOB_FN, "monotonic", 8)
    k.store_atomic(args, s, JOB_ARGS, "monotonic", 8)
    k.store_atomic(total, s, JOB_TOTAL, "monotonic", 8)
    k.store_atomic(chunk, s, JOB_CHUNK, "monotonic", 8)
    k.store_atomic(const(I32, 0), done, 0, "monotonic", 4)
    k.store_atomic(tag, s, NEXT, "seq_cst", 8)
    k.store_atomic(g, gen, 0, "seq_cst", 4)
    asleep = k.load_atomic(I32, s, SLEEPERS, "seq_cst", 4)
    b.cbranch(b.icmp_unsigned("!=", asleep, const(I32, 0)), wake, mine)
    b.position_at_end(wake)
    _futex(k, machine, gen, _FUTEX_WAKE, k.i64(2147483647))
    b.branch(mine)
    b.position_at_end(mine)
    t0 = k.call("llvm.readcyclecounter", I64)
    mine_n = b.call(drain.fn, [s, g])
    t1 = k.call("llvm.readcyclecounter", I64)
    total32 = k.convert(total, I32)
    b.branch(check)
    b.position_at_end(check)
    d = k.load_atomic(I32, done, 0, "acquire", 4)
    b.cbranch(b.icmp_unsigned("==", d, total32), leave, wait)
    b.position_at_end(wait)
    slept = b.call(wait_ne.fn, [done, d, k.at(s, MAIN_WAITS)])
    judged = b.icmp_unsigned("!=", mine_n, k.i64(0))
    b.cbranch(b.and_(slept, judged), measure, check)
    b.position_at_end(measure)
    # A stall: the wait outlasted 8 of this thread's own chunks (the worker was descheduled).
    waited = k.sub(k.call("llvm.readcyclecounter", I64), t1)
    per_chunk = b.udiv(k.sub(t1, t0), mine_n)
    first = b.icmp_unsigned("==", stalls.get(), k.i64(0))  # a job counts one stall
    b.cbranch(b.and_(first, b.icmp_unsigned(">", waited, k.mul(per_chunk, 8))), stalled, check)
    b.position_at_end(stalled)
    backoff = k.call("llvm.umax.i64", I64, k.load(I64, s, BACKOFF, 8), k.i64(SOLO_FIRST))
    k.store(backoff, s, SOLO, 8)
    k.store(k.call("llvm.umin.i64", I64, k.mul(backoff, 2), k.i64(SOLO_MAX)), s, BACKOFF, 8)
    stalls.set(k.i64(1))
    b.branch(check)
    b.position_at_end(leave)
    clean = k.b.icmp_unsigned("==", stalls.get(), k.i64(0))
    k.branch(clean, lambda: k.store(k.lshr(k.load(I64, s, BACKOFF, 8), 1), s, BACKOFF, 8))
    k.ret()
    return k


def _program(module: Module, run: Kernel) -> None:
    """``program(state, records, n)``: the ``n`` records, in order (see the module doc)."""
    k = module.kernel(f"{module.ir.name}_program", (PTR, PTR, I64))
    b, (s, records, n) = k.b, k.args

    def record(i: ir.Value) -> None:
        rec = k.index(records, k.mul(i, 5), I64)
        kind, total, chunk = (k.load(I64, rec, 8 * w, 8) for w in (0, 3, 4))
        fn, args = (k.load(PTR, rec, 8 * w, 8) for w in (1, 2))
        plain, ranged, split, after = _blocks(k, "plain", "range", "split", "next")
        switch = b.switch(kind, plain)
        switch.add_case(k.i64(RANGE), ranged)
        switch.add_case(k.i64(SPLIT), split)
        for blk, call in (
            (plain, lambda: k.call_at(fn, VOID, args)),
            (ranged, lambda: k.call_at(fn, VOID, args, k.i64(0), total)),
            (split, lambda: b.call(run.fn, [s, fn, args, total, chunk])),
        ):
            b.position_at_end(blk)
            call()
            b.branch(after)
        b.position_at_end(after)

    k.loop(0, n, 1, record)
    k.ret()


def _build(module: Module, machine: str) -> None:
    module.declare(SYSCALL, I64, (I64,), var_arg=True)
    wait_ne, drain = _wait_ne(module, machine), _drain(module, machine)
    _worker(module, wait_ne, drain)
    _program(module, _run(module, machine, wait_ne, drain))


POOL = Program("pool", _build)
FUNCTIONS = ("worker", "run", "program")
