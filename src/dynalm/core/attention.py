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

The kernel is built with ``llvmlite.ir`` and specialised per (kv dtype, heads, kv heads,
head dim, page size); the numpy ``cpu_ops.attention`` is its reference.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from functools import cache

import llvmlite.ir as ir
import numpy as np

from dynalm.core import jit, pool
from dynalm.core.elementwise import exp, intrinsic

# Argument block: one int64 per slot.
_Q, _OUT, _K, _V, _KS, _VS, _PAGES, _SEQ_OF, _POS, _MAX_PAGES, _WINDOW, _SCALE = range(12)
_N_ARGS = 12
_ARRAY_SLOTS = (_Q, _OUT, _K, _V, _PAGES, _SEQ_OF, _POS, _KS, _VS)
LANES = 8  # one AVX2 register of f32
BLOCK = 2 * LANES  # keys per online-softmax step
Q8_BLOCK = 32
# Query heads per work item at most: more would crowd the loops' registers and leave
# fewer items to split over threads.
_MAX_ITEM_HEADS = 4
# Split over threads only with two items per thread (a T=1 decode of 3 items gains at most
# 1.5x and measured slower) and enough work, items x keys, to pay for the hand-off.
_PARALLEL_MIN_WORK = 1024

_F32, _I64, _I32, _PTR = ir.FloatType(), ir.IntType(64), ir.IntType(32), ir.PointerType()
_VEC = ir.VectorType(_F32, LANES)
_STORE = {"f32": _F32, "f16": ir.HalfType(), "q8_0": ir.IntType(8)}
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


def _for(
    b: ir.IRBuilder, start: ir.Value, stop: ir.Value, step: int, body: Callable[[ir.Value], None]
) -> None:
    """``for i in range(start, stop, step): body(i)`` (signed, runs while ``i < stop``)."""
    pre = b.block
    head, blk, end = (b.append_basic_block() for _ in range(3))
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(_I64)
    i.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<", i, stop), blk, end)
    b.position_at_end(blk)
    body(i)
    i.add_incoming(b.add(i, _i64(step)), b.block)
    b.branch(head)
    b.position_at_end(end)


def _load_vec(
    b: ir.IRBuilder, dtype: str, store: ir.Value, scales: ir.Value, at: ir.Value
) -> ir.Value:
    """Elements ``at..at+7`` of a key or value store (``at`` a multiple of 8) as f32."""
    ty = _STORE[dtype]
    raw = b.load(b.gep(store, [at], source_etype=ty), typ=ir.VectorType(ty, LANES), align=1)
    if dtype == "f32":
        return raw
    if dtype == "f16":
        return b.fpext(raw, _VEC)
    # q8_0: int8 values times the f16 scale of their 32-value block
    half = ir.HalfType()
    scale = b.load(b.gep(scales, [b.udiv(at, _i64(Q8_BLOCK))], source_etype=half), typ=half)
    return b.fmul(b.sitofp(raw, _VEC), _splat(b, b.fpext(scale, _F32)))


