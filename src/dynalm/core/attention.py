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
f32, f16 or q8_0 exactly as ``PagePool.write`` does), and ``run`` does both in one call.
q8_0 keys are stored Walsh-Hadamard rotated per 32 values (see ``kv_cache``), so an item
rotates its queries once the same way and scales scores by 1/32 more.
Everything a layer's kernel needs is bound once: its argument block holds the layer's
buffers (q, k and v may be column ranges of a wider merged buffer: each has a row stride)
and points at one :class:`StepLayout` block that the executor fills once per step (token
count, page tables, sequences, positions, slots). A decode step's attention is then one
ctypes call per layer, with no per-call Python work beyond choosing threads.

The kernel is built with ``llvmlite.ir`` and specialised per (kv dtype, heads, kv heads,
head dim, page size); the numpy ``cpu_ops.attention`` is its reference.
"""

from __future__ import annotations

import ctypes
import struct
from functools import cache
from typing import TYPE_CHECKING

import llvmlite.ir as ir
import numpy as np

from dynalm.core import jit, pool
from dynalm.core.elementwise import exp, intrinsic, loop

if TYPE_CHECKING:
    from dynalm.core.cpu_ops import AttentionBatch, KVStorage

# A layer's argument block, one int64 per slot: its q (rows ``Q_STRIDE`` floats apart),
# output, the step's new keys and values, the layer's KV pages (and q8_0 scales), the
# window, the scale (f64 bits) and the address of the step's layout block.
_Q, _Q_STRIDE, _OUT, _K_NEW, _K_STRIDE, _V_NEW, _V_STRIDE = range(7)
_K, _V, _KS, _VS, _WINDOW, _SCALE, _STEP, _N_ARGS = range(7, 15)
# The step's layout block: token count, page tables ``[S, MAX_PAGES]``, each token's
# sequence, position and KV slot.
_TOKENS, _PAGES, _MAX_PAGES, _SEQ_OF, _POS, _SLOTS, _N_STEP = range(7)
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


def _items(
    b: ir.IRBuilder,
    dtype: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    page: int,
    args: ir.Value,
    lo: ir.Value,
    hi: ir.Value,
) -> None:
    """Work items ``lo..hi-1``: each a query token's group of heads over its keys."""
    group = n_heads // n_kv_heads
    heads = _item_heads(group)
    n_vec, halves = head_dim // LANES, BLOCK // LANES

    def at(array: ir.Value, ty: ir.Type, index: ir.Value) -> ir.Value:
        return _at(b, array, ty, index)

    a, s = _blocks(b, args)
    q, out, k, v, ks, vs = (_ptr(b, a[i]) for i in (_Q, _OUT, _K, _V, _KS, _VS))
    pages, seq_of, pos = (_ptr(b, s[i]) for i in (_PAGES, _SEQ_OF, _POS))
    scale = b.fptrunc(b.bitcast(a[_SCALE], ir.DoubleType()), _F32)
    if dtype == "q8_0":  # rotated q . rotated k = 32 q . k; exact in f32
        scale = b.fmul(scale, ir.Constant(_F32, 1.0 / Q8_BLOCK))
    scale = _splat(b, scale)
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
    # The block's softmax weights, [head][key]: the value loop broadcasts each from memory
    # (a load) instead of shuffling it out of a register (48 shuffles per dim vector).
    block_weights = b.alloca(_VEC, size=heads * halves)

    def item(w: ir.Value) -> None:
        t = b.udiv(w, _i64(n_heads // heads))
        h0 = b.mul(b.urem(w, _i64(n_heads // heads)), _i64(heads))  # first query head
        kh = b.udiv(h0, _i64(group))
        p = b.load(at(pos, _I64, t), typ=_I64)
        table = at(pages, _I64, b.mul(b.load(at(seq_of, _I64, t), typ=_I64), s[_MAX_PAGES]))
        # keys from max(0, p - window + 1) (0 without a window) to p
        win = b.add(b.sub(p, a[_WINDOW]), _i64(1))
        win = b.select(b.icmp_signed(">", a[_WINDOW], _i64(0)), win, _i64(0))
        jlo = b.select(b.icmp_signed("<", win, _i64(0)), _i64(0), win)
        qbase = b.add(b.mul(t, a[_Q_STRIDE]), b.mul(h0, _i64(head_dim)))
        obase = b.mul(b.add(b.mul(t, _i64(n_heads)), h0), _i64(head_dim))
        qv = [
            [
                b.load(at(q, _F32, b.add(qbase, _i64(g * head_dim + c * LANES))), typ=_VEC, align=4)
                for c in range(n_vec)
            ]
            for g in range(heads)
        ]
        if dtype == "q8_0":  # like the stored keys
            qv = [_hadamard(b, qg) for qg in qv]
        for g in range(heads):
            b.store(neg_inf, m[g])
            b.store(ir.Constant(_F32, 0.0), total[g])
            for c in range(n_vec):
                b.store(zero, at(acc, _VEC, _i64(g * n_vec + c)))

        def key_row(j: ir.Value) -> ir.Value:
            """Element offset of key ``j`` (capped at ``p``: keys past it, the tail of the
            last block, reload key p and get weight 0, so every address stays inside the
            sequence's pages)."""
            j = b.select(b.icmp_signed("<", j, p), j, p)
            pid = b.load(at(table, _I64, b.udiv(j, _i64(page))), typ=_I64)
            slot = b.add(b.mul(pid, _i64(page)), b.urem(j, _i64(page)))
            return b.mul(b.add(b.mul(slot, _i64(n_kv_heads)), kh), _i64(head_dim))

        def score(j0: ir.Value, i: ir.Value) -> None:
            """Dot vectors of key ``j0 + i`` with each head's query, and its element offset."""
            row = key_row(b.add(j0, i))
            b.store(row, at(rows, _I64, i))
            # The same key of the next block, from memory: a step's weights stream through
            # the caches between two uses of a layer's pages, and the rows of one kv head
            # are strided (heads interleave), so the hardware prefetcher misses them.
            ahead = key_row(b.add(b.add(j0, i), _i64(BLOCK)))
            for store in (k, v):
                key = b.gep(store, [ahead], source_etype=_STORE[dtype])
                for line in range(0, head_dim * _BYTES[dtype], 64):
                    at_line = b.gep(key, [_i64(line)], source_etype=ir.IntType(8))
                    intrinsic(
                        b, "llvm.prefetch.p0", ir.VoidType(), at_line, _I32(0), _I32(3), _I32(1)
                    )
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
            key_rows = [b.load(at(rows, _I64, _i64(i)), typ=_I64) for i in range(BLOCK)]
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
                    vc = _load_vec(b, dtype, v, vs, b.add(key_rows[i], col))
                    ys = [
                        b.fadd(ys[g], b.fmul(weight(g, i), vc, flags=_FMA), flags=_FMA)
                        for g in range(heads)
                    ]
                for g in range(heads):
                    b.store(ys[g], sums[g])

            loop(b, _i64(0), _i64(n_vec), 1, dims)

        loop(b, jlo, b.add(p, _i64(1)), BLOCK, block, partial=True)
        for g in range(heads):
            inv = _splat(b, b.fdiv(ir.Constant(_F32, 1.0), b.load(total[g], typ=_F32)))
            for c in range(n_vec):
                y = b.fmul(b.load(at(acc, _VEC, _i64(g * n_vec + c)), typ=_VEC), inv)
                b.store(y, at(out, _F32, b.add(obase, _i64(g * head_dim + c * LANES))), align=4)

    loop(b, lo, hi, 1, item)


def _ir(name: str, dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int) -> str:
    """``name(args, lo, hi)``: work items lo..hi-1; ``name_write(args)``: store the step's
    keys and values; ``name_run(args)``: both, over all items of the step."""
    module = ir.Module(name=name)
    module.triple = str(jit.host_features()["triple"])
    void = ir.VoidType()
    items = ir.Function(module, ir.FunctionType(void, [_PTR, _I64, _I64]), name)
    write = ir.Function(module, ir.FunctionType(void, [_PTR]), f"{name}_write")
    run = ir.Function(module, ir.FunctionType(void, [_PTR]), f"{name}_run")
    b = ir.IRBuilder(items.append_basic_block("entry"))
    _items(b, dtype, n_heads, n_kv_heads, head_dim, page, *items.args)
    b.ret_void()
    b = ir.IRBuilder(write.append_basic_block("entry"))
    _write(b, dtype, n_kv_heads, head_dim, write.args[0])
    b.ret_void()
    b = ir.IRBuilder(run.append_basic_block("entry"))
    b.call(write, run.args)
    _, s = _blocks(b, run.args[0])
    per_token = _i64(n_heads // _item_heads(n_heads // n_kv_heads))
    b.call(items, [run.args[0], _i64(0), b.mul(s[_TOKENS], per_token)])
    b.ret_void()
    return str(module)


@cache
def _kernels(dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, page: int) -> dict:
    """Addresses of the module's ``items``, ``write`` and ``run`` functions."""
    name = f"dynalm_attn_{dtype}_h{n_heads}_kv{n_kv_heads}_d{head_dim}_p{page}"
    names = [name, f"{name}_write", f"{name}_run"]
    text = _ir(name, dtype, n_heads, n_kv_heads, head_dim, page)
    found = jit.compile_ir(text, names)
    return {kind: found[n] for kind, n in zip(("items", "write", "run"), names, strict=True)}


def _addr(a: np.ndarray) -> int:
    """The address of an array's data; through ctypes it costs ~0.4 us instead of the
    ~2-3 us of ``__array_interface__``, which is left for read-only and empty arrays."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.__array_interface__["data"][0]


def _row_stride(x: np.ndarray, width: int) -> int:
    """Floats between the rows of ``x``: f32 ``[rows, width]`` with contiguous rows."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != width or x.strides[1] != 4:
        raise ValueError(f"expected f32 rows of {width} contiguous values, got {x.dtype} {x.shape}")
    return x.strides[0] // 4


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
        pages, seq_of = batch.kernel_tables
        slots = np.ascontiguousarray(batch.slots, np.int64)
        assert positions.dtype == np.int64 and positions.flags.c_contiguous
        n = len(slots)
        self._arrays = (pages, seq_of, positions, slots)  # alive while kernels read them
        words = (n, _addr(pages), pages.shape[1], _addr(seq_of), _addr(positions), _addr(slots))
        self._block[:] = words
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
        self._step, self._layer = step, layer
        self._geometry = (n_heads, n_kv_heads, head_dim)
        self._per_token = n_heads // _item_heads(n_heads // n_kv_heads)
        self._threads = threads if pool.available() else 1
        if _row_stride(out, n_heads * head_dim) != n_heads * head_dim:
            raise ValueError("the attention output must be C-contiguous")
        self._arrays = (out, q, k, v)  # alive while the kernel may run
        a = self._args = np.zeros(_N_ARGS, np.int64)
        for x, at, stride, heads in (
            (q, _Q, _Q_STRIDE, n_heads),
            (k, _K_NEW, _K_STRIDE, n_kv_heads),
            (v, _V_NEW, _V_STRIDE, n_kv_heads),
        ):
            a[at], a[stride] = _addr(x), _row_stride(x, heads * head_dim)
        a[_OUT], a[_WINDOW], a[_STEP] = _addr(out), window, step.address
        a[_SCALE] = struct.unpack("<q", struct.pack("<d", scale))[0]
        self._ptr = _addr(a)
        self._kv: KVStorage | None = None

    def _bind_kv(self, kv: KVStorage) -> None:
        """Kernels for ``kv``'s storage and the addresses of this layer's pages."""
        self._fns = fns = _kernels(kv.dtype, *self._geometry, kv.page_size)
        self._write, self._run = (
            jit.cfunc(fns[f], None, ctypes.c_void_p) for f in ("write", "run")
        )
        stores = [kv.k[self._layer], kv.v[self._layer]]
        if kv.dtype == "q8_0":
            stores += [kv.k_scale[self._layer], kv.v_scale[self._layer]]
        for slot, array in zip((_K, _V, _KS, _VS), stores, strict=False):
            self._args[slot] = _addr(array)
        self._kv = kv

    def _plan(self) -> tuple[int, int] | None:
        """Bind the step's KV storage; (items, chunk) when this step's items are split over
        the pool, else None: with two items per thread (a T=1 decode of 3 items gains at
        most 1.5x and measured slower)."""
        if self._step.kv is not self._kv:
            self._bind_kv(self._step.kv)
        items, threads = self._step.tokens * self._per_token, self._threads
        if threads > 1 and items >= 2 * threads:
            return items, max(1, items // (4 * threads))
        return None

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """This step's calls as ``pool.Program`` records (valid while the step's token
        count and KV storage stay the same): store k/v, then the items."""
        split = self._plan()
        if split is None:
            return [(pool.PLAIN, self._fns["run"], self._ptr, 0, 0)]
        return [
            (pool.PLAIN, self._fns["write"], self._ptr, 0, 0),
            (pool.SPLIT, self._fns["items"], self._ptr, *split),
        ]

    def __call__(self) -> None:
        split = self._plan()
        if split is None:
            self._run(self._ptr)
        else:
            self._write(self._ptr)
            pool.pool(self._threads).run(self._fns["items"], self._ptr, *split)
