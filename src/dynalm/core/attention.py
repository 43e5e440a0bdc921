"""Paged attention as one JIT kernel: blockwise online softmax over keys read through page tables.

One work item is one (query token, group of query heads sharing a kv head): it walks the
keys of its sequence from the window start to its own position in blocks of ``BLOCK``,
loading each key and value once for all heads of the group straight from the page that
holds it (no gather into a contiguous buffer), in f32, f16 or q8_0 storage. Per block and
head, the scores go into vectors (a transposing horizontal sum), and the online softmax
takes one max, a vectorised polynomial exp for the weights and one rescale exp (shared by
the heads) before the weighted value sum, instead of two libm calls and a serial chain per
key. Items are independent, so the result of a token never depends on what else is in the
batch, and the native pool splits items across threads.

The same module stores the step's keys and values into their pages first (``write``:
f32, f16 or q8_0 exactly as ``PagePool.write`` does).
q8_0 keys are stored Walsh-Hadamard rotated per 32 values (see ``kv_cache``), so an item
rotates its queries once the same way and scales scores by 1/32 more. With q8_0 pages, the
keys within ``kv_cache.RECENT`` positions of a query are read in f16 instead, from the
sequence's recent buffer or the step's own keys, and ``write_recent`` stores the step's
keys there after the items (``run`` does all three).
Everything a layer's kernel needs is bound once: its argument block holds the layer's
buffers (q, k and v may be column ranges of a wider merged buffer: each has a row stride)
and points at one :class:`StepLayout` block that the executor fills once per step (token
count, page tables, sequences, positions, slots). A decode step's attention is then one
ctypes call per layer, with no per-call Python work beyond choosing threads.

The kernel is built with ``llvmlite.ir`` and specialised per (kv dtype, heads, kv heads,
head dim, page size, recent window); the numpy ``cpu_ops.attention`` is its reference.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import llvmlite.ir as ir
import numpy as np

from dynalm.core import pool
from dynalm.core.buffers import check, require
from dynalm.core.elementwise import exp, intrinsic, loop
from dynalm.kernel import jit

if TYPE_CHECKING:
    from dynalm.core.cpu_ops import AttentionBatch, KVStorage

# A layer's argument block, one int64 per slot: its q (rows ``Q_STRIDE`` floats apart),
# output, the step's new keys and values, the layer's KV pages (and q8_0 scales and recent
# buffers), the window, the scale (f64 bits) and the address of the step's layout block.
_Q, _Q_STRIDE, _OUT, _K_NEW, _K_STRIDE, _V_NEW, _V_STRIDE = range(7)
_K, _V, _KS, _VS, _KR, _VR, _WINDOW, _SCALE, _STEP, _N_ARGS = range(7, 17)
# The step's layout block: token count, page tables ``[S, MAX_PAGES]``, each token's
# sequence, position and KV slot, and per sequence its first row in the step, its recent
# buffer's first row and the first position the buffer holds.
_TOKENS, _PAGES, _MAX_PAGES, _SEQ_OF, _POS, _SLOTS = range(6)
_FIRST_ROW, _RECENT_ROW, _RECENT_FROM, _N_STEP = range(6, 10)
_RECENT_WORDS = (_FIRST_ROW, _RECENT_ROW, _RECENT_FROM)
LANES = 8  # one AVX2 register of f32
BLOCK = 2 * LANES  # keys per online-softmax step
Q8_BLOCK = 32
# Query heads per work item at most: more would crowd the loops' registers and leave
# fewer items to split over threads.
_MAX_ITEM_HEADS = 4

_F32, _I64, _I32, _PTR = ir.FloatType(), ir.IntType(64), ir.IntType(32), ir.PointerType()
_VEC = ir.VectorType(_F32, LANES)
_STORE = {"f32": _F32, "f16": ir.HalfType(), "q8_0": ir.IntType(8)}
_BYTES = {"f32": 4, "f16": 2, "q8_0": 1}
_FMA = ("contract",)  # let fmul + fadd fuse into FMA


def supported(head_dim: int, dtype: str) -> bool:
    return head_dim % LANES == 0 and (dtype != "q8_0" or head_dim % Q8_BLOCK == 0)


def _item_heads(group: int) -> int:
    """Query heads per work item: the largest divisor of the group within the cap."""
    return max(d for d in range(1, _MAX_ITEM_HEADS + 1) if group % d == 0)


def _i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _shuffle(b: ir.IRBuilder, x: ir.Value, y: ir.Value, mask: list[int]) -> ir.Value:
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(mask)), mask))


def _splat(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Scalar ``x`` in all ``LANES`` lanes."""
    one = b.insert_element(ir.Constant(ir.VectorType(x.type, LANES), None), x, _I32(0))
    return _shuffle(b, one, one, [0] * LANES)


