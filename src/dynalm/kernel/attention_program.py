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

Tiles: in a prefill, an item of one token loads each key and value vector for its group's
heads alone (one FMA a load for MHA). So, where every query's keys start at 0 (no window,
or a step whose positions all lie inside the window: ``S_END``), a step's runs of
consecutive tokens of a sequence within one ``CHUNK`` of positions form tiles of ``TILE``
tokens (``work_order`` in ``core.attention``; the rest run alone), and an item (``tiles``)
is ``tile_tokens`` queries of a tile times a group of heads: it walks the keys to its last
query's, in the same blocks from the same chunk starts, each key and value vector loaded
once for all its (query, head) pairs, each query with its own softmax, sums and records,
masking the keys past its own position. A block wholly past a query's keys is a bitwise
no-op for it (its max stays, the rescale is exp(0) = 1, its weights are 0 times finite
values), and the queries of a tile have as many chunks (a chunk without a key of a query
would not be), so each query gets the bits it gets alone. An item of one token is the same
walk with a tile of 1. With q8_0's recent f16 keys each query has its own segments (pages
before its window of f16 keys, each run walked in blocks from its start): a tile walks
together the blocks of pages that lie wholly before its first query's window, then each
query its own rest (``_chunk``).

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
A_SINKS, A_TILED, N_ARGS = range(17, 20)
# ``A_SLICES``: the slices of an item ``parts`` runs (see split-K below); ``A_SINKS``: the
# heads' sink logits (f32 [n_heads]), read by a program built with ``sinks``; ``A_TILED``:
# whether the host runs a step's tiles (``run`` and the CPU's plan; a GPU runs each token
# alone), not each token alone (see Tiles above); a layer with a window runs them in a step
# whose positions all lie inside it (``S_END`` <= window).
# The step's layout block: token count, page tables ``[S, MAX_PAGES]``, each token's
# sequence, position and KV slot, per sequence its first row in the step, its recent
# buffer's first row and the first position the buffer holds, the tokens in work order
# (``S_SINGLES`` tokens alone, then ``S_TILES`` tiles of ``TILE`` tokens; see ``tiles``),
# and the partial results' scratch of ``parts`` (``records(...)`` per item and chunk).
S_TOKENS, S_PAGES, S_MAX_PAGES, S_SEQ_OF, S_POS, S_SLOTS = range(6)
S_FIRST_ROW, S_RECENT_ROW, S_RECENT_FROM, S_ORDER, S_SINGLES, S_TILES = range(6, 12)
S_PARTS, S_END, N_STEP = range(12, 15)  # S_END: one past the step's last position
LANES = 8  # f32 lanes of the program's vectors
BLOCK = 2 * LANES  # keys per online-softmax step
Q8_BLOCK = 32
# Query heads per work item at most, and (query, head) pairs of a tile's item: more would
# crowd the loops' registers (and the stack, in L1 with the keys) and leave fewer items to
# split over threads.
MAX_ITEM_HEADS, MAX_PAIRS = 4, 8
# Split-K (flash-decoding): an item's keys, from its window start, in chunks of ``CHUNK``;
# each chunk's softmax partial (max, sum of exps, weighted value sums per head) is folded
# into the first in chunk order. A context of one chunk is the unsplit computation.
CHUNK = 256
# Query tokens of a prefill tile (``tile_tokens`` of them a work item).
TILE = 8
FUNCTIONS = ("items", "tiles", "parts", "merge", "write_rows", "write", "write_recent", "run")

_VEC = vec(F32, LANES)
_STORE = {"f32": F32, "f16": F16, "q8_0": I8}
# Stored f16 values saturate at the largest finite f16: an overflow would store inf, and a
# tile's weight 0 for a key past a query's position times an inf value is NaN, where the
# query alone never reads that key. NaN stays NaN. (``kv_storage.saturated_f16``: numpy's.)
F16_MAX = 65504.0
_BYTES = {"f32": 4, "f16": 2, "q8_0": 1}
_VEC_ALIGN = 32  # the stack arrays of vectors


def supported(head_dim: int, dtype: str) -> bool:
    return head_dim % LANES == 0 and (dtype != "q8_0" or head_dim % Q8_BLOCK == 0)