def _ir(name: str, dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int) -> str:
    group = n_heads // n_kv_heads
    heads = _item_heads(group)
    n_vec, halves = head_dim // LANES, BLOCK // LANES
    module = ir.Module(name=name)
    module.triple = str(jit.host_features()["triple"])
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_PTR, _I64, _I64]), name)
    args, lo, hi = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def at(array: ir.Value, ty: ir.Type, index: ir.Value) -> ir.Value:
        return b.gep(array, [index], source_etype=ty)

    a = [b.load(at(args, _I64, _i64(i)), typ=_I64) for i in range(_N_ARGS)]
    q, out, k, v, ks, vs, pages, seq_of, pos = (
        b.inttoptr(a[i], _PTR) for i in (_Q, _OUT, _K, _V, _KS, _VS, _PAGES, _SEQ_OF, _POS)
    )
    scale = _splat(b, b.fptrunc(b.bitcast(a[_SCALE], ir.DoubleType()), _F32))
    neg_inf, zero = ir.Constant(_F32, float("-inf")), ir.Constant(_VEC, [0.0] * LANES)
    lane = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
    # Per item, on the stack: each head's running max and sum (promoted to registers by
    # LLVM); its weighted value sums [head][dim vector] and, per block, the keys' element
    # offsets and dot vectors [head][key], which the loops below index.
    m = [b.alloca(_F32) for _ in range(heads)]
    total = [b.alloca(_F32) for _ in range(heads)]
    acc = b.alloca(_VEC, size=heads * n_vec)
    rows = b.alloca(_I64, size=BLOCK)
    dots = b.alloca(_VEC, size=heads * BLOCK)

    def item(w: ir.Value) -> None:
        t = b.udiv(w, _i64(n_heads // heads))
        h0 = b.mul(b.urem(w, _i64(n_heads // heads)), _i64(heads))  # first query head
        kh = b.udiv(h0, _i64(group))
        p = b.load(at(pos, _I64, t), typ=_I64)
        table = at(pages, _I64, b.mul(b.load(at(seq_of, _I64, t), typ=_I64), a[_MAX_PAGES]))
        # keys from max(0, p - window + 1) (0 without a window) to p
        win = b.add(b.sub(p, a[_WINDOW]), _i64(1))
        win = b.select(b.icmp_signed(">", a[_WINDOW], _i64(0)), win, _i64(0))
        jlo = b.select(b.icmp_signed("<", win, _i64(0)), _i64(0), win)
        qbase = b.mul(b.add(b.mul(t, _i64(n_heads)), h0), _i64(head_dim))
        qv = [
            [
                b.load(at(q, _F32, b.add(qbase, _i64(g * head_dim + c * LANES))), typ=_VEC, align=4)
                for c in range(n_vec)
            ]
            for g in range(heads)
        ]
        for g in range(heads):
            b.store(neg_inf, m[g])
            b.store(ir.Constant(_F32, 0.0), total[g])
            for c in range(n_vec):
                b.store(zero, at(acc, _VEC, _i64(g * n_vec + c)))

        def score(j0: ir.Value, i: ir.Value) -> None:
            """Dot vectors of key ``j0 + i`` with each head's query, and its element offset."""
            # Keys past p (the tail of the last block) reload key p and get weight 0
            # below, so every address stays inside the sequence's pages.
            j = b.add(j0, i)
            j = b.select(b.icmp_signed("<", j, p), j, p)
            pid = b.load(at(table, _I64, b.udiv(j, _i64(page))), typ=_I64)
            slot = b.add(b.mul(pid, _i64(page)), b.urem(j, _i64(page)))
            row = b.mul(b.add(b.mul(slot, _i64(n_kv_heads)), kh), _i64(head_dim))
            b.store(row, at(rows, _I64, i))
            dot = [zero] * heads
            for c in range(n_vec):  # each key vector is loaded once for all heads
                kc = _load_vec(b, dtype, k, ks, b.add(row, _i64(c * LANES)))
                dot = [
                    b.fadd(dot[g], b.fmul(qv[g][c], kc, flags=_FMA), flags=_FMA)
                    for g in range(heads)
                ]
            for g in range(heads):
                b.store(dot[g], at(dots, _VEC, b.add(i, _i64(g * BLOCK))))

        def softmax(j0: ir.Value) -> tuple[list[list[ir.Value]], ir.Value]:
            """Each head's block weights ``exp(score - new max)`` (``halves`` vectors) and
            the rescale factors ``exp(old max - new max)`` of all heads in one vector."""
            valid = [
                b.icmp_signed(
                    "<=", b.add(_splat(b, b.add(j0, _i64(h * LANES))), lane), _splat(b, p)
                )
                for h in range(halves)
            ]
            weights, rescale = [], zero
            for g in range(heads):
                x = []
                for h in range(halves):
                    first = g * BLOCK + h * LANES
                    d = [b.load(at(dots, _VEC, _i64(first + i)), typ=_VEC) for i in range(LANES)]
                    x.append(b.select(valid[h], b.fmul(_row_sums(b, d), scale), _splat(b, neg_inf)))
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
            _for(b, _i64(0), _i64(BLOCK), 1, lambda i: score(j0, i))
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
            w = [
                [
                    _shuffle(b, weights[g][i // LANES], weights[g][i // LANES], [i % LANES] * LANES)
                    for i in range(BLOCK)
                ]
                for g in range(heads)
            ]
            key_rows = [b.load(at(rows, _I64, _i64(i)), typ=_I64) for i in range(BLOCK)]
            r = [_splat(b, rg) for rg in r]

            def dims(c: ir.Value) -> None:
                # One dim vector of each head's value sum at a time, over the block's keys
                # (unrolled over dims, LLVM would interleave and spill all the sums).
                col = b.mul(c, _i64(LANES))
                sums = [at(acc, _VEC, b.add(c, _i64(g * n_vec))) for g in range(heads)]
                ys = [b.fmul(b.load(sums[g], typ=_VEC), r[g]) for g in range(heads)]
                for i in range(BLOCK):
                    vc = _load_vec(b, dtype, v, vs, b.add(key_rows[i], col))
                    ys = [
                        b.fadd(ys[g], b.fmul(w[g][i], vc, flags=_FMA), flags=_FMA)
                        for g in range(heads)
                    ]
                for g in range(heads):
                    b.store(ys[g], sums[g])

            _for(b, _i64(0), _i64(n_vec), 1, dims)

        _for(b, jlo, b.add(p, _i64(1)), BLOCK, block)
        for g in range(heads):
            inv = _splat(b, b.fdiv(ir.Constant(_F32, 1.0), b.load(total[g], typ=_F32)))
            for c in range(n_vec):
                y = b.fmul(b.load(at(acc, _VEC, _i64(g * n_vec + c)), typ=_VEC), inv)
                b.store(y, at(out, _F32, b.add(qbase, _i64(g * head_dim + c * LANES))), align=4)

    _for(b, lo, hi, 1, item)
    b.ret_void()
    return str(module)


@cache
def _kernel(dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int) -> int:
    name = f"dynalm_attn_{dtype}_h{n_heads}_kv{n_kv_heads}_d{head_dim}_p{page}"
    return jit.compile_ir(_ir(name, dtype, n_heads, n_kv_heads, head_dim, page), [name])[name]


def _addr(a: np.ndarray) -> int:
    """The address of an array's data; through ctypes it costs ~0.4 us instead of the
    ~2-3 us of ``__array_interface__``, which is left for read-only and empty arrays."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.__array_interface__["data"][0]


class PagedAttention:
    """Attention of one layer's geometry over a paged KV pool, on ``threads`` threads."""

    def __init__(
        self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, window: int, threads: int
    ):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self._items_per_token = n_heads // _item_heads(n_heads // n_kv_heads)
        self._args = (ctypes.c_int64 * _N_ARGS)()
        self._args_ptr = ctypes.addressof(self._args)
        self._args[_WINDOW] = window
        self._args[_SCALE] = struct.unpack("<q", struct.pack("<d", scale))[0]
        self._threads = threads if pool.available() else 1
        # The array behind each address slot, kept alive: an executor passes the same
        # buffers every step, and re-reading their addresses would cost more than the
        # kernel does for a short decode.
        self._bound: list[np.ndarray | None] = [None] * _N_ARGS
        self._fn_key: tuple | None = None
        self._fn = 0
        self._call = None

    def __call__(
        self,
        out: np.ndarray,
        q: np.ndarray,
        layer: int,
        kv,
        pages: np.ndarray,
        seq_of: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        """``out[t]`` = attention of ``q[t]`` (``[T, heads * head_dim]`` f32, C order) over
        the keys at positions ``<= positions[t]`` of sequence ``seq_of[t]``, whose pages are
        row ``seq_of[t]`` of ``pages`` (int64 ``[S, max_pages]``)."""
        key = (kv.dtype, self.n_heads, self.n_kv_heads, self.head_dim, kv.page_size)
        if key != self._fn_key:
            self._fn_key, self._fn = key, _kernel(*key)
            self._call = jit.cfunc(self._fn, None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
        arrays = [q, out, kv.k[layer], kv.v[layer], pages, seq_of, positions]
        if kv.dtype == "q8_0":
            arrays += [kv.k_scale[layer], kv.v_scale[layer]]
        a, bound = self._args, self._bound
        for slot, array in zip(_ARRAY_SLOTS[: len(arrays)], arrays, strict=True):
            if array is not bound[slot]:
                a[slot], bound[slot] = _addr(array), array
        a[_MAX_PAGES] = pages.shape[1]
        items = q.shape[0] * self._items_per_token
        threads = self._threads
        # the last token's position stands in for the context length of every item
        if (
            threads > 1
            and items >= 2 * threads
            and items * int(positions[-1]) >= _PARALLEL_MIN_WORK
        ):
            pool.pool(threads).run(self._fn, self._args_ptr, items, max(1, items // (4 * threads)))
        else:
            self._call(self._args_ptr, 0, items)