def _sum(b: ir.IRBuilder, xs: list[ir.Value]) -> ir.Value:
    total = xs[0]
    for x in xs[1:]:
        total = b.fadd(total, x)
    return total


def _row_sums(b: ir.IRBuilder, rows: list[ir.Value]) -> ir.Value:
    """``[sum(rows[0]), ..., sum(rows[7])]``: two rounds of in-lane pairwise adds (vhaddps)
    and one add of the 128-bit halves, instead of eight horizontal reductions."""

    def hadd(x: ir.Value, y: ir.Value) -> ir.Value:
        even = _shuffle(b, x, y, [0, 2, 8, 10, 4, 6, 12, 14])
        return b.fadd(even, _shuffle(b, x, y, [1, 3, 9, 11, 5, 7, 13, 15]))

    pairs = [hadd(rows[i], rows[i + 1]) for i in range(0, LANES, 2)]
    x, y = hadd(pairs[0], pairs[1]), hadd(pairs[2], pairs[3])
    return b.fadd(
        _shuffle(b, x, y, [0, 1, 2, 3, 8, 9, 10, 11]),
        _shuffle(b, x, y, [4, 5, 6, 7, 12, 13, 14, 15]),
    )


def _load_vec(
    b: ir.IRBuilder, dtype: str, store: ir.Value, scales: ir.Value, at: ir.Value
) -> ir.Value:
    """Elements ``at..at+7`` of a key or value store (``at`` a multiple of 8) as f32;
    ``f32>f16``: f32 elements rounded to f16 and back."""
    ty = _STORE[dtype.split(">")[0]]
    raw = b.load(b.gep(store, [at], source_etype=ty), typ=ir.VectorType(ty, LANES), align=1)
    if dtype == "f32":
        return raw
    if dtype == "f32>f16":
        return b.fpext(b.fptrunc(raw, ir.VectorType(ir.HalfType(), LANES)), _VEC)
    if dtype == "f16":
        return b.fpext(raw, _VEC)
    # q8_0: int8 values times the f16 scale of their 32-value block
    half = ir.HalfType()
    scale = b.load(b.gep(scales, [b.udiv(at, _i64(Q8_BLOCK))], source_etype=half), typ=half)
    return b.fmul(b.sitofp(raw, _VEC), _splat(b, b.fpext(scale, _F32)))


def _at(b: ir.IRBuilder, array: ir.Value, ty: ir.Type, index: ir.Value) -> ir.Value:
    return b.gep(array, [index], source_etype=ty)


def _blocks(b: ir.IRBuilder, args: ir.Value) -> tuple[list[ir.Value], list[ir.Value]]:
    """The words of a layer's argument block and of the step block it points at."""
    a = [b.load(_at(b, args, _I64, _i64(i)), typ=_I64) for i in range(_N_ARGS)]
    step = b.inttoptr(a[_STEP], _PTR)
    return a, [b.load(_at(b, step, _I64, _i64(i)), typ=_I64) for i in range(_N_STEP)]


def _ptr(b: ir.IRBuilder, word: ir.Value) -> ir.Value:
    return b.inttoptr(word, _PTR)


def _hadamard(b: ir.IRBuilder, xs: list[ir.Value]) -> list[ir.Value]:
    """``kv_cache.hadamard`` of vectors ``xs`` (four per 32 values): the same butterfly
    stages in the same order, h = 1, 2, 4 across lanes, then 8, 16 across vectors."""
    xs = list(xs)
    for h in (1, 2, 4):
        for n, x in enumerate(xs):
            lo = _shuffle(b, x, x, [j & ~h for j in range(LANES)])
            hi = _shuffle(b, x, x, [j | h for j in range(LANES)])
            pick = [j + LANES * bool(j & h) for j in range(LANES)]
            xs[n] = _shuffle(b, b.fadd(lo, hi), b.fsub(lo, hi), pick)
    for h in (1, 2):  # vector n pairs with n + h
        for n in range(len(xs)):
            if not n & h:
                xs[n], xs[n + h] = b.fadd(xs[n], xs[n + h]), b.fsub(xs[n], xs[n + h])
    return xs


