"""The sampler's row reductions over the logits, as a kernel program: per row its max, the
first index holding it (greedy's token) and sum(exp(x - max)) (softmax's denominator).

A device that keeps the logits in its own memory needs these so that only three numbers
per row come back instead of the vocabulary's floats. ``exp`` is the language's polynomial
(``Kernel.exp``, about 1 ulp); the sum is kept in ``SUM_LANES`` lanes and added in one
order on every backend. NaN logits are skipped by the max (``maxnum``).

Kernel signature: ``void f(i64 *args, i64 lo, i64 hi)`` over rows ``[lo, hi)``, ``args``
the addresses of the logits ``[rows, vocab]`` (f32), the maxima (f32), the argmaxes
(int64) and the sums (f32). Specialised on ``vocab``.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import F32, I1, I32, I64, PTR, Kernel, Module, Var, const, vec

A_LOGITS, A_MAX, A_ARGMAX, A_SUM, N_ARGS = range(5)
SUM_LANES = 8


def _max_first(
    k: Kernel, x: ir.Value, start: ir.Value, stop: ir.Value, nan: Var | None = None
) -> tuple[ir.Value, ir.Value]:
    """The max of floats ``x[start:stop]`` (maxnum: NaNs skipped; exact in any order) and
    the first index holding it (``stop`` if none does: all NaN); ``nan`` (an i1 var) is
    set when a NaN is among them."""
    lanes = k.target.lanes

    def floats(i: ir.Value, w: int) -> ir.Value:
        return k.load(vec(F32, w), k.index(x, i, F32), align=4)

    best = {w: k.var(const(vec(F32, w), float("-inf"))) for w in (lanes, 1)}

    def most(i: ir.Value, w: int) -> None:
        v = floats(i, w)
        best[w].set(k.call(f"llvm.maxnum.v{w}f32", vec(F32, w), best[w].get(), v))
        if nan is not None:
            seen = k.reduce("or", k.b.fcmp_unordered("uno", v, v))
            nan.set(k.b.or_(nan.get(), seen))

    k.lanes(start, stop, lanes, most)
    wide = k.call(f"llvm.vector.reduce.fmax.v{lanes}f32", F32, best[lanes].get())
    tail = k.b.extract_element(best[1].get(), const(I32, 0))
    m = k.call("llvm.maxnum.f32", F32, wide, tail)

    # the first index holding the max: the smallest index among the lanes equal to it
    first = {w: k.var(k.splat(stop, w)) for w in (lanes, 1)}

    def where(i: ir.Value, w: int) -> None:
        idx = k.add(k.splat(i, w), const(vec(I64, w), list(range(w))))
        hit = k.b.fcmp_ordered("==", floats(i, w), k.splat(m, w))
        first[w].set(k.smin(first[w].get(), k.b.select(hit, idx, k.splat(stop, w))))

    k.lanes(start, stop, lanes, where)
    at = k.call(f"llvm.vector.reduce.smin.v{lanes}i64", I64, first[lanes].get())
    return m, k.smin(at, k.b.extract_element(first[1].get(), const(I32, 0)))


def _build(module: Module, vocab: int) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    logits, top, arg, total = (k.pointer(w) for w in k.words(k.args[0], N_ARGS))
    n = k.i64(vocab)

    def row(r: ir.Value) -> None:
        x = k.index(logits, k.mul(r, vocab), F32)

        def floats(i: ir.Value, w: int) -> ir.Value:
            return k.load(vec(F32, w), k.index(x, i, F32), align=4)

        m, at = _max_first(k, x, k.i64(0), n)

        # sum(exp(x - max)) in SUM_LANES lanes, then the tail, then the lanes in order
        acc = {w: k.var(const(vec(F32, w), 0.0)) for w in (SUM_LANES, 1)}

        def add_exp(i: ir.Value, w: int) -> None:
            acc[w].set(k.add(acc[w].get(), k.exp(k.sub(floats(i, w), k.splat(m, w)))))

        k.lanes(k.i64(0), n, SUM_LANES, add_exp)
        s = k.b.extract_element(acc[1].get(), const(I32, 0))
        for lane in range(SUM_LANES):
            s = k.add(s, k.b.extract_element(acc[SUM_LANES].get(), const(I32, lane)))

        k.store(m, k.index(top, r, F32), align=4)
        k.store(at, k.index(arg, r, I64), align=8)
        k.store(s, k.index(total, r, F32), align=4)

    k.loop(k.args[1], k.args[2], 1, row)
    k.ret()


def reference(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy: the maxima, first argmaxes and sum(exp(x - max)) per row (fp64 sums)."""
    x = np.asarray(logits, dtype=np.float32)
    m = np.nanmax(x, axis=1)
    arg = np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1)
    s = np.exp(x.astype(np.float64) - m[:, None].astype(np.float64)).sum(axis=1)
    return m, arg, s