def item_heads(group: int, tile: int = 1) -> int:
    """Query heads per work item of ``tile`` queries: the largest divisor of the group
    within the caps."""
    fit = range(1, min(MAX_ITEM_HEADS, MAX_PAIRS // tile) + 1)
    return max(d for d in fit if group % d == 0)


def tile_tokens(group: int) -> int:
    """Query tokens of a tile's work item (``TILE`` or a part of it): ``MAX_PAIRS`` pairs
    with up to two heads, so each key and value vector it loads serves 8 FMAs. Measured on
    a 512-token prefill (Zen 4): MHA's 8 tokens x 1 head 2.7x faster than a token alone
    (16 x 1 another 10%, at twice the stack and remainder); a group of 4's 4 x 2 and 2 x 4
    1.2x (its softmax, per pair, dominates at head dim 64), 8 x 1 10% slower."""
    return MAX_PAIRS // (2 if group % 2 == 0 else 1)


def work_items(n_heads: int, n_kv_heads: int, tiled: bool) -> int:
    """Work items per token alone, or per ``TILE``-token tile (``tiled``)."""
    group = n_heads // n_kv_heads
    tokens = tile_tokens(group) if tiled else 1
    return (TILE if tiled else 1) // tokens * (n_heads // item_heads(group, tokens))


def chunks(context: int) -> int:
    """Split-K chunks of an item over ``context`` keys (at least one)."""
    return max(1, -(-context // CHUNK))


def record_floats(n_heads: int, n_kv_heads: int, head_dim: int, tile: int = 1) -> int:
    """A partial result's floats (of one query of an item of ``tile``): its heads' maxima
    and sums (a vector each, head ``g`` in lane ``g``), then each head's weighted value
    sums."""
    return 2 * LANES + item_heads(n_heads // n_kv_heads, tile) * head_dim


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


def _f16(k: Kernel, x: ir.Value) -> ir.Value:
    """f32 lanes (or one f32) rounded to f16, saturating at +-``F16_MAX``."""
    ty = x.type
    high, low = const(ty, F16_MAX), const(ty, -F16_MAX)
    x = k.select(k.b.fcmp_ordered(">", x, high), high, x)
    x = k.select(k.b.fcmp_ordered("<", x, low), low, x)
    return k.convert(x, F16)


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
        return k.convert(_f16(k, raw), F32)
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
    ``scales[at / 32]`` (numpy's f32 operations in numpy's order, so bitwise equal). As
    numpy's ``max``, the largest magnitude keeps a NaN (``Kernel.magnitude_bits``): the
    block's scale is NaN and it reads back NaN. A value that scales to NaN (a NaN, or an
    inf in a block scaled by 0) stores 0, as numpy's cast does on x86 (converting NaN to an
    integer is undefined)."""
    bits = [k.magnitude_bits(x) for x in xs]
    top = bits[0]
    for b in bits[1:]:
        top = k.smax(top, b)
    amax = k.bitcast(k.reduce("smax", top), F32)
    d = k.b.fdiv(amax, const(F32, 127.0))
    positive = k.b.fcmp_ordered(">", d, const(F32, 0.0))
    inv = k.splat(k.select(positive, k.b.fdiv(const(F32, 1.0), d), 0.0), LANES)
    k.store(_f16(k, d), k.index(scales, k.udiv(at, Q8_BLOCK), F16), align=2)

    return [
        k.convert(k.call("llvm.rint.v8f32", _VEC, k.nan_to_zero(k.mul(x, inv))), I8) for x in xs
    ]


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
                    xs = [_f16(k, x) for x in xs]
                for i, x in enumerate(xs):
                    k.store(x, k.index(store, k.add(dst, c + i * LANES), ty))

    k.loop(lo, hi, 1, row)


@dataclass
class _Segment:
    """How a run of an item's keys is read: ``key(j, i)`` returns key ``j``'s vectors (as
    key ``i`` of the block, noting where its value is), ``row(i)`` the handle of the value
    of the block's key ``i`` and ``value(row, col)`` one value vector; keys stored
    Hadamard-rotated or not."""

    key: Callable[[ir.Value, ir.Value], list[ir.Value]]
    row: Callable[[ir.Value], ir.Value]
    value: Callable[[ir.Value, ir.Value], ir.Value]
    rotated: bool


@dataclass
class _Item:
    """A work item's ``tile`` query tokens ``t..t+tile-1`` (of one sequence, at positions
    ``p-tile+1..p``), first query head and kv head, the keys ``jlo..end-1`` its queries
    walk (``end = p + 1``) and their split-K chunk count."""

    t: ir.Value
    h0: ir.Value
    kh: ir.Value
    p: ir.Value
    seq: ir.Value
    jlo: ir.Value
    end: ir.Value
    n: ir.Value


def _item(
    k: Kernel,
    a: list[ir.Value],
    s: list[ir.Value],
    w: ir.Value,
    n_heads: int,
    n_kv_heads: int,
    tile: int = 1,
) -> _Item:
    """Work item ``w`` of the step's tokens alone (``tile`` 1), or of its tiles' parts of
    ``tile`` tokens (which follow them in ``S_ORDER``): its keys are from ``max(0, p -
    window + 1)`` (0 without a window; always 0 where tiles run) to its last position
    ``p``."""
    b, group = k.b, n_heads // n_kv_heads
    heads = item_heads(group, tile)
    per_token = n_heads // heads
    base = s[S_SINGLES] if tile > 1 else 0  # the tiles follow the singles
    t = _word(k, k.pointer(s[S_ORDER]), k.add(k.mul(k.udiv(w, per_token), tile), base))
    h0 = k.mul(b.urem(w, k.i64(per_token)), heads)
    last = k.add(t, tile - 1)
    p, seq = _word(k, k.pointer(s[S_POS]), last), _word(k, k.pointer(s[S_SEQ_OF]), t)
    win = k.add(k.sub(p, a[A_WINDOW]), 1)
    win = k.select(b.icmp_signed(">", a[A_WINDOW], k.i64(0)), win, 0)
    jlo, end = k.smax(win, 0), k.add(p, 1)
    n = k.udiv(k.add(k.sub(end, jlo), CHUNK - 1), CHUNK)
    return _Item(t, h0, k.udiv(h0, group), p, seq, jlo, end, n)


def _rows(
    k: Kernel, a: list[ir.Value], s: list[ir.Value], tiles: bool, n_heads: int, n_kv_heads: int
) -> ir.Value:
    """The step's work items of ``items`` (its tokens alone) or ``tiles``: with
    ``A_TILED`` and every query's keys from 0 (no window, or the step's positions inside
    it), its ``S_SINGLES`` tokens and ``S_TILES`` tiles, else all its tokens alone. Read
    from the step block, so a launch over as many rows as the step has tokens' items (the
    host's plan, kept while the token count stays) does each step's own work."""
    b, window = k.b, a[A_WINDOW]
    from_zero = b.or_(b.icmp_signed("==", window, k.i64(0)), b.icmp_signed("<=", s[S_END], window))
    tiled = b.and_(b.icmp_signed("!=", a[A_TILED], k.i64(0)), from_zero)
    count = k.select(tiled, *((s[S_TILES], 0) if tiles else (s[S_SINGLES], s[S_TOKENS])))
    return k.mul(count, work_items(n_heads, n_kv_heads, tiles))


def _chunk(k: Kernel, dtype: str, softcap: float, tile: int, *geometry: int) -> None:
    """``chunk(args, w, c, record)``: work item ``w`` (a group of heads of a query token,
    or of a tile's ``tile`` tokens) over its keys' chunk ``c``, its partial result stored
    at ``record`` (``record_floats``, a record per query token of the tile);
    ``geometry``: heads, kv heads, head dim, page size, recent window.
    A tile walks the keys to its last query's, each query masking the keys past its own
    (see Tiles above: each query's result is the one it gets alone).
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
    heads = item_heads(group, tile)
    pairs = tile * heads  # the (query, head) pairs of an item, pair x = u * heads + g
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
    # Per item, on the stack: each pair's running max and sum (promoted to registers by
    # LLVM); its weighted value sums [pair][dim vector] and, per block, the keys' value
    # rows and dot vectors [pair][key], which the loops below index.
    m = b.alloca(F32, size=pairs)
    total = b.alloca(F32, size=pairs)
    acc = b.alloca(_VEC, size=pairs * n_vec)
    rows = b.alloca(I64, size=BLOCK)
    dots = b.alloca(_VEC, size=pairs * BLOCK)
    # The block's softmax weights, [pair][key], and rescale factors [pair]: the value loop
    # broadcasts each from memory (a load) instead of shuffling it out of a register (48
    # shuffles per dim vector).
    block_weights = b.alloca(_VEC, size=pairs * halves)
    rescales = b.alloca(F32, size=pairs)
    if recent:  # the near keys and values of a block, staged in f32 [key][dim]
        staged_k, staged_v = (b.alloca(_VEC, size=BLOCK * n_vec) for _ in range(2))

    def item(w: ir.Value) -> None:
        it = _item(k, a, s, w, n_heads, n_kv_heads, tile)
        t, h0, kh, p, seq, jlo = it.t, it.h0, it.kh, it.p, it.seq, it.jlo
        table = k.index(pages, k.mul(seq, s[S_MAX_PAGES]), I64)
        for x in range(pairs):
            put(neg_inf, k.index(m, x, F32))
            put(const(F32, 0.0), k.index(total, x, F32))
            for c in range(n_vec):
                put(zero, vec_at(acc, x * n_vec + c))

        def segment(
            keys: _Segment, first: ir.Value, stop: ir.Value, u0: ir.Value | None = None
        ) -> None:
            """Keys ``first..stop-1`` into the running softmaxes and value sums of the
            item's queries (or query ``u0`` alone); query u takes those up to its own
            position ``p - tile + 1 + u``."""
            last = k.sub(stop, 1)
            queries = tile if u0 is None else 1
            u0 = k.i64(0) if u0 is None else u0
            pairs = queries * heads  # pair x here is pair u0 * heads + x of the item
            x0 = k.mul(u0, heads)
            qv = [
                [
                    k.load(_VEC, k.index(q, k.add(qrow, g * head_dim + c * LANES), F32), align=4)
                    for c in range(n_vec)
                ]
                for u in range(queries)
                for qrow in [
                    k.add(k.mul(k.add(k.add(t, u0), u), a[A_Q_STRIDE]), k.mul(h0, head_dim))
                ]
                for g in range(heads)
            ]
            q_scale = scale
            if keys.rotated:  # like the stored keys: rotated q . rotated k = 32 q . k
                qv = [_hadamard(k, qx) for qx in qv]
                q_scale = k.mul(scale, 1.0 / Q8_BLOCK)
            q_scale = k.splat(q_scale, LANES)

            def score(j0: ir.Value, i: ir.Value) -> None:
                """Dot vectors of key ``j0 + i`` with each pair's query (keys past ``last``,
                the tail of the last block, reload key ``last`` and get weight 0, so every
                address stays inside the segment)."""
                kc = keys.key(k.smin(k.add(j0, i), last), i)
                dot = [zero] * pairs
                for c in range(n_vec):  # each key vector is loaded once for all pairs
                    dot = [k.fma(qv[x][c], kc[c], dot[x]) for x in range(pairs)]
                for x in range(pairs):
                    put(dot[x], vec_at(dots, k.add(i, x * BLOCK)))

            def softmax(j0: ir.Value, u: ir.Value) -> None:
                """Query ``u``'s heads through the block: their block weights ``exp(score -
                new max)`` (``halves`` vectors each), rescale factors ``exp(old max - new
                max)`` (in one vector) and sums of exps."""
                last_u = k.splat(k.smin(last, k.add(k.sub(p, tile - 1), k.add(u0, u))), LANES)
                valid = [
                    b.icmp_signed("<=", k.add(k.splat(k.add(j0, h * LANES), LANES), lane), last_u)
                    for h in range(halves)
                ]
                weights, rescale, pair = [], zero, k.mul(u, heads)
                for g in range(heads):
                    x, at = [], k.add(pair, g)
                    for h in range(halves):
                        first = k.add(k.mul(at, BLOCK), h * LANES)
                        d = [get(vec_at(dots, k.add(first, i))) for i in range(LANES)]
                        scores = k.mul(_row_sums(k, d), q_scale)
                        if softcap:
                            capped = k.tanh(k.b.fdiv(scores, k.splat(const(F32, softcap), LANES)))
                            scores = k.mul(capped, softcap)
                        x.append(k.select(valid[h], scores, k.splat(neg_inf, LANES)))
                    top = x[0]
                    for xh in x[1:]:
                        top = k.call("llvm.maxnum.v8f32", _VEC, top, xh)
                    m_at = k.index(m, k.add(x0, at), F32)
                    m_old = get(m_at, F32)
                    top = k.call("llvm.vector.reduce.fmax.v8f32", F32, top, flags=("nnan",))
                    m_new = k.call("llvm.maxnum.f32", F32, m_old, top)
                    put(m_new, m_at)
                    weights.append(
                        [
                            k.select(valid[h], k.exp(k.sub(x[h], k.splat(m_new, LANES))), zero)
                            for h in range(halves)
                        ]
                    )
                    rescale = b.insert_element(rescale, k.sub(m_old, m_new), const(I32, g))
                rescale = k.exp(rescale)
                for g in range(heads):
                    at, r = k.add(pair, g), b.extract_element(rescale, const(I32, g))
                    put(r, k.index(rescales, at, F32))
                    block_sum = k.halving_sum(k.total(weights[g]))
                    sum_at = k.index(total, k.add(x0, at), F32)
                    put(k.add(k.mul(get(sum_at, F32), r), block_sum), sum_at)
                    for h in range(halves):
                        put(weights[g][h], vec_at(block_weights, k.add(k.mul(at, halves), h)))

            def block(j0: ir.Value) -> None:
                k.loop(0, BLOCK, 1, lambda i: score(j0, i))
                k.loop(0, queries, 1, lambda u: softmax(j0, u))
                r = [k.splat(get(k.index(rescales, x, F32), F32), LANES) for x in range(pairs)]

                def weight(x: int, i: ir.Value) -> ir.Value:
                    at = k.index(block_weights, k.add(i, x * BLOCK), F32)
                    return k.splat(get(at, F32), LANES)

                # One pair's keys unrolled (LLVM keeps its 16 weights in registers across the
                # dims); more pairs' a key at a time (unrolled, their hoisted weights spill:
                # 10-15% slower, measured on tiles and on a decode of groups of 4).
                unroll = BLOCK if pairs == 1 else 1

                def dims(c: ir.Value) -> None:
                    # One dim vector of each pair's value sum at a time, over the block's keys
                    # (unrolled over dims, LLVM would interleave and spill all the sums); each
                    # value vector is loaded once for all pairs.
                    col = k.mul(c, LANES)
                    sums = [vec_at(acc, k.add(c, k.mul(k.add(x0, x), n_vec))) for x in range(pairs)]
                    ys = [k.var(k.mul(get(sums[x]), r[x])) for x in range(pairs)]

                    def keys_from(i0: ir.Value) -> None:
                        for i in (k.add(i0, d) for d in range(unroll)):
                            vc = keys.value(keys.row(i), col)
                            for x, y in enumerate(ys):
                                # an explicit FMA: with fmul + fadd left to fuse, AArch64's
                                # code generation fused the first key's add with the rescale
                                # multiply instead (1 ulp from x86, where unrolled)
                                y.set(k.fma(weight(x, i), vc, y.get()))

                    k.loop(0, BLOCK, unroll, keys_from)
                    for x in range(pairs):
                        put(ys[x].get(), sums[x])

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

        def page_rows(i: ir.Value) -> ir.Value:
            return _word(k, rows, i)

        def page_value(row: ir.Value, col: ir.Value) -> ir.Value:
            return _load_vec(k, dtype, vp, vs, k.add(row, col))

        in_pages = _Segment(page_key, page_rows, page_value, rotated=dtype == "q8_0")
        # this chunk's keys (its blocks start at the chunk's first key)
        lo = k.add(jlo, k.mul(chunk, CHUNK))
        hi = k.smin(k.add(lo, CHUNK), it.end)
        p_first = k.sub(p, tile - 1)  # the first query's position
        if not recent:
            segment(in_pages, lo, hi)
        else:
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
                    r, col = k.add(t, k.sub(j, p_first)), k.mul(kh, head_dim)
                    for new, stride, dst in zip(
                        (k_new, v_new), (a[A_K_STRIDE], a[A_V_STRIDE]), staged, strict=True
                    ):
                        row = k.add(k.mul(r, stride), col)
                        for c in range(n_vec):
                            x = _load_vec(k, "f32>f16", new, None, k.add(row, c * LANES))
                            put(x, vec_at(dst, c))

                k.branch(k.lt(j, start), earlier, ours)
                return [get(vec_at(staged[0], c)) for c in range(n_vec)]

            def near_rows(i: ir.Value) -> ir.Value:
                return k.mul(i, head_dim)

            def near_value(row: ir.Value, col: ir.Value) -> ir.Value:
                return k.load(_VEC, k.index(staged_v, k.add(row, col), F32), align=4)

            in_f16 = _Segment(near_key, near_rows, near_value, rotated=False)

            def near(u: ir.Value) -> ir.Value:  # query u's first key read in f16
                p_u = k.add(p_first, u)
                return k.smax(k.smax(jlo, k.sub(p_u, recent - 1)), _word(k, recent_from, seq))

            # Query u reads its keys before near(u) from the pages, the rest in f16, each
            # run in blocks from its start: a tile's blocks wholly before its first query's
            # near are every query's, walked together; then each query its own rest.
            together = lo
            if tile > 1:  # (an item of one token walks them as its own: one walk less to compile)
                whole = k.udiv(k.sub(k.smax(k.smin(near(0), hi), lo), lo), BLOCK)
                together = k.add(lo, k.mul(whole, BLOCK))
                segment(in_pages, lo, together)

            def alone(u: ir.Value) -> None:
                hi_u = k.smin(hi, k.add(k.add(p_first, u), 1))
                segment(in_pages, together, k.smin(near(u), hi_u), u)
                segment(in_f16, k.smax(near(u), lo), hi_u, u)

            k.loop(0, tile, 1, alone)
        floats = record_floats(n_heads, n_kv_heads, head_dim, tile)

        def store(u: ir.Value) -> None:  # query u's record
            at, pair, maxima, sums = k.at(record, k.mul(u, 4 * floats)), k.mul(u, heads), zero, zero
            for g in range(heads):
                x = k.add(pair, g)
                maxima = b.insert_element(maxima, get(k.index(m, x, F32), F32), const(I32, g))
                sums = b.insert_element(sums, get(k.index(total, x, F32), F32), const(I32, g))
            k.store(maxima, at, 0, 4)
            k.store(sums, at, 4 * LANES, 4)
            for i in range(heads * n_vec):
                y = get(vec_at(acc, k.add(k.mul(pair, n_vec), i)))
                k.store(y, at, 4 * (2 + i) * LANES, 4)

        k.loop(0, tile, 1, store)

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
    t: ir.Value,
    h0: ir.Value,
    n_heads: int,
    heads: int,
    head_dim: int,
    sinks: ir.Value | None,
) -> None:
    """Token ``t``'s output rows of heads ``h0..h0+heads-1``: their value sums over their
    sums of exps; with ``sinks``, head h's sum has one more term, ``exp(sinks[h])`` (both
    rescaled to the larger of the sink and the scores' max, so neither exp overflows)."""
    sums = k.load(_VEC, record, 4 * LANES, 4)
    maxima = k.load(_VEC, record, 0, 4)
    obase = k.mul(k.add(k.mul(t, n_heads), h0), head_dim)
    for g in range(heads):
        total = k.b.extract_element(sums, const(I32, g))
        one = const(F32, 1.0)
        if sinks is not None:
            sink = k.load(F32, k.index(sinks, k.add(h0, g), F32), align=4)
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
# the stack (no scratch: what a long prefill needs), and ``tiles`` alike a tile's, each
# query's records folded on their own; ``parts`` spreads the chunks over
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
    """``items``, ``tiles``, ``parts`` or ``merge`` (``kind``) over rows ``lo..hi-1``
    (``items`` and ``tiles``: those of the step's ``_rows``), calling the chunk function
    ``fn`` (of ``tile_tokens`` queries for ``tiles``, else of one)."""
    b = k.b
    tile = tile_tokens(n_heads // n_kv_heads) if kind == "tiles" else 1
    lo, hi = k.args[1], k.args[2]
    heads = item_heads(n_heads // n_kv_heads, tile)
    n_vec, floats = head_dim // LANES, record_floats(n_heads, n_kv_heads, head_dim, tile)
    a, s = _blocks(k)
    out, scratch = k.pointer(a[A_OUT]), k.pointer(s[S_PARTS])
    sink_logits = k.pointer(a[A_SINKS]) if sinks else None

    def finish(record: ir.Value, it: _Item, u: ir.Value | int = 0) -> None:  # query u's
        at = k.at(record, k.mul(k.like(k.i64(0), u), 4 * floats))
        _finish(k, at, out, k.add(it.t, u), it.h0, n_heads, heads, head_dim, sink_logits)

    n_items = k.mul(s[S_TOKENS], n_heads // heads)
    if kind in ("items", "tiles"):  # per query the running record and the next chunk's
        first, other = (b.alloca(_VEC, size=tile * floats // LANES) for _ in range(2))
        hi = k.smin(hi, _rows(k, a, s, kind == "tiles", n_heads, n_kv_heads))

    def chunk(w: ir.Value, c: ir.Value, record: ir.Value) -> None:
        b.call(fn, [k.args[0], w, c, record])

    def stored(w: ir.Value, c: ir.Value) -> ir.Value:  # chunk c's record of item w
        return k.index(scratch, k.mul(k.add(k.mul(c, n_items), w), floats), F32)

    # Each schedule calls the chunk function at one site (it is inlined: the PTX checker
    # wants entries without calls, and three copies of the walk are enough code).
    def row(u: ir.Value) -> None:
        if kind in ("items", "tiles"):  # chunk 0 into ``first``, the others into ``other``
            it = _item(k, a, s, u, n_heads, n_kv_heads, tile)

            def fold(q: ir.Value) -> None:  # query q's records
                at = k.mul(q, 4 * floats)
                _fold(k, k.at(first, at), k.at(other, at), heads, n_vec)

            def one(c: ir.Value) -> None:
                later = b.icmp_signed(">", c, k.i64(0))
                chunk(u, c, b.select(later, other, first))
                k.branch(later, lambda: k.loop(0, tile, 1, fold))

            k.loop(0, it.n, 1, one)
            k.loop(0, tile, 1, lambda q: finish(first, it, q))
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
                k.store(_f16(k, x), k.index(store, k.add(dst, c), F16), align=2)

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
    """``items(args, lo, hi)``: work items lo..hi-1 of the step's tokens alone, each chunk
    after chunk; ``tiles(args, lo, hi)``: those of its tiles;
    ``parts(args, lo, hi)``: rows lo..hi-1 of the split-K schedule (``A_SLICES`` rows an
    item), ``merge(args, lo, hi)``: items lo..hi-1's partials folded (both see
    ``_schedule``); ``write_rows(args, lo, hi)``: store
    rows lo..hi-1 (token, kv head) of the step's keys and values in their pages,
    ``write(args)`` all of them; ``write_recent(args)``: in the recent buffers (after the
    items, which read the buffers' earlier tokens); ``run(args)``: all three, over all items
    of the step (the tiles' and the rest's with ``A_TILED``). ``softcap``: the scores' cap
    (0: none, see ``_chunk``); ``sinks``: each head's softmax has its sink logit
    (``A_SINKS``) in the denominator (see ``_finish``)."""
    name = module.ir.name
    walks = {}  # the chunk function of items of one query and of a tile's
    tokens = tile_tokens(n_heads // n_kv_heads)
    for tile in (1, tokens):
        chunk = module.kernel(f"{name}_chunk{tile}", (PTR, I64, I64, PTR), private=True)
        chunk.fn.attributes.add("alwaysinline")
        _chunk(chunk, dtype, softcap, tile, n_heads, n_kv_heads, head_dim, page, recent)
        chunk.ret()
        walks[tile] = chunk.fn
    fns = {}
    for kind in ("items", "tiles", "parts", "merge"):
        fn = fns[kind] = module.kernel(f"{name}_{kind}", (PTR, I64, I64))
        walk = walks[tokens if kind == "tiles" else 1]
        _schedule(fn, walk, n_heads, n_kv_heads, head_dim, kind, sinks)
        fn.ret()
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
    a, s = _blocks(run)
    for kind in ("items", "tiles"):
        rows = _rows(run, a, s, kind == "tiles", n_heads, n_kv_heads)
        run.b.call(fns[kind].fn, [run.args[0], run.i64(0), rows])
    run.b.call(write_recent.fn, run.args)
    run.ret()


ATTENTION = Program("attn", _build)