def _write(b: ir.IRBuilder, dtype: str, n_kv_heads: int, head_dim: int, args: ir.Value) -> None:
    """Store the step's keys and values at their slots, as ``PagePool.write`` does: cast
    to f16, or q8_0 (scale ``max|x| / 127`` per 32 values, ``rint(x / scale)``, keys
    rotated first)."""
    a, s = _blocks(b, args)
    slots, ty = _ptr(b, s[_SLOTS]), _STORE[dtype]
    chunk = Q8_BLOCK if dtype == "q8_0" else LANES  # values converted together
    pairs = [
        (_ptr(b, a[new]), a[stride], _ptr(b, a[store]), _ptr(b, a[scales]), rotate)
        for new, stride, store, scales, rotate in (
            (_K_NEW, _K_STRIDE, _K, _KS, True),
            (_V_NEW, _V_STRIDE, _V, _VS, False),
        )
    ]

    def token(t: ir.Value) -> None:
        slot = b.load(_at(b, slots, _I64, t), typ=_I64)
        for new, stride, store, scales, rotate in pairs:
            for h in range(n_kv_heads):
                src = b.add(b.mul(t, stride), _i64(h * head_dim))
                dst = b.mul(b.add(b.mul(slot, _i64(n_kv_heads)), _i64(h)), _i64(head_dim))
                for c in range(0, head_dim, chunk):
                    xs = [
                        b.load(_at(b, new, _F32, b.add(src, _i64(i))), typ=_VEC, align=4)
                        for i in range(c, c + chunk, LANES)
                    ]
                    if dtype == "q8_0":
                        xs = _quantise(
                            b, _hadamard(b, xs) if rotate else xs, scales, b.add(dst, _i64(c))
                        )
                    elif dtype == "f16":
                        xs = [b.fptrunc(x, ir.VectorType(ty, LANES)) for x in xs]
                    for i, x in enumerate(xs):
                        at = b.add(dst, _i64(c + i * LANES))
                        b.store(x, _at(b, store, ty, at), align=1)

    loop(b, _i64(0), s[_TOKENS], 1, token)


def _quantise(b: ir.IRBuilder, xs: list[ir.Value], scales: ir.Value, at: ir.Value) -> list:
    """One q8_0 block (four vectors): its int8 vectors; its f16 scale stored at
    ``scales[at / 32]`` (numpy's f32 operations in numpy's order, so bitwise equal)."""
    mags = [intrinsic(b, "llvm.fabs.v8f32", _VEC, x) for x in xs]
    amax = mags[0]
    for m in mags[1:]:
        amax = intrinsic(b, "llvm.maxnum.v8f32", _VEC, amax, m)
    amax = intrinsic(b, "llvm.vector.reduce.fmax.v8f32", _F32, amax)
    d = b.fdiv(amax, ir.Constant(_F32, 127.0))
    positive = b.fcmp_ordered(">", d, ir.Constant(_F32, 0.0))
    inv = _splat(b, b.select(positive, b.fdiv(ir.Constant(_F32, 1.0), d), ir.Constant(_F32, 0.0)))
    half = ir.HalfType()
    b.store(b.fptrunc(d, half), _at(b, scales, half, b.udiv(at, _i64(Q8_BLOCK))))
    i8 = ir.VectorType(_STORE["q8_0"], LANES)
    return [b.fptosi(intrinsic(b, "llvm.rint.v8f32", _VEC, b.fmul(x, inv)), i8) for x in xs]


@dataclass
class _Segment:
    """How a run of an item's keys is read: ``key(j, i)`` returns key ``j``'s vectors (as
    key ``i`` of the block, noting where its value is), ``rows()`` the block's value handles
    and ``value(row, col)`` one value vector; keys stored Hadamard-rotated or not."""

    key: Callable[[ir.Value, ir.Value], list[ir.Value]]
    rows: Callable[[], list[ir.Value]]
    value: Callable[[ir.Value, ir.Value], ir.Value]
    rotated: bool