ROW_REDUCE = Program("sample_reduce", _build)

# Greedy on the device (``ARGMAX``): argument block words, and the logits per partial.
G_LOGITS, G_PART_MAX, G_PART_ARG, G_TOKEN, G_WORDS = range(5)
ARGMAX_CHUNK = 1024


def argmax_chunks(vocab: int) -> int:
    """Partials per row of ``ARGMAX``."""
    return -(-vocab // ARGMAX_CHUNK)


def _build_argmax(module: Module, vocab: int) -> None:
    """``parts(args, lo, hi)``: items ``row * chunks + c``, each the max of its row's
    ``ARGMAX_CHUNK`` logits from ``c * ARGMAX_CHUNK`` and the first index holding it (the
    max NaN when a NaN is among them); ``pick(args, lo, hi)``: per row, the first index of
    the largest partial, the partials in index order (a tie keeps the earlier chunk, so it
    is the row's first argmax, ``np.argmax``'s), or -1 when the row holds a NaN or its max
    is infinite (what the host's greedy sampler refuses). A GPU runs a thread per item."""
    name, chunks = module.ir.name, argmax_chunks(vocab)
    parts = module.kernel(f"{name}_parts", (PTR, I64, I64))
    k = parts
    logits, part_max, part_arg, _ = (k.pointer(w) for w in k.words(k.args[0], G_WORDS))

    def part(item: ir.Value) -> None:
        r, c = k.udiv(item, chunks), k.b.urem(item, k.i64(chunks))
        start = k.mul(c, ARGMAX_CHUNK)
        stop = k.smin(k.add(start, ARGMAX_CHUNK), k.i64(vocab))
        nan = k.var(const(I1, 0), I1)
        m, at = _max_first(k, k.index(logits, k.mul(r, vocab), F32), start, stop, nan)
        m = k.select(nan.get(), const(F32, float("nan")), m)
        k.store(m, k.index(part_max, item, F32), align=4)
        k.store(at, k.index(part_arg, item, I64), align=8)

    k.loop(k.args[1], k.args[2], 1, part)
    k.ret()
    pick = module.kernel(f"{name}_pick", (PTR, I64, I64))
    k = pick
    _, part_max, part_arg, token = (k.pointer(w) for w in k.words(k.args[0], G_WORDS))

    def row(r: ir.Value) -> None:
        best, at = k.var(const(F32, float("-inf")), F32), k.var(-1)
        bad = k.var(const(I1, 0), I1)

        def chunk(i: ir.Value) -> None:
            m = k.load(F32, k.index(part_max, i, F32), align=4)
            bad.set(k.b.or_(bad.get(), k.b.fcmp_unordered("uno", m, m)))
            more = k.b.fcmp_ordered(">", m, best.get())
            best.set(k.select(more, m, best.get()))
            at.set(k.select(more, k.load(I64, k.index(part_arg, i, I64), align=8), at.get()))

        first = k.mul(r, chunks)
        k.loop(first, k.add(first, chunks), 1, chunk)
        m = best.get()
        infinite = k.b.fcmp_ordered("==", k.call("llvm.fabs.f32", F32, m), const(F32, float("inf")))
        refused = k.b.or_(k.b.or_(bad.get(), infinite), k.lt(at.get(), 0))
        k.store(k.select(refused, k.i64(-1), at.get()), k.index(token, r, I64), align=8)

    k.loop(k.args[1], k.args[2], 1, row)
    k.ret()


def argmax_reference(logits: np.ndarray) -> np.ndarray:
    """numpy: ``ARGMAX``'s tokens (-1 where the host's greedy sampler would refuse)."""
    x = np.asarray(logits, dtype=np.float32)
    arg = x.argmax(axis=1)
    ok = np.isfinite(x[np.arange(len(x)), arg])
    return np.where(ok, arg, -1).astype(np.int64)


ARGMAX = Program("sample_argmax", _build_argmax)
