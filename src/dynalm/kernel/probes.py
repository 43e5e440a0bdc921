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
* ``INT8_CELL``: the arithmetic of one ``auto`` cell (a 32-block of 8 byte products
  against one register of weight rows), nothing else: the products in the two activation
  scale groups, each group's 4 summed in int16 and widened once (or dot into int32 where
  the backend accumulates so), converted, and scaled by the two group scales and the
  rows' ``d`` in 3 float ops (``_AutoBlock.scaled``). No loads, unpacks or broadcasts:
  the ceiling of an int8 kernel that keeps ``auto``'s numerics, where the multiplies share
  a pipe with the widening and the float ops (Zen 2: ~0.65 of ``INT8_MUL``).

Each chain multiplies by its own constant bytes, the other operand made from the loop
counter or the chain's last product: products that differ per chain and per round, so the
compiler can neither share one product between the chains nor hoist it out of the loop (an
earlier probe fed every chain the same operands: LLVM computed one product per round and
added it 8 times).

Each takes ``void f(i64 *args, i64 lo, i64 hi)`` (``args``: buffer address, result
address) and write a result so that nothing is optimised away.
"""

from __future__ import annotations

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import F32, I8, I16, I32, I64, PTR, Module, const, vec

PAGE = 4096  # bytes per unit of STREAM's range
DOT_CHAINS = 8  # independent accumulators of INT8_DOT (enough to hide the latency)
CELL_PRODUCTS = 8  # byte products per INT8_CELL cell: a 32-block, 4 bytes a lane


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


def _int8_cells(module: Module) -> None:
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    out = k.pointer(k.words(k.args[0], 2)[1])
    target = module.target
    lanes = target.lanes
    bytes_ty, i32_ty, f32_ty = vec(I8, 4 * lanes), vec(I32, lanes), vec(F32, lanes)
    pairs = target.accumulate == "int16"
    # Per chain and product its own signed bytes; scales that differ per chain.
    s = [
        [
            k.bitcast(const(i32_ty, 0x01FF03FD + 0x02030405 * (j * CELL_PRODUCTS + m)), bytes_ty)
            for m in range(CELL_PRODUCTS)
        ]
        for j in range(DOT_CHAINS)
    ]
    dx = [const(f32_ty, 0.5 + g) for g in (0, 1)]
    accs = [k.var(const(f32_ty, float(j)), f32_ty) for j in range(DOT_CHAINS)]
    half = CELL_PRODUCTS // 2

    def group_sum(u: ir.Value, sj: list[ir.Value]) -> ir.Value:
        """One activation scale group's integer sum, as ``auto`` forms it."""
        if pairs:
            part = target.pair_products(k, u, sj[0])
            for sm in sj[1:]:
                part = k.b.add(part, target.pair_products(k, u, sm))
            return target.pair_sums(k, part)
        total = ir.Constant(i32_ty, None)
        for sm in sj:
            total = target.dot_u8s8(k, total, u, sm)
        return total

    def rounds(i: ir.Value) -> None:
        u = k.bitcast(k.splat(k.b.trunc(i, I32), lanes), bytes_ty)
        u = k.and_(u, 0x0F)  # a nibble, as Q4_0's unsigned weights
        for j, acc in enumerate(accs):
            f = [k.convert(group_sum(u, s[j][g * half : (g + 1) * half]), F32) for g in (0, 1)]
            both = k.fma(f[1], dx[1], k.mul(f[0], dx[0]))
            acc.set(k.fma(both, const(f32_ty, 1.0 + j / 64), acc.get()))

    k.loop(k.args[1], k.args[2], 1, rounds)
    total = k.total([a.get() for a in accs])
    k.store(k.reduce("fadd", total), out, 0, 4)
    k.ret()


STREAM = Program("probe_stream", _stream)
INT8_MUL = Program("probe_int8_mul", lambda module: _int8_chains(module, widen=False))
INT8_DOT = Program("probe_int8_dot", lambda module: _int8_chains(module, widen=True))
INT8_CELL = Program("probe_int8_cell", _int8_cells)


def macs_per_round(lanes: int, program: Program) -> int:
    """Multiply-accumulates one round of ``program`` (a probe) does."""
    return DOT_CHAINS * lanes * 4 * (CELL_PRODUCTS if program is INT8_CELL else 1)