def _items(
    b: ir.IRBuilder,
    dtype: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    page: int,
    recent: int,
    args: ir.Value,
    lo: ir.Value,
    hi: ir.Value,
) -> None:
    """Work items ``lo..hi-1``: each a query token's group of heads over its keys. With
    ``recent``, the keys within ``recent`` positions of the query (and computed by its
    sequence since ``recent_from``) are read in f16, from the sequence's recent buffer for
    earlier steps' tokens and from the step's f32 keys rounded to f16 for its own, the same
    values either way: each is staged in f32 on the stack, so a result does not depend on
    where the step's chunk starts. Older keys come from the pages."""
    group = n_heads // n_kv_heads
    heads = _item_heads(group)
    n_vec, halves = head_dim // LANES, BLOCK // LANES

    def at(array: ir.Value, ty: ir.Type, index: ir.Value) -> ir.Value:
        return _at(b, array, ty, index)

    def word(array: ir.Value, index: ir.Value) -> ir.Value:
        return b.load(at(array, _I64, index), typ=_I64)

    def smax(x: ir.Value, y: ir.Value) -> ir.Value:
        return b.select(b.icmp_signed(">", x, y), x, y)

    def smin(x: ir.Value, y: ir.Value) -> ir.Value:
        return b.select(b.icmp_signed("<", x, y), x, y)

    a, s = _blocks(b, args)
    q, out, k, v, ks, vs, kr, vr = (_ptr(b, a[i]) for i in (_Q, _OUT, _K, _V, _KS, _VS, _KR, _VR))
    k_new, v_new = _ptr(b, a[_K_NEW]), _ptr(b, a[_V_NEW])
    pages, seq_of, pos = (_ptr(b, s[i]) for i in (_PAGES, _SEQ_OF, _POS))
    first_row, recent_row, recent_from = (_ptr(b, s[i]) for i in _RECENT_WORDS)
    scale = b.fptrunc(b.bitcast(a[_SCALE], ir.DoubleType()), _F32)
    neg_inf, zero = ir.Constant(_F32, float("-inf")), ir.Constant(_VEC, [0.0] * LANES)
    lane = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
    # Per item, on the stack: each head's running max and sum (promoted to registers by
    # LLVM); its weighted value sums [head][dim vector] and, per block, the keys' value
    # rows and dot vectors [head][key], which the loops below index.
    m = [b.alloca(_F32) for _ in range(heads)]
    total = [b.alloca(_F32) for _ in range(heads)]
    acc = b.alloca(_VEC, size=heads * n_vec)
    rows = b.alloca(_I64, size=BLOCK)
    dots = b.alloca(_VEC, size=heads * BLOCK)
    # The block's softmax weights, [head][key]: the value loop broadcasts each from memory
    # (a load) instead of shuffling it out of a register (48 shuffles per dim vector).
    block_weights = b.alloca(_VEC, size=heads * halves)
    if recent:  # the near keys and values of a block, staged in f32 [key][dim]
        staged_k, staged_v = (b.alloca(_VEC, size=BLOCK * n_vec) for _ in range(2))

    def item(w: ir.Value) -> None:
        t = b.udiv(w, _i64(n_heads // heads))
        h0 = b.mul(b.urem(w, _i64(n_heads // heads)), _i64(heads))  # first query head
        kh = b.udiv(h0, _i64(group))
        p, seq = word(pos, t), word(seq_of, t)
        table = at(pages, _I64, b.mul(seq, s[_MAX_PAGES]))
        # keys from max(0, p - window + 1) (0 without a window) to p
        win = b.add(b.sub(p, a[_WINDOW]), _i64(1))
        win = b.select(b.icmp_signed(">", a[_WINDOW], _i64(0)), win, _i64(0))
        jlo = smax(win, _i64(0))
        qbase = b.add(b.mul(t, a[_Q_STRIDE]), b.mul(h0, _i64(head_dim)))
        obase = b.mul(b.add(b.mul(t, _i64(n_heads)), h0), _i64(head_dim))
        for g in range(heads):
            b.store(neg_inf, m[g])
            b.store(ir.Constant(_F32, 0.0), total[g])
            for c in range(n_vec):
                b.store(zero, at(acc, _VEC, _i64(g * n_vec + c)))

        def segment(keys: _Segment, first: ir.Value, stop: ir.Value) -> None:
            """Keys ``first..stop-1`` into the running softmax and value sums."""
            last = b.sub(stop, _i64(1))
            qv = [
                [
                    b.load(
                        at(q, _F32, b.add(qbase, _i64(g * head_dim + c * LANES))), typ=_VEC, align=4
                    )
                    for c in range(n_vec)
                ]
                for g in range(heads)
            ]
            q_scale = scale
            if keys.rotated:  # like the stored keys: rotated q . rotated k = 32 q . k
                qv = [_hadamard(b, qg) for qg in qv]
                q_scale = b.fmul(scale, ir.Constant(_F32, 1.0 / Q8_BLOCK))
            q_scale = _splat(b, q_scale)

            def score(j0: ir.Value, i: ir.Value) -> None:
                """Dot vectors of key ``j0 + i`` with each head's query (keys past ``last``,
                the tail of the last block, reload key ``last`` and get weight 0, so every
                address stays inside the segment)."""
                kc = keys.key(smin(b.add(j0, i), last), i)
                dot = [zero] * heads
                for c in range(n_vec):  # each key vector is loaded once for all heads
                    dot = [
                        b.fadd(dot[g], b.fmul(qv[g][c], kc[c], flags=_FMA), flags=_FMA)
                        for g in range(heads)
                    ]
                for g in range(heads):
                    b.store(dot[g], at(dots, _VEC, b.add(i, _i64(g * BLOCK))))

            def softmax(j0: ir.Value) -> tuple[list[list[ir.Value]], ir.Value]:
                """Each head's block weights ``exp(score - new max)`` (``halves`` vectors) and
                the rescale factors ``exp(old max - new max)`` of all heads in one vector."""
                valid = [
                    b.icmp_signed(
                        "<=", b.add(_splat(b, b.add(j0, _i64(h * LANES))), lane), _splat(b, last)
                    )
                    for h in range(halves)
                ]
                weights, rescale = [], zero
                for g in range(heads):
                    x = []
                    for h in range(halves):
                        first = g * BLOCK + h * LANES
                        d = [
                            b.load(at(dots, _VEC, _i64(first + i)), typ=_VEC) for i in range(LANES)
                        ]
                        scores = b.fmul(_row_sums(b, d), q_scale)
                        x.append(b.select(valid[h], scores, _splat(b, neg_inf)))
                    top = x[0]
                    for xh in x[1:]:
                        top = intrinsic(b, "llvm.maxnum.v8f32", _VEC, top, xh)
                    m_old = b.load(m[g], typ=_F32)
                    top = intrinsic(b, "llvm.vector.reduce.fmax.v8f32", _F32, top, flags=("nnan",))
                    m_new = intrinsic(b, "llvm.maxnum.f32", _F32, m_old, top)
                    b.store(m_new, m[g])
                    weights.append(
                        [
                            b.select(valid[h], exp(b, b.fsub(x[h], _splat(b, m_new))), zero)
                            for h in range(halves)
                        ]
                    )
                    rescale = b.insert_element(rescale, b.fsub(m_old, m_new), _I32(g))
                return weights, exp(b, rescale)

            def block(j0: ir.Value) -> None:
                loop(b, _i64(0), _i64(BLOCK), 1, lambda i: score(j0, i))
                weights, rescale = softmax(j0)
                r = [b.extract_element(rescale, _I32(g)) for g in range(heads)]
                for g in range(heads):
                    block_sum = intrinsic(
                        b,
                        "llvm.vector.reduce.fadd.v8f32",
                        _F32,
                        ir.Constant(_F32, -0.0),
                        _sum(b, weights[g]),
                        flags=("reassoc",),
                    )
                    b.store(b.fadd(b.fmul(b.load(total[g], typ=_F32), r[g]), block_sum), total[g])
                for g in range(heads):
                    for h in range(halves):
                        b.store(weights[g][h], at(block_weights, _VEC, _i64(g * halves + h)))
                value_rows = keys.rows()
                r = [_splat(b, rg) for rg in r]

                def weight(g: int, i: int) -> ir.Value:
                    return _splat(b, b.load(at(block_weights, _F32, _i64(g * BLOCK + i)), typ=_F32))

                def dims(c: ir.Value) -> None:
                    # One dim vector of each head's value sum at a time, over the block's keys
                    # (unrolled over dims, LLVM would interleave and spill all the sums).
                    col = b.mul(c, _i64(LANES))
                    sums = [at(acc, _VEC, b.add(c, _i64(g * n_vec))) for g in range(heads)]
                    ys = [b.fmul(b.load(sums[g], typ=_VEC), r[g]) for g in range(heads)]
                    for i in range(BLOCK):
                        vc = keys.value(value_rows[i], col)
                        ys = [
                            b.fadd(ys[g], b.fmul(weight(g, i), vc, flags=_FMA), flags=_FMA)
                            for g in range(heads)
                        ]
                    for g in range(heads):
                        b.store(ys[g], sums[g])

                loop(b, _i64(0), _i64(n_vec), 1, dims)

            loop(b, first, stop, BLOCK, block, partial=True)

        def kv_row(slot: ir.Value) -> ir.Value:
            """Element offset of this item's kv head in KV row ``slot``."""
            return b.mul(b.add(b.mul(slot, _i64(n_kv_heads)), kh), _i64(head_dim))

        def page_row(j: ir.Value) -> ir.Value:
            pid = word(table, b.udiv(j, _i64(page)))
            return kv_row(b.add(b.mul(pid, _i64(page)), b.urem(j, _i64(page))))

        def page_key(j: ir.Value, i: ir.Value) -> list[ir.Value]:
            row = page_row(j)
            b.store(row, at(rows, _I64, i))
            # The same key of the next block, from memory: a step's weights stream through
            # the caches between two uses of a layer's pages, and the rows of one kv head
            # are strided (heads interleave), so the hardware prefetcher misses them.
            ahead = page_row(smin(b.add(j, _i64(BLOCK)), p))
            for store in (k, v):
                key = b.gep(store, [ahead], source_etype=_STORE[dtype])
                for line in range(0, head_dim * _BYTES[dtype], 64):
                    at_line = b.gep(key, [_i64(line)], source_etype=ir.IntType(8))
                    intrinsic(
                        b, "llvm.prefetch.p0", ir.VoidType(), at_line, _I32(0), _I32(3), _I32(1)
                    )
            return [_load_vec(b, dtype, k, ks, b.add(row, _i64(c * LANES))) for c in range(n_vec)]

        def page_rows() -> list[ir.Value]:
            return [b.load(at(rows, _I64, _i64(i)), typ=_I64) for i in range(BLOCK)]

        def page_value(row: ir.Value, col: ir.Value) -> ir.Value:
            return _load_vec(b, dtype, v, vs, b.add(row, col))

        in_pages = _Segment(page_key, page_rows, page_value, rotated=dtype == "q8_0")
        end = b.add(p, _i64(1))
        segments = [(in_pages, jlo, end)]
        if recent:
            start = word(pos, word(first_row, seq))  # the sequence's first position this step
            base = word(recent_row, seq)

            def near_key(j: ir.Value, i: ir.Value) -> list[ir.Value]:
                """Stage key ``j`` and its value (f16 values as f32) as key ``i``."""
                staged = [at(x, _VEC, b.mul(i, _i64(n_vec))) for x in (staged_k, staged_v)]
                with b.if_else(b.icmp_signed("<", j, start)) as (earlier, ours):
                    with earlier:  # an earlier step's token: the recent buffer
                        row = kv_row(b.add(base, b.urem(j, _i64(recent))))
                        for store, dst in zip((kr, vr), staged, strict=True):
                            for c in range(n_vec):
                                x = _load_vec(b, "f16", store, None, b.add(row, _i64(c * LANES)))
                                b.store(x, at(dst, _VEC, _i64(c)))
                    with ours:  # this step's: its f32 keys and values, rounded as stored
                        r, col = b.sub(t, b.sub(p, j)), b.mul(kh, _i64(head_dim))
                        for new, stride, dst in zip(
                            (k_new, v_new), (a[_K_STRIDE], a[_V_STRIDE]), staged, strict=True
                        ):
                            row = b.add(b.mul(r, stride), col)
                            for c in range(n_vec):
                                x = _load_vec(b, "f32>f16", new, None, b.add(row, _i64(c * LANES)))
                                b.store(x, at(dst, _VEC, _i64(c)))
                return [b.load(at(staged[0], _VEC, _i64(c)), typ=_VEC) for c in range(n_vec)]

            def near_rows() -> list[ir.Value]:
                return [_i64(i * head_dim) for i in range(BLOCK)]

            def near_value(row: ir.Value, col: ir.Value) -> ir.Value:
                return b.load(at(staged_v, _F32, b.add(row, col)), typ=_VEC, align=4)

            near = smax(smax(jlo, b.sub(p, _i64(recent - 1))), word(recent_from, seq))
            in_f16 = _Segment(near_key, near_rows, near_value, rotated=False)
            segments = [(in_pages, jlo, near), (in_f16, near, end)]
        for keys, first, stop in segments:
            segment(keys, first, stop)
        for g in range(heads):
            inv = _splat(b, b.fdiv(ir.Constant(_F32, 1.0), b.load(total[g], typ=_F32)))
            for c in range(n_vec):
                y = b.fmul(b.load(at(acc, _VEC, _i64(g * n_vec + c)), typ=_VEC), inv)
                b.store(y, at(out, _F32, b.add(obase, _i64(g * head_dim + c * LANES))), align=4)

    loop(b, lo, hi, 1, item)


def _write_recent(
    b: ir.IRBuilder, n_kv_heads: int, head_dim: int, recent: int, args: ir.Value
) -> None:
    """Store the step's keys and values in f16 at their sequences' recent-buffer rows, in
    token order (a sequence's last ``recent`` tokens are what stays)."""
    a, s = _blocks(b, args)
    seq_of, pos, recent_row = (_ptr(b, s[i]) for i in (_SEQ_OF, _POS, _RECENT_ROW))
    width, half = n_kv_heads * head_dim, ir.VectorType(ir.HalfType(), LANES)
    pairs = [
        (_ptr(b, a[new]), a[stride], _ptr(b, a[store]))
        for new, stride, store in ((_K_NEW, _K_STRIDE, _KR), (_V_NEW, _V_STRIDE, _VR))
    ]

    def token(t: ir.Value) -> None:
        seq, p = (b.load(_at(b, x, _I64, t), typ=_I64) for x in (seq_of, pos))
        row = b.add(b.load(_at(b, recent_row, _I64, seq), typ=_I64), b.urem(p, _i64(recent)))
        for new, stride, store in pairs:
            src, dst = b.mul(t, stride), b.mul(row, _i64(width))
            for c in range(0, width, LANES):
                x = b.load(_at(b, new, _F32, b.add(src, _i64(c))), typ=_VEC, align=4)
                y = _at(b, store, ir.HalfType(), b.add(dst, _i64(c)))
                b.store(b.fptrunc(x, half), y, align=2)

    loop(b, _i64(0), s[_TOKENS], 1, token)


_FUNCTIONS = ("items", "write", "write_recent", "run")


def _ir(
    name: str, dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int, recent: int
) -> str:
    """``name(args, lo, hi)``: work items lo..hi-1; ``name_write(args)``: store the step's
    keys and values in their pages; ``name_write_recent(args)``: in the recent buffers
    (after the items, which read the buffers' earlier tokens); ``name_run(args)``: all
    three, over all items of the step."""
    module = ir.Module(name=name)
    module.triple = str(jit.host_features()["triple"])
    void = ir.VoidType()
    items = ir.Function(module, ir.FunctionType(void, [_PTR, _I64, _I64]), name)
    write, write_recent, run = (
        ir.Function(module, ir.FunctionType(void, [_PTR]), f"{name}_{kind}")
        for kind in _FUNCTIONS[1:]
    )
    b = ir.IRBuilder(items.append_basic_block("entry"))
    _items(b, dtype, n_heads, n_kv_heads, head_dim, page, recent, *items.args)
    b.ret_void()
    b = ir.IRBuilder(write.append_basic_block("entry"))
    _write(b, dtype, n_kv_heads, head_dim, write.args[0])
    b.ret_void()
    b = ir.IRBuilder(write_recent.append_basic_block("entry"))
    if recent:
        _write_recent(b, n_kv_heads, head_dim, recent, write_recent.args[0])
    b.ret_void()
    b = ir.IRBuilder(run.append_basic_block("entry"))
    b.call(write, run.args)
    _, s = _blocks(b, run.args[0])
    per_token = _i64(n_heads // _item_heads(n_heads // n_kv_heads))
    b.call(items, [run.args[0], _i64(0), b.mul(s[_TOKENS], per_token)])
    b.call(write_recent, run.args)
    b.ret_void()
    return str(module)


@cache
def _kernels(
    dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int, recent: int
) -> dict:
    """Addresses of the module's ``items``, ``write``, ``write_recent`` and ``run``."""
    name = f"dynalm_attn_{dtype}_h{n_heads}_kv{n_kv_heads}_d{head_dim}_p{page}_r{recent}"
    names = [name] + [f"{name}_{kind}" for kind in _FUNCTIONS[1:]]
    text = _ir(name, dtype, n_heads, n_kv_heads, head_dim, page, recent)
    found = jit.compile_ir(text, names)
    return {kind: found[n] for kind, n in zip(_FUNCTIONS, names, strict=True)}


def _addr(a: np.ndarray) -> int:
    """The address of an array's data; through ctypes it costs ~0.4 us instead of the
    ~2-3 us of ``__array_interface__``, which is left for read-only and empty arrays."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.__array_interface__["data"][0]


def _row_stride(what: str, x: np.ndarray, rows: int, width: int) -> int:
    """Floats between the rows of ``x``: f32 ``[rows, width]`` with contiguous rows."""
    return check(what, x, np.float32, (rows, width), strided_rows=True).strides[0] // 4


def _check_layout(batch: AttentionBatch, n: int) -> None:
    """The kernels index the pages with the step's page tables and slots, walk each token's
    keys up to its sequence's length through its table, and read recent buffers from their
    first rows: all must lie in the pool."""
    kv, (pages, seq_of, _, recent_rows, _), slots = batch.kv, batch.kernel_tables, batch.slots
    require(len(seq_of) == n, f"{len(seq_of)} tokens in the page tables, {n} slots")
    if not (n and kv.k):
        return
    require(slots.min() >= 0 and slots.max() < len(kv.k[0]), "a KV slot outside the pool")
    n_pages = len(kv.k[0]) // kv.page_size
    require(pages.min() >= 0 and pages.max() < n_pages, "a page id outside the pool")
    widths = np.array([len(p) for p in batch.page_tables]) * kv.page_size
    require(bool((batch.seq_lens <= widths).all()), "a sequence longer than its pages")
    if kv.recent:
        end = recent_rows.max() + kv.recent
        require(recent_rows.min() >= 0 and end <= len(kv.k_recent[0]), "a recent buffer outside")


class StepLayout:
    """Where a step's tokens go, as every layer's kernel reads it: one block set per step."""

    def __init__(self) -> None:
        self._block = np.zeros(_N_STEP, np.int64)
        self.address = _addr(self._block)
        self.kv: KVStorage | None = None
        self.tokens = 0
        self._arrays: tuple[np.ndarray, ...] = ()

    def set(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        """The layout of ``batch``, whose tokens are at ``positions`` (int64, C order; may
        be longer than the step)."""
        pages, seq_of, *per_seq = batch.kernel_tables
        slots = np.ascontiguousarray(batch.slots, np.int64)
        n = len(slots)
        check("positions", positions, np.int64, (None,))
        require(len(positions) >= n, f"{len(positions)} positions for {n} tokens")
        _check_layout(batch, n)
        self._arrays = (pages, seq_of, positions, slots, *per_seq)  # alive while kernels run
        words = (n, _addr(pages), pages.shape[1], _addr(seq_of), _addr(positions), _addr(slots))
        self._block[:] = (*words, *map(_addr, per_seq))
        self.kv, self.tokens = batch.kv, n


class PagedAttention:
    """One layer's attention bound to its buffers: ``q``/``out`` ``[rows, heads *
    head_dim]`` and the step's ``k``/``v`` ``[rows, kv_heads * head_dim]`` (f32; the rows
    of q, k and v may be strided). A call stores this step's k/v in the layer's pages, then
    sets ``out[t]`` to the attention of ``q[t]`` over the keys at positions up to the
    token's own (within the window) of its sequence, for each token of ``step``."""

    def __init__(
        self,
        step: StepLayout,
        layer: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int,
        threads: int,
        out: np.ndarray,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
    ):
        require(
            n_kv_heads >= 1 and n_heads % n_kv_heads == 0 and supported(head_dim, "f32"),
            f"no attention kernel for {n_heads} heads, {n_kv_heads} kv heads of {head_dim}",
        )
        self._step, self._layer = step, layer
        self._geometry = (n_heads, n_kv_heads, head_dim)
        self._per_token = n_heads // _item_heads(n_heads // n_kv_heads)
        self._threads = threads if pool.available() else 1
        self._rows = len(out)
        check("out", out, np.float32, (self._rows, n_heads * head_dim))
        self._arrays = (out, q, k, v)  # alive while the kernel may run
        a = self._args = np.zeros(_N_ARGS, np.int64)
        for name, x, at, stride, heads in (
            ("q", q, _Q, _Q_STRIDE, n_heads),
            ("k", k, _K_NEW, _K_STRIDE, n_kv_heads),
            ("v", v, _V_NEW, _V_STRIDE, n_kv_heads),
        ):
            a[at], a[stride] = _addr(x), _row_stride(name, x, self._rows, heads * head_dim)
        a[_OUT], a[_WINDOW], a[_STEP] = _addr(out), window, step.address
        a[_SCALE] = struct.unpack("<q", struct.pack("<d", scale))[0]
        self._ptr = _addr(a)
        self._kv: KVStorage | None = None

    def _bind_kv(self, kv: KVStorage) -> None:
        """Kernels for ``kv``'s storage and the addresses of this layer's pages."""
        self._fns = fns = _kernels(kv.dtype, *self._geometry, kv.page_size, kv.recent)
        self._write, self._run, self._write_recent = (
            jit.cfunc(fns[f], None, ctypes.c_void_p) for f in ("write", "run", "write_recent")
        )
        layer, (_, n_kv_heads, head_dim) = self._layer, self._geometry
        require(supported(head_dim, kv.dtype), f"no {kv.dtype} attention for heads of {head_dim}")
        require(0 <= layer < len(kv.k), f"layer {layer} of a KV pool of {len(kv.k)} layers")
        store = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[kv.dtype]
        head = (n_kv_heads, head_dim)
        slots = len(kv.k[layer])
        stores = {_K: ("k", kv.k, store, head), _V: ("v", kv.v, store, head)}
        if kv.dtype == "q8_0":
            scales = (n_kv_heads, head_dim // Q8_BLOCK)
            stores |= {_KS: ("k_scale", kv.k_scale, np.float16, scales)}
            stores |= {_VS: ("v_scale", kv.v_scale, np.float16, scales)}
        if kv.recent:
            stores |= {_KR: ("k_recent", kv.k_recent, np.float16, head)}
            stores |= {_VR: ("v_recent", kv.v_recent, np.float16, head)}
        for at, (name, arrays, dtype, inner) in stores.items():
            rows = None if name.endswith("recent") else slots
            array = check(f"KV {name}[{layer}]", arrays[layer], dtype, (rows, *inner))
            self._args[at] = _addr(array)
        self._kv = kv

    def _plan(self) -> tuple[int, int] | None:
        """Bind the step's KV storage; (items, chunk) when this step's items are split over
        the pool, else None: with two items per thread (a T=1 decode of 3 items gains at
        most 1.5x and measured slower)."""
        if self._step.kv is not self._kv:
            self._bind_kv(self._step.kv)
        require(self._step.tokens <= self._rows, f"{self._step.tokens} tokens in {self._rows} rows")
        items, threads = self._step.tokens * self._per_token, self._threads
        if threads > 1 and items >= 2 * threads:
            return items, max(1, items // (4 * threads))
        return None

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """This step's calls as ``pool.Program`` records (valid while the step's token
        count and KV storage stay the same): store k/v, the items, the recent buffers."""
        split = self._plan()
        if split is None:
            return [(pool.PLAIN, self._fns["run"], self._ptr, 0, 0)]
        records = [
            (pool.PLAIN, self._fns["write"], self._ptr, 0, 0),
            (pool.SPLIT, self._fns["items"], self._ptr, *split),
        ]
        if self._kv.recent:
            records.append((pool.PLAIN, self._fns["write_recent"], self._ptr, 0, 0))
        return records

    def __call__(self) -> None:
        split = self._plan()
        if split is None:
            self._run(self._ptr)
        else:
            self._write(self._ptr)
            pool.pool(self._threads).run(self._fns["items"], self._ptr, *split)
            self._write_recent(self._ptr)
