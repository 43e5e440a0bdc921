"""Host peak probes for the kernel micro-benchmarks, written as kernel programs: what the
machine can do at best, so a kernel's GB/s and GMAC/s can be read as a fraction of it.

* ``STREAM``: sums the bytes of a buffer as wide integer vectors over ``[lo, hi)`` (in
  4 KiB pages, so the pool can split it): the streaming-read bandwidth a GEMV is bound by.
* ``INT8_DOT``: ``count`` rounds of 8 independent ``dot_u8s8`` accumulators on
  registers (no memory traffic): the backend's int8 multiply-accumulate rate per core.

Both take ``void f(i64 *args, i64 lo, i64 hi)`` (``args``: buffer address, result
address) and write a result so that nothing is optimised away.
"""

from __future__ import annotations

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import I8, I32, I64, PTR, Module, const, vec

PAGE = 4096  # bytes per unit of STREAM's range
DOT_CHAINS = 8  # independent accumulators of INT8_DOT (enough to hide the latency)


def _stream(module: Module) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    buf, out = (k.pointer(w) for w in k.words(k.args[0], 2))
    width = 4 * module.target.lanes  # bytes per vector
    ty = vec(I32, module.target.lanes)
    accs = [k.var(ir.Constant(ty, None), ty) for _ in range(4)]

    def line(at: ir.Value) -> None:
        for j, acc in enumerate(accs):
            acc.set(k.b.add(acc.get(), k.load(ty, buf, k.add(at, j * width), width)))

    k.loop(k.mul(k.args[1], PAGE), k.mul(k.args[2], PAGE), 4 * width, line)
    total = k.total([a.get() for a in accs])
    k.store(k.reduce("add", total), out, k.mul(k.args[1], 4), 4)
    k.ret()


def _int8_dot(module: Module) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    out = k.pointer(k.words(k.args[0], 2)[1])
    lanes = module.target.lanes
    ty, bytes_ty = vec(I32, lanes), vec(I8, 4 * lanes)
    # Operands from the loop counter, so the products cannot be folded at compile time.
    accs = [k.var(ir.Constant(ty, None), ty) for _ in range(DOT_CHAINS)]

    def rounds(i: ir.Value) -> None:
        u = k.bitcast(k.splat(k.b.trunc(i, I32), lanes), bytes_ty)
        s = k.bitcast(k.b.add(k.splat(k.b.trunc(i, I32), lanes), const(ty, 0x01FF03FD)), bytes_ty)
        u = k.and_(u, 0x7F)  # u <= 127: no int16 saturation on the pairwise backends
        for acc in accs:
            acc.set(module.target.dot_u8s8(k, acc.get(), u, s))

    k.loop(k.args[1], k.args[2], 1, rounds)
    total = k.total([a.get() for a in accs])
    k.store(k.reduce("add", total), out, 0, 4)
    k.ret()


STREAM = Program("probe_stream", _stream)
INT8_DOT = Program("probe_int8", _int8_dot)


def macs_per_round(lanes: int) -> int:
    """Multiply-accumulates one round of ``INT8_DOT`` does."""
    return DOT_CHAINS * lanes * 4
