"""Host peak probes for the kernel micro-benchmarks, written as kernel programs: what the
machine can do at best, so a kernel's GB/s and GMAC/s can be read as a fraction of it.

* ``STREAM``: sums the bytes of a buffer as wide integer vectors over ``[lo, hi)`` (in
  4 KiB pages, so the pool can split it): the streaming-read bandwidth a GEMV is bound by.
* ``INT8_MUL``: rounds of 8 independent chains of the backend's cheapest byte product on
  registers (no memory traffic), the multiply rate: where the backend sums int16 pairs,
  ``vpmaddubsw`` alone, each chain's int16 products the unsigned bytes of its next
  product (nothing else runs in the loop); elsewhere ``dot_u8s8`` (``vpdpbusd``, ``sdot``).
* ``INT8_DOT``: the same rounds of ``dot_u8s8`` into int32 (on AVX2 ``vpmaddubsw`` +
  ``vpmaddwd`` + ``vpaddd`` per 32 MACs): the multiply-and-widen rate, what a dot that
  widened every product would reach. An int16 auto kernel widens once per several products,
  so its ceiling lies between the two.

Each chain multiplies by its own constant bytes, the other operand made from the loop
counter or the chain's last product: products that differ per chain and per round, so the
compiler can neither share one product between the chains nor hoist it out of the loop (an
earlier probe fed every chain the same operands: LLVM computed one product per round and
added it 8 times).

Both take ``void f(i64 *args, i64 lo, i64 hi)`` (``args``: buffer address, result
address) and write a result so that nothing is optimised away.
"""

from __future__ import annotations

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import I8, I16, I32, I64, PTR, Module, const, vec

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


def _int8_chains(module: Module, widen: bool) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    out = k.pointer(k.words(k.args[0], 2)[1])
    target = module.target
    lanes = target.lanes
    bytes_ty = vec(I8, 4 * lanes)
    pairs = not widen and target.accumulate == "int16"
    ty = vec(I16, 2 * lanes) if pairs else vec(I32, lanes)
    # Per chain its own signed bytes (a constant: nothing to compute per round).
    s = [const(vec(I32, lanes), 0x01FF03FD + 0x02030405 * j) for j in range(DOT_CHAINS)]
    s = [k.bitcast(v, bytes_ty) for v in s]
    start = k.splat(k.b.trunc(k.args[1], ty.element), ty.count)
    accs = [k.var(k.b.add(start, const(ty, j)), ty) for j in range(DOT_CHAINS)]

    def rounds(i: ir.Value) -> None:
        if pairs:  # each chain's product is its next operand: nothing but the multiplies
            for acc, sj in zip(accs, s, strict=True):
                acc.set(target.pair_products(k, k.bitcast(acc.get(), bytes_ty), sj))
            return
        u = k.bitcast(k.splat(k.b.trunc(i, I32), lanes), bytes_ty)
        u = k.and_(u, 0x7F)  # u <= 127: exact on every backend
        for acc, sj in zip(accs, s, strict=True):
            acc.set(target.dot_u8s8(k, acc.get(), u, sj))

    k.loop(k.args[1], k.args[2], 1, rounds)
    total = k.total([a.get() for a in accs])
    if pairs:
        total = target.pair_sums(k, total)
    k.store(k.reduce("add", total), out, 0, 4)
    k.ret()


STREAM = Program("probe_stream", _stream)
INT8_MUL = Program("probe_int8_mul", lambda module: _int8_chains(module, widen=False))
INT8_DOT = Program("probe_int8_dot", lambda module: _int8_chains(module, widen=True))


def macs_per_round(lanes: int) -> int:
    """Multiply-accumulates one round of ``INT8_MUL`` or ``INT8_DOT`` does."""
    return DOT_CHAINS * lanes * 4
