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
from dynalm.kernel.lang import F32, I32, I64, PTR, Module, const, vec

A_LOGITS, A_MAX, A_ARGMAX, A_SUM, N_ARGS = range(5)
SUM_LANES = 8


def _build(module: Module, vocab: int) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    logits, top, arg, total = (k.pointer(w) for w in k.words(k.args[0], N_ARGS))
    lanes = k.target.lanes
    n = k.i64(vocab)

    def row(r: ir.Value) -> None:
        x = k.index(logits, k.mul(r, vocab), F32)

        def floats(i: ir.Value, w: int) -> ir.Value:
            return k.load(vec(F32, w), k.index(x, i, F32), align=4)

        # max: maxnum in any order is exact
        best = {w: k.var(const(vec(F32, w), float("-inf"))) for w in (lanes, 1)}

        def most(i: ir.Value, w: int) -> None:
            best[w].set(k.call(f"llvm.maxnum.v{w}f32", vec(F32, w), best[w].get(), floats(i, w)))

        k.lanes(k.i64(0), n, lanes, most)
        wide = k.call(f"llvm.vector.reduce.fmax.v{lanes}f32", F32, best[lanes].get())
        tail = k.b.extract_element(best[1].get(), const(I32, 0))
        m = k.call("llvm.maxnum.f32", F32, wide, tail)

        # the first index holding the max: the smallest index among the lanes equal to it
        first = {w: k.var(const(vec(I64, w), vocab)) for w in (lanes, 1)}

        def where(i: ir.Value, w: int) -> None:
            idx = k.add(k.splat(i, w), const(vec(I64, w), list(range(w))))
            hit = k.b.fcmp_ordered("==", floats(i, w), k.splat(m, w))
            cand = k.b.select(hit, idx, const(vec(I64, w), vocab))
            first[w].set(k.smin(first[w].get(), cand))

        k.lanes(k.i64(0), n, lanes, where)
        at = k.call(f"llvm.vector.reduce.smin.v{lanes}i64", I64, first[lanes].get())
        at = k.smin(at, k.b.extract_element(first[1].get(), const(I32, 0)))

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
