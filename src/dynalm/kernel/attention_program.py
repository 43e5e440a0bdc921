"""Paged attention as one program: blockwise online softmax over keys read through page tables.

One work item is one (query token, group of query heads sharing a kv head): it walks the
keys of its sequence from the window start to its own position in blocks of ``BLOCK``,
loading each key and value once for all heads of the group straight from the page that
holds it (no gather into a contiguous buffer), in f32, f16 or q8_0 storage. Per block and
head, the scores go into vectors (a transposing horizontal sum), and the online softmax
takes one max, a vectorised polynomial exp for the weights and one rescale exp (shared by
the heads) before the weighted value sum, instead of two libm calls and a serial chain per
key. Items are independent, so the result of a token never depends on what else is in the
batch, and the native pool splits items across threads.

Split-K (flash-decoding): an item's keys are walked in chunks of ``CHUNK`` keys from its
window start, each chunk an online softmax of its own (its maximum, sum of exps and
weighted value sums per head), folded into the first chunk's in chunk order. The chunks
and the fold are the arithmetic; where they run is a schedule (``items``: all of an
item's chunks on one thread; ``parts`` + ``merge``: chunks on different threads, or GPU
threads, through a scratch of partials), so every schedule gives the same bits, and a
context of one chunk is exactly the unsplit online softmax.

The same module stores the step's keys and values into their pages first (``write``:
f32, f16 or q8_0 exactly as ``PagePool.write`` does), one (token, kv head) row at a time
through the row-range ``write_rows``, which a GPU runs as a thread per row.
q8_0 keys are stored Walsh-Hadamard rotated per 32 values (see ``kv_cache``), so an item
rotates its queries once the same way and scales scores by 1/32 more. With q8_0 pages, the
keys within the recent window of a query are read in f16 instead, from the sequence's
recent buffer or the step's own keys, and ``write_recent`` stores the step's keys there
after the items (``run`` does all three).

The program is written for 8 fp32 lanes whatever the backend (its float order, which the
attention tests and the models' fidelity are measured with, does not change with the
host); it uses no ISA-dependent primitive. Specialised per (kv dtype, heads, kv heads,
head dim, page size, recent window, score cap); ``core.attention`` binds it, and the numpy
``cpu_ops.attention`` is its reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import F16, F32, I8, I32, I64, PTR, Kernel, Module, const, vec

# A layer's argument block, one int64 per slot: its q (rows ``A_Q_STRIDE`` floats apart),
# output, the step's new keys and values, the layer's KV pages (and q8_0 scales and recent
# buffers), the window, the scale (f64 bits) and the address of the step's layout block.
A_Q, A_Q_STRIDE, A_OUT, A_K_NEW, A_K_STRIDE, A_V_NEW, A_V_STRIDE = range(7)
A_K, A_V, A_KS, A_VS, A_KR, A_VR, A_WINDOW, A_SCALE, A_STEP, A_SLICES = range(7, 17)
A_SINKS, N_ARGS = range(17, 19)
# ``A_SLICES``: the slices of an item ``parts`` runs (see split-K below); ``A_SINKS``: the
# heads' sink logits (f32 [n_heads]), read by a program built with ``sinks``.
# The step's layout block: token count, page tables ``[S, MAX_PAGES]``, each token's
# sequence, position and KV slot, per sequence its first row in the step, its recent
# buffer's first row and the first position the buffer holds, and the partial results'
# scratch of ``parts`` (``records(...)`` per item and chunk).
S_TOKENS, S_PAGES, S_MAX_PAGES, S_SEQ_OF, S_POS, S_SLOTS = range(6)
S_FIRST_ROW, S_RECENT_ROW, S_RECENT_FROM, S_PARTS, N_STEP = range(6, 11)
LANES = 8  # f32 lanes of the program's vectors
BLOCK = 2 * LANES  # keys per online-softmax step
Q8_BLOCK = 32
# Query heads per work item at most: more would crowd the loops' registers and leave
# fewer items to split over threads.
MAX_ITEM_HEADS = 4
# Split-K (flash-decoding): an item's keys, from its window start, in chunks of ``CHUNK``;
# each chunk's softmax partial (max, sum of exps, weighted value sums per head) is folded
# into the first in chunk order. A context of one chunk is the unsplit computation.
CHUNK = 256
FUNCTIONS = ("items", "parts", "merge", "write_rows", "write", "write_recent", "run")

_VEC = vec(F32, LANES)
_STORE = {"f32": F32, "f16": F16, "q8_0": I8}
_BYTES = {"f32": 4, "f16": 2, "q8_0": 1}
_FMA = ("contract",)  # let fmul + fadd fuse into FMA
_VEC_ALIGN = 32  # the stack arrays of vectors


def supported(head_dim: int, dtype: str) -> bool:
    return head_dim % LANES == 0 and (dtype != "q8_0" or head_dim % Q8_BLOCK == 0)


def item_heads(group: int) -> int:
    """Query heads per work item: the largest divisor of the group within the cap."""
    return max(d for d in range(1, MAX_ITEM_HEADS + 1) if group % d == 0)


def chunks(context: int) -> int:
    """Split-K chunks of an item over ``context`` keys (at least one)."""
    return max(1, -(-context // CHUNK))


def record_floats(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """A partial result's floats: its heads' maxima and sums (a vector each, head ``g`` in
    lane ``g``), then each head's weighted value sums."""
    return 2 * LANES + item_heads(n_heads // n_kv_heads) * head_dim


def parts_bytes(items: int, capacity: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """The ``S_PARTS`` scratch ``parts`` needs for ``items`` work items over a KV pool of
    ``capacity`` slots (no sequence is longer): a record per item and chunk."""
    return 4 * items * chunks(capacity) * record_floats(n_heads, n_kv_heads, head_dim)


def _row_sums(k: Kernel, rows: list[ir.Value]) -> ir.Value:
    """``[sum(rows[0]), ..., sum(rows[7])]``: two rounds of in-lane pairwise adds (vhaddps)
    and one add of the 128-bit halves, instead of eight horizontal reductions."""

    def hadd(x: ir.Value, y: ir.Value) -> ir.Value:
        even = k.shuffle(x, [0, 2, 8, 10, 4, 6, 12, 14], y)
        return k.add(even, k.shuffle(x, [1, 3, 9, 11, 5, 7, 13, 15], y))

    pairs = [hadd(rows[i], rows[i + 1]) for i in range(0, LANES, 2)]
    x, y = hadd(pairs[0], pairs[1]), hadd(pairs[2], pairs[3])
    return k.add(
        k.shuffle(x, [0, 1, 2, 3, 8, 9, 10, 11], y), k.shuffle(x, [4, 5, 6, 7, 12, 13, 14, 15], y)
    )


def _load_vec(
    k: Kernel, dtype: str, store: ir.Value, scales: ir.Value | None, at: ir.Value
) -> ir.Value:
    """Elements ``at..at+7`` of a key or value store (``at`` a multiple of 8) as f32;
    ``f32>f16``: f32 elements rounded to f16 and back."""
    ty = _STORE[dtype.split(">")[0]]
    raw = k.load(vec(ty, LANES), k.index(store, at, ty))
    if dtype == "f32":
        return raw
    if dtype == "f32>f16":
        return k.convert(k.convert(raw, F16), F32)
    if dtype == "f16":
        return k.convert(raw, F32)
    # q8_0: int8 values times the f16 scale of their 32-value block
    scale = k.load(F16, k.index(scales, k.udiv(at, Q8_BLOCK), F16), align=2)
    return k.mul(k.convert(raw, F32), k.splat(k.convert(scale, F32), LANES))


def _word(k: Kernel, array: ir.Value, i: ir.Value) -> ir.Value:
    """``array[i]`` of an int64 array."""
    return k.load(I64, k.index(array, i, I64), align=8)


def _blocks(k: Kernel) -> tuple[list[ir.Value], list[ir.Value]]:
    """The words of a layer's argument block and of the step block it points at."""
    a = k.words(k.args[0], N_ARGS)
    return a, k.words(k.pointer(a[A_STEP]), N_STEP)


def _hadamard(k: Kernel, xs: list[ir.Value]) -> list[ir.Value]:
    """``kv_cache.hadamard`` of vectors ``xs`` (four per 32 values): the same butterfly
    stages in the same order, h = 1, 2, 4 across lanes, then 8, 16 across vectors."""
    xs = list(xs)
    for h in (1, 2, 4):
        for n, x in enumerate(xs):
            lo = k.shuffle(x, [j & ~h for j in range(LANES)], x)
            hi = k.shuffle(x, [j | h for j in range(LANES)], x)
            pick = [j + LANES * bool(j & h) for j in range(LANES)]
            xs[n] = k.shuffle(k.add(lo, hi), pick, k.sub(lo, hi))
    for h in (1, 2):  # vector n pairs with n + h
        for n in range(len(xs)):
            if not n & h:
                xs[n], xs[n + h] = k.add(xs[n], xs[n + h]), k.sub(xs[n], xs[n + h])
    return xs


def _quantise(k: Kernel, xs: list[ir.Value], scales: ir.Value, at: ir.Value) -> list[ir.Value]:
    """One q8_0 block (four vectors): its int8 vectors; its f16 scale stored at
    ``scales[at / 32]`` (numpy's f32 operations in numpy's order, so bitwise equal)."""
    mags = [k.call("llvm.fabs.v8f32", _VEC, x) for x in xs]
    amax = mags[0]
    for m in mags[1:]:
        amax = k.call("llvm.maxnum.v8f32", _VEC, amax, m)
    amax = k.reduce("fmax", amax)
    d = k.b.fdiv(amax, const(F32, 127.0))
    positive = k.b.fcmp_ordered(">", d, const(F32, 0.0))
    inv = k.splat(k.select(positive, k.b.fdiv(const(F32, 1.0), d), 0.0), LANES)
    k.store(k.convert(d, F16), k.index(scales, k.udiv(at, Q8_BLOCK), F16), align=2)
    return [k.convert(k.call("llvm.rint.v8f32", _VEC, k.mul(x, inv)), I8) for x in xs]


def _write(k: Kernel, dtype: str, n_kv_heads: int, head_dim: int) -> None:
    """Rows ``lo..hi-1`` of the step's keys and values, row ``r`` token ``r // n_kv_heads``'s
    kv head ``r % n_kv_heads``, stored at their slots as ``PagePool.write`` does: cast to
    f16, or q8_0 (scale ``max|x| / 127`` per 32 values, ``rint(x / scale)``, keys rotated
    first). Rows are disjoint (a head's q8_0 blocks lie in its row), so any split of the
    range stores the same bytes: the GPU runs a thread per row."""
    a, s = _blocks(k)
    lo, hi = k.args[1], k.args[2]
    slots, ty = k.pointer(s[S_SLOTS]), _STORE[dtype]
    chunk = Q8_BLOCK if dtype == "q8_0" else LANES  # values converted together
    pairs = [
        (k.pointer(a[new]), a[stride], k.pointer(a[store]), k.pointer(a[scales]), rotate)
        for new, stride, store, scales, rotate in (
            (A_K_NEW, A_K_STRIDE, A_K, A_KS, True),
            (A_V_NEW, A_V_STRIDE, A_V, A_VS, False),
        )
    ]

    def row(r: ir.Value) -> None:
        t, h = k.udiv(r, n_kv_heads), k.b.urem(r, k.i64(n_kv_heads))
        slot = _word(k, slots, t)
        for new, stride, store, scales, rotate in pairs:
            src = k.add(k.mul(t, stride), k.mul(h, head_dim))
            dst = k.mul(k.add(k.mul(slot, n_kv_heads), h), head_dim)
            for c in range(0, head_dim, chunk):
                xs = [
                    k.load(_VEC, k.index(new, k.add(src, i), F32), align=4)
                    for i in range(c, c + chunk, LANES)
                ]
                if dtype == "q8_0":
                    xs = _quantise(k, _hadamard(k, xs) if rotate else xs, scales, k.add(dst, c))
                elif dtype == "f16":
                    xs = [k.convert(x, F16) for x in xs]
                for i, x in enumerate(xs):
                    k.store(x, k.index(store, k.add(dst, c + i * LANES), ty))

    k.loop(lo, hi, 1, row)


@dataclass
class _Segment:
    """How a run of an item's keys is read: ``key(j, i)`` returns key ``j``'s vectors (as
    key ``i`` of the block, noting where its value is), ``rows()`` the block's value handles
    and ``value(row, col)`` one value vector; keys stored Hadamard-rotated or not."""

    key: Callable[[ir.Value, ir.Value], list[ir.Value]]
    rows: Callable[[], list[ir.Value]]
    value: Callable[[ir.Value, ir.Value], ir.Value]
    rotated: bool


@dataclass
class _Item:
    """A work item's query token, first query head, kv head, position and sequence, its
    keys ``jlo..end-1`` and their split-K chunk count."""

    t: ir.Value
    h0: ir.Value
    kh: ir.Value
    p: ir.Value
    seq: ir.Value
    jlo: ir.Value
    end: ir.Value
    n: ir.Value


def _item(
    k: Kernel, a: list[ir.Value], s: list[ir.Value], w: ir.Value, n_heads: int, n_kv_heads: int
) -> _Item:
    """Work item ``w`` of the step: its keys are from ``max(0, p - window + 1)`` (0 without
    a window) to its position ``p``."""
    b, group = k.b, n_heads // n_kv_heads
    per_token = n_heads // item_heads(group)
    t = k.udiv(w, per_token)
    h0 = k.mul(b.urem(w, k.i64(per_token)), item_heads(group))
    p, seq = _word(k, k.pointer(s[S_POS]), t), _word(k, k.pointer(s[S_SEQ_OF]), t)
    win = k.add(k.sub(p, a[A_WINDOW]), 1)
    win = k.select(b.icmp_signed(">", a[A_WINDOW], k.i64(0)), win, 0)
    jlo, end = k.smax(win, 0), k.add(p, 1)
    n = k.udiv(k.add(k.sub(end, jlo), CHUNK - 1), CHUNK)
    return _Item(t, h0, k.udiv(h0, group), p, seq, jlo, end, n)


def _chunk(k: Kernel, dtype: str, softcap: float, *geometry: int) -> None:
    """``chunk(args, w, c, record)``: work item ``w`` (a query token's group of heads) over
    its keys' chunk ``c``, its partial result stored at ``record`` (``record_floats``);
    ``geometry``: heads, kv heads, head dim, page size, recent window.
    With ``recent``, the keys within ``recent`` positions of the query (and computed by its
    sequence since ``recent_from``) are read in f16, from the sequence's recent buffer for
    earlier steps' tokens and from the step's f32 keys rounded to f16 for its own, the same
    values either way: each is staged in f32 on the stack, so a result does not depend on
    where the step's chunk starts. Older keys come from the pages. With ``softcap`` > 0,
    each scaled score s becomes ``softcap * tanh(s / softcap)`` (Gemma 2's logit cap)."""
    n_heads, n_kv_heads, head_dim, page, recent = geometry
    b = k.b
    w, chunk, record = k.args[1], k.args[2], k.args[3]
    group = n_heads // n_kv_heads
    heads = item_heads(group)
    n_vec, halves = head_dim // LANES, BLOCK // LANES

    def vec_at(array: ir.Value, i: ir.Value | int) -> ir.Value:
        return k.index(array, i, _VEC)

    def get(slot: ir.Value, ty: ir.Type = _VEC) -> ir.Value:
        return k.load(ty, slot, align=_VEC_ALIGN if ty == _VEC else 4)

    def put(value: ir.Value, slot: ir.Value) -> None:
        k.store(value, slot, align=_VEC_ALIGN if value.type == _VEC else 4)

    a, s = _blocks(k)
    q, kp, vp, ks, vs, kr, vr = (k.pointer(a[i]) for i in (A_Q, A_K, A_V, A_KS, A_VS, A_KR, A_VR))
    k_new, v_new = k.pointer(a[A_K_NEW]), k.pointer(a[A_V_NEW])
    pages, pos = (k.pointer(s[i]) for i in (S_PAGES, S_POS))
    first_row, recent_row, recent_from = (
        k.pointer(s[i]) for i in (S_FIRST_ROW, S_RECENT_ROW, S_RECENT_FROM)
    )
    scale = k.convert(k.bitcast(a[A_SCALE], ir.DoubleType()), F32)
    neg_inf, zero = const(F32, float("-inf")), const(_VEC, 0.0)
    lane = const(vec(I64, LANES), list(range(LANES)))
    # Per item, on the stack: each head's running max and sum (promoted to registers by
    # LLVM); its weighted value sums [head][dim vector] and, per block, the keys' value
    # rows and dot vectors [head][key], which the loops below index.
    m = [b.alloca(F32) for _ in range(heads)]
    total = [b.alloca(F32) for _ in range(heads)]
    acc = b.alloca(_VEC, size=heads * n_vec)
    rows = b.alloca(I64, size=BLOCK)
    dots = b.alloca(_VEC, size=heads * BLOCK)
    # The block's softmax weights, [head][key]: the value loop broadcasts each from memory
    # (a load) instead of shuffling it out of a register (48 shuffles per dim vector).
    block_weights = b.alloca(_VEC, size=heads * halves)
    if recent:  # the near keys and values of a block, staged in f32 [key][dim]
        staged_k, staged_v = (b.alloca(_VEC, size=BLOCK * n_vec) for _ in range(2))

    def item(w: ir.Value) -> None:
        it = _item(k, a, s, w, n_heads, n_kv_heads)
        t, h0, kh, p, seq, jlo = it.t, it.h0, it.kh, it.p, it.seq, it.jlo
        table = k.index(pages, k.mul(seq, s[S_MAX_PAGES]), I64)
        qbase = k.add(k.mul(t, a[A_Q_STRIDE]), k.mul(h0, head_dim))
        for g in range(heads):
            put(neg_inf, m[g])
            put(const(F32, 0.0), total[g])
            for c in range(n_vec):
                put(zero, vec_at(acc, g * n_vec + c))

        def segment(keys: _Segment, first: ir.Value, stop: ir.Value) -> None:
            """Keys ``first..stop-1`` into the running softmax and value sums."""
            last = k.sub(stop, 1)
            qv = [
                [
                    k.load(_VEC, k.index(q, k.add(qbase, g * head_dim + c * LANES), F32), align=4)
                    for c in range(n_vec)
                ]
                for g in range(heads)
            ]
            q_scale = scale
            if keys.rotated:  # like the stored keys: rotated q . rotated k = 32 q . k
                qv = [_hadamard(k, qg) for qg in qv]
                q_scale = k.mul(scale, 1.0 / Q8_BLOCK)
            q_scale = k.splat(q_scale, LANES)

            def score(j0: ir.Value, i: ir.Value) -> None:
                """Dot vectors of key ``j0 + i`` with each head's query (keys past ``last``,
                the tail of the last block, reload key ``last`` and get weight 0, so every
                address stays inside the segment)."""
                kc = keys.key(k.smin(k.add(j0, i), last), i)
                dot = [zero] * heads
                for c in range(n_vec):  # each key vector is loaded once for all heads
                    dot = [
                        b.fadd(dot[g], b.fmul(qv[g][c], kc[c], flags=_FMA), flags=_FMA)
                        for g in range(heads)
                    ]
                for g in range(heads):
                    put(dot[g], vec_at(dots, k.add(i, g * BLOCK)))

            def softmax(j0: ir.Value) -> tuple[list[list[ir.Value]], ir.Value]:
                """Each head's block weights ``exp(score - new max)`` (``halves`` vectors) and
                the rescale factors ``exp(old max - new max)`` of all heads in one vector."""
                valid = [
                    b.icmp_signed(
                        "<=",
                        k.add(k.splat(k.add(j0, h * LANES), LANES), lane),
                        k.splat(last, LANES),
                    )
                    for h in range(halves)
                ]
                weights, rescale = [], zero
                for g in range(heads):
                    x = []
                    for h in range(halves):
                        first = g * BLOCK + h * LANES
                        d = [get(vec_at(dots, first + i)) for i in range(LANES)]
                        scores = k.mul(_row_sums(k, d), q_scale)
                        if softcap:
                            capped = k.tanh(k.b.fdiv(scores, k.splat(const(F32, softcap), LANES)))
                            scores = k.mul(capped, softcap)
                        x.append(k.select(valid[h], scores, k.splat(neg_inf, LANES)))
                    top = x[0]
                    for xh in x[1:]:
                        top = k.call("llvm.maxnum.v8f32", _VEC, top, xh)
                    m_old = get(m[g], F32)
                    top = k.call("llvm.vector.reduce.fmax.v8f32", F32, top, flags=("nnan",))
                    m_new = k.call("llvm.maxnum.f32", F32, m_old, top)
                    put(m_new, m[g])
                    weights.append(
                        [
                            k.select(valid[h], k.exp(k.sub(x[h], k.splat(m_new, LANES))), zero)
                            for h in range(halves)
                        ]
                    )
                    rescale = b.insert_element(rescale, k.sub(m_old, m_new), const(I32, g))
                return weights, k.exp(rescale)

            def block(j0: ir.Value) -> None:
                k.loop(0, BLOCK, 1, lambda i: score(j0, i))
                weights, rescale = softmax(j0)
                r = [b.extract_element(rescale, const(I32, g)) for g in range(heads)]
                for g in range(heads):
                    block_sum = k.halving_sum(k.total(weights[g]))
                    put(k.add(k.mul(get(total[g], F32), r[g]), block_sum), total[g])
                for g in range(heads):
                    for h in range(halves):
                        put(weights[g][h], vec_at(block_weights, g * halves + h))
                value_rows = keys.rows()
                r = [k.splat(rg, LANES) for rg in r]

                def weight(g: int, i: int) -> ir.Value:
                    at = k.index(block_weights, g * BLOCK + i, F32)
                    return k.splat(get(at, F32), LANES)

                def dims(c: ir.Value) -> None:
                    # One dim vector of each head's value sum at a time, over the block's keys
                    # (unrolled over dims, LLVM would interleave and spill all the sums).
                    col = k.mul(c, LANES)
                    sums = [vec_at(acc, k.add(c, g * n_vec)) for g in range(heads)]
                    ys = [k.mul(get(sums[g]), r[g]) for g in range(heads)]
                    for i in range(BLOCK):
                        vc = keys.value(value_rows[i], col)
                        ys = [
                            b.fadd(ys[g], b.fmul(weight(g, i), vc, flags=_FMA), flags=_FMA)
                            for g in range(heads)
                        ]
                    for g in range(heads):
                        put(ys[g], sums[g])

                k.loop(0, n_vec, 1, dims)

            k.loop(first, stop, BLOCK, block, partial=True)

        def kv_row(slot: ir.Value) -> ir.Value:
            """Element offset of this item's kv head in KV row ``slot``."""
            return k.mul(k.add(k.mul(slot, n_kv_heads), kh), head_dim)

        def page_row(j: ir.Value) -> ir.Value:
            pid = _word(k, table, k.udiv(j, page))
            return kv_row(k.add(k.mul(pid, page), b.urem(j, k.i64(page))))

        def page_key(j: ir.Value, i: ir.Value) -> list[ir.Value]:
            row = page_row(j)
            k.store(row, k.index(rows, i, I64), align=8)
            # The same key of the next block, from memory: a step's weights stream through
            # the caches between two uses of a layer's pages, and the rows of one kv head
            # are strided (heads interleave), so the hardware prefetcher misses them.
            ahead = page_row(k.smin(k.add(j, BLOCK), p))
            for store in (kp, vp):
                k.prefetch(k.index(store, ahead, _STORE[dtype]), 0, head_dim * _BYTES[dtype])
            return [_load_vec(k, dtype, kp, ks, k.add(row, c * LANES)) for c in range(n_vec)]

        def page_rows() -> list[ir.Value]:
            return [_word(k, rows, k.i64(i)) for i in range(BLOCK)]

        def page_value(row: ir.Value, col: ir.Value) -> ir.Value:
            return _load_vec(k, dtype, vp, vs, k.add(row, col))

        in_pages = _Segment(page_key, page_rows, page_value, rotated=dtype == "q8_0")
        end = it.end
        segments = [(in_pages, jlo, end)]
        if recent:
            start = _word(k, pos, _word(k, first_row, seq))  # the sequence's first this step
            base = _word(k, recent_row, seq)

            def near_key(j: ir.Value, i: ir.Value) -> list[ir.Value]:
                """Stage key ``j`` and its value (f16 values as f32) as key ``i``."""
                staged = [vec_at(x, k.mul(i, n_vec)) for x in (staged_k, staged_v)]

                def earlier() -> None:  # an earlier step's token: the recent buffer
                    row = kv_row(k.add(base, b.urem(j, k.i64(recent))))
                    for store, dst in zip((kr, vr), staged, strict=True):
                        for c in range(n_vec):
                            x = _load_vec(k, "f16", store, None, k.add(row, c * LANES))
                            put(x, vec_at(dst, c))

                def ours() -> None:  # this step's: its f32 keys and values, rounded as stored
                    r, col = k.sub(t, k.sub(p, j)), k.mul(kh, head_dim)
                    for new, stride, dst in zip(
                        (k_new, v_new), (a[A_K_STRIDE], a[A_V_STRIDE]), staged, strict=True
                    ):
                        row = k.add(k.mul(r, stride), col)
                        for c in range(n_vec):
                            x = _load_vec(k, "f32>f16", new, None, k.add(row, c * LANES))
                            put(x, vec_at(dst, c))

                k.branch(k.lt(j, start), earlier, ours)
                return [get(vec_at(staged[0], c)) for c in range(n_vec)]

            def near_rows() -> list[ir.Value]:
                return [k.i64(i * head_dim) for i in range(BLOCK)]

            def near_value(row: ir.Value, col: ir.Value) -> ir.Value:
                return k.load(_VEC, k.index(staged_v, k.add(row, col), F32), align=4)

            near = k.smax(k.smax(jlo, k.sub(p, recent - 1)), _word(k, recent_from, seq))
            in_f16 = _Segment(near_key, near_rows, near_value, rotated=False)
            segments = [(in_pages, jlo, near), (in_f16, near, end)]
        # this chunk's keys of each segment (its blocks start at the chunk's first key)
        lo = k.add(jlo, k.mul(chunk, CHUNK))
        hi = k.smin(k.add(lo, CHUNK), end)
        for keys, first, stop in segments:
            segment(keys, k.smax(first, lo), k.smin(stop, hi))
        maxima, sums = zero, zero
        for g in range(heads):
            maxima = b.insert_element(maxima, get(m[g], F32), const(I32, g))
            sums = b.insert_element(sums, get(total[g], F32), const(I32, g))
        k.store(maxima, record, 0, 4)
        k.store(sums, record, 4 * LANES, 4)
        for i in range(heads * n_vec):
            k.store(get(vec_at(acc, i)), record, 4 * (2 + i) * LANES, 4)

    item(w)


def _fold(k: Kernel, into: ir.Value, part: ir.Value, heads: int, n_vec: int) -> None:
    """The partial result at ``into`` merged with the one at ``part`` (the next chunk's),
    in place: ``m = max(m, m')``, ``l = l e^(m_old - m) + l' e^(m' - m)``, and the value
    sums alike. Plain multiplies and adds (nothing fused), so every backend rounds the
    same; a one-chunk item never folds, so its result is the unsplit one."""
    b = k.b
    m_into, m_part = (k.load(_VEC, x, 0, 4) for x in (into, part))
    m = k.call("llvm.maxnum.v8f32", _VEC, m_into, m_part)
    old, new = k.exp(k.sub(m_into, m)), k.exp(k.sub(m_part, m))
    l_into, l_part = (k.load(_VEC, x, 4 * LANES, 4) for x in (into, part))
    k.store(m, into, 0, 4)
    k.store(k.add(k.mul(l_into, old), k.mul(l_part, new)), into, 4 * LANES, 4)
    for g in range(heads):
        f_old, f_new = (k.splat(b.extract_element(x, const(I32, g)), LANES) for x in (old, new))
        for c in range(n_vec):
            at = 4 * (2 + g * n_vec + c) * LANES
            y, y_part = (k.load(_VEC, x, at, 4) for x in (into, part))
            k.store(k.add(k.mul(y, f_old), k.mul(y_part, f_new)), into, at, 4)


def _finish(
    k: Kernel,
    record: ir.Value,
    out: ir.Value,
    it: _Item,
    n_heads: int,
    heads: int,
    head_dim: int,
    sinks: ir.Value | None,
) -> None:
    """Item ``it``'s output rows: its value sums over its sum of exps; with ``sinks``, head
    h's sum has one more term, ``exp(sinks[h])`` (both rescaled to the larger of the sink
    and the scores' max, so neither exp overflows)."""
    sums = k.load(_VEC, record, 4 * LANES, 4)
    maxima = k.load(_VEC, record, 0, 4)
    obase = k.mul(k.add(k.mul(it.t, n_heads), it.h0), head_dim)
    for g in range(heads):
        total = k.b.extract_element(sums, const(I32, g))
        one = const(F32, 1.0)
        if sinks is not None:
            sink = k.load(F32, k.index(sinks, k.add(it.h0, g), F32), align=4)
            m = k.b.extract_element(maxima, const(I32, g))
            top = k.fmax(m, sink)
            one = k.exp(k.sub(m, top))
            total = k.add(k.mul(total, one), k.exp(k.sub(sink, top)))
        inv = k.splat(k.b.fdiv(one, total), LANES)
        for c in range(head_dim // LANES):
            y = k.mul(k.load(_VEC, record, 4 * (2 + g * (head_dim // LANES) + c) * LANES, 4), inv)
            k.store(y, k.index(out, k.add(obase, g * head_dim + c * LANES), F32), align=4)


# The three schedules of the same chunks and folds, so their results are bitwise equal:
# ``items`` runs an item's chunks in order on one thread, folding each into the first on
# the stack (no scratch: what a long prefill needs); ``parts`` spreads the chunks over
# threads, writing each partial to the step's scratch, and ``merge`` (a second small
# launch, since the chunks of an item finish on different threads, or GPU blocks, with no
# barrier between them) folds them in chunk order. A one-chunk item is finished by
# ``parts`` itself and skipped by ``merge``.


def _schedule(
    k: Kernel,
    fn: ir.Function,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    kind: str,
    sinks: bool,
) -> None:
    """``items``, ``parts`` or ``merge`` (``kind``) over rows ``lo..hi-1``, calling the
    chunk function ``fn``."""
    b = k.b
    lo, hi = k.args[1], k.args[2]
    heads = item_heads(n_heads // n_kv_heads)
    n_vec, floats = head_dim // LANES, record_floats(n_heads, n_kv_heads, head_dim)
    a, s = _blocks(k)
    out, scratch = k.pointer(a[A_OUT]), k.pointer(s[S_PARTS])
    sink_logits = k.pointer(a[A_SINKS]) if sinks else None

    def finish(record: ir.Value, it: _Item) -> None:
        _finish(k, record, out, it, n_heads, heads, head_dim, sink_logits)

    n_items = k.mul(s[S_TOKENS], n_heads // heads)
    if kind == "items":  # the item's running record and the next chunk's, on the stack
        first, other = (b.alloca(_VEC, size=floats // LANES) for _ in range(2))

    def chunk(w: ir.Value, c: ir.Value, record: ir.Value) -> None:
        b.call(fn, [k.args[0], w, c, record])

    def stored(w: ir.Value, c: ir.Value) -> ir.Value:  # chunk c's record of item w
        return k.index(scratch, k.mul(k.add(k.mul(c, n_items), w), floats), F32)

    # Each schedule calls the chunk function at one site (it is inlined: the PTX checker
    # wants entries without calls, and two copies of the walk are enough code).
    def row(u: ir.Value) -> None:
        if kind == "items":  # chunk 0 into ``first``, the others into ``other``, folded
            it = _item(k, a, s, u, n_heads, n_kv_heads)

            def one(c: ir.Value) -> None:
                later = b.icmp_signed(">", c, k.i64(0))
                chunk(u, c, b.select(later, other, first))
                k.branch(later, lambda: _fold(k, first, other, heads, n_vec))

            k.loop(0, it.n, 1, one)
            finish(first, it)
        elif kind == "merge":
            it = _item(k, a, s, u, n_heads, n_kv_heads)

            def fold_all() -> None:
                into = stored(u, k.i64(0))
                k.loop(1, it.n, 1, lambda c: _fold(k, into, stored(u, c), heads, n_vec))
                finish(into, it)

            k.branch(b.icmp_signed(">", it.n, k.i64(1)), fold_all)
        else:  # parts: row u is slice u % slices of item u / slices: chunks slice, +slices...
            slices = a[A_SLICES]
            w, piece = k.udiv(u, slices), b.urem(u, slices)
            it = _item(k, a, s, w, n_heads, n_kv_heads)
            # a one-chunk item is finished here from its stored record, not merged (the
            # record in global memory, not on the stack: a GPU thread then spills less)
            single = b.icmp_signed("==", it.n, k.i64(1))
            count = k.udiv(k.add(k.smax(k.sub(it.n, piece), 0), k.sub(slices, 1)), slices)

            def one(i: ir.Value) -> None:
                c = k.add(piece, k.mul(i, slices))
                chunk(w, c, stored(w, c))

            k.loop(0, count, 1, one)
            only = b.and_(single, b.icmp_signed("==", piece, k.i64(0)))
            k.branch(only, lambda: finish(stored(w, k.i64(0)), it))

    k.loop(lo, hi, 1, row)


def _write_recent(k: Kernel, n_kv_heads: int, head_dim: int, recent: int) -> None:
    """Store the step's keys and values in f16 at their sequences' recent-buffer rows, in
    token order (a sequence's last ``recent`` tokens are what stays)."""
    a, s = _blocks(k)
    seq_of, pos, recent_row = (k.pointer(s[i]) for i in (S_SEQ_OF, S_POS, S_RECENT_ROW))
    width = n_kv_heads * head_dim
    pairs = [
        (k.pointer(a[new]), a[stride], k.pointer(a[store]))
        for new, stride, store in ((A_K_NEW, A_K_STRIDE, A_KR), (A_V_NEW, A_V_STRIDE, A_VR))
    ]

    def token(t: ir.Value) -> None:
        seq, p = (_word(k, x, t) for x in (seq_of, pos))
        row = k.add(_word(k, recent_row, seq), k.b.urem(p, k.i64(recent)))
        for new, stride, store in pairs:
            src, dst = k.mul(t, stride), k.mul(row, width)
            for c in range(0, width, LANES):
                x = k.load(_VEC, k.index(new, k.add(src, c), F32), align=4)
                k.store(k.convert(x, F16), k.index(store, k.add(dst, c), F16), align=2)

    k.loop(0, s[S_TOKENS], 1, token)


def _build(
    module: Module,
    dtype: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    page: int,
    recent: int,
    softcap: float,
    sinks: bool = False,
) -> None:
    """``items(args, lo, hi)``: work items lo..hi-1, each chunk after chunk;
    ``parts(args, lo, hi)``: rows lo..hi-1 of the split-K schedule (``A_SLICES`` rows an
    item), ``merge(args, lo, hi)``: items lo..hi-1's partials folded (both see
    ``_schedule``); ``write_rows(args, lo, hi)``: store
    rows lo..hi-1 (token, kv head) of the step's keys and values in their pages,
    ``write(args)`` all of them; ``write_recent(args)``: in the recent buffers (after the
    items, which read the buffers' earlier tokens); ``run(args)``: all three, over all items
    of the step. ``softcap``: the scores' cap (0: none, see ``_chunk``); ``sinks``: each
    head's softmax has its sink logit (``A_SINKS``) in the denominator (see ``_finish``)."""
    name = module.ir.name
    chunk = module.kernel(f"{name}_chunk", (PTR, I64, I64, PTR), private=True)
    chunk.fn.attributes.add("alwaysinline")
    _chunk(chunk, dtype, softcap, n_heads, n_kv_heads, head_dim, page, recent)
    chunk.ret()
    for kind in ("items", "parts", "merge"):
        fn = module.kernel(f"{name}_{kind}", (PTR, I64, I64))
        _schedule(fn, chunk.fn, n_heads, n_kv_heads, head_dim, kind, sinks)
        fn.ret()
        if kind == "items":
            items = fn
    write_rows = module.kernel(f"{name}_write_rows", (PTR, I64, I64))
    _write(write_rows, dtype, n_kv_heads, head_dim)
    write_rows.ret()
    write = module.kernel(f"{name}_write", (PTR,))
    _, s = _blocks(write)
    write.b.call(write_rows.fn, [write.args[0], write.i64(0), write.mul(s[S_TOKENS], n_kv_heads)])
    write.ret()
    write_recent = module.kernel(f"{name}_write_recent", (PTR,))
    if recent:
        _write_recent(write_recent, n_kv_heads, head_dim, recent)
    write_recent.ret()
    run = module.kernel(f"{name}_run", (PTR,))
    run.b.call(write.fn, run.args)
    _, s = _blocks(run)
    per_token = n_heads // item_heads(n_heads // n_kv_heads)
    run.b.call(items.fn, [run.args[0], run.i64(0), run.mul(s[S_TOKENS], per_token)])
    run.b.call(write_recent.fn, run.args)
    run.ret()


ATTENTION = Program("attn", _build)
