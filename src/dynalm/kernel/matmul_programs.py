"""Quantised matmul programs ``y[T, N] = x[T, K] @ W[N, K]^T``, one pattern per mode over
the per-format unpacks of ``kernel.formats``.

* ``exact`` -- fp32 activations and fp32 FMAs (the accuracy contract). Weights are
  dequantised to their fp32 values (``d * (q + offset)``, exact in fp32; ``+ m`` its one
  rounding) and each output is one FMA chain over K per lane of an accumulator of the
  backend's width, its lanes summed at the end; only a min per 32-block (Q4_1, Q5_1,
  Q4_K, Q5_K) factors out instead: a block's ``q * x`` summed first, then ``d`` and
  ``m * sum(x)`` in two FMAs (``_exact_block``). The GEMV unpacks in registers as it
  streams the ``RowLayout`` weights; a GEMM tile (``mr`` activation rows x ``nr`` weight
  rows) reads a stack panel of its ``nr`` weight rows unpacked once per activation chunk
  (``_walk``'s ``panel``): the unpack is paid once per chunk instead of once per tile,
  and the same values in the same order keep rows bitwise independent of the batch.
* ``auto`` -- activations quantised per 32-block to int8 (two scales ``dx`` per block and
  ``dx * sum(q)``, like ggml's Q8_1, and the integer sums ``offset`` multiplies) and integer
  dot products of unsigned weight bytes (``q - offset``, see ``kernel.formats``) by signed
  activation bytes: one fp32 lane per weight row over ``LaneLayout`` weights, so one
  byte-dot against 4 broadcast activation bytes serves a whole register of rows. On
  AVX-512 VNNI a chunk is one ``vpdpbusd`` into int32 accumulators that start from
  ``offset`` times the activations' sum, on AArch64 dotprod one ``sdot`` per 16 bytes;
  elsewhere products are summed in int16 (``Unpack.bound`` says how many stay exact) and
  widened once. Where a backend's unsigned dot is not exact for a format's bytes (Q8_0's
  0..255 in int16 pairs or ``sdot``) they are made signed again and dot as such. Either way
  the integer sums are exact and identical, and are converted and scaled in the same float
  order: every backend's auto kernel gives bitwise the same ``y``. Float weights and Q2_K
  (a min per 16 weights) use ``exact``.
* ``auto`` on tiles (x86-amx, batches of >= 16 rows) -- the same sums as tile products:
  16 activation rows (A, straight from the quantised activations, signed) times a block's
  chunks of 16 weight rows (B, unsigned: the lane layout's chunks are the tile's VNNI rows). Each
  (sub-block, scale group) sum is one product against a B holding only that key's chunks
  (the other rows zero), so C's rows are the vector kernel's int32 sums, then scaled in its
  float order: bitwise the same ``y`` again.
* ``auto`` on a GPU's tensor cores (NVPTX, sm_80, batches of >= 16 rows) -- a warp per
  row group of 8 weight rows and 16 activation rows at a time: each key's sums one
  ``mma`` m16n8k16 (signed activations x unsigned weight bytes, ``Backend.mma_s8u8``)
  started from the offset sums, each lane scaling its 4 outputs in the same float order
  (``_auto_mma``): bitwise the same ``y``.

One pattern per mode serves every batch size: the activation rows walked in L1/L2-sized
chunks by tiles of ``mr`` rows chosen per batch bucket (``buckets``; ``mr = 1`` is the
GEMV, weights prefetched), each kernel specialised on K; the AVX2 ``wide`` prefill tile
reads its weights unpacked from a stack panel built once per activation chunk, as
``exact``'s tiles do, where that pays (``Shape.panel``). Tiles over the
edge of the matrix repeat its last row instead of needing remainder variants (less code,
faster compiles). Every output sums in the same order whatever the tile, so rows are
bitwise independent of the batch.

Kernel signature: ``void f(i64 *args, i64 lo, i64 hi)`` over weight rows ``[lo, hi)`` (the
quantiser: activation rows), so ``core.pool`` can hand out chunks of rows.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import llvmlite.ir as ir

from dynalm.kernel.backends import MMA_ROWS, TILE_ROWS, Backend, Executable, Program, Request
from dynalm.kernel.formats import (
    QK,
    SUPER,
    UNPACKS,
    Scale,
    Unpack,
    byte_lanes,
    nibble_chunks,
    nibbles,
    six_bits,
)
from dynalm.kernel.lang import F16, F32, I8, I32, I64, PTR, VOID, Kernel, Module, Var, const, vec
from dynalm.kernel.layouts import GROUP, LaneLayout, Layout, RowLayout

# Argument block words (one int64 array per call site).
A_W, A_X, A_XD, A_XS, A_Y, A_T, A_NB, A_LDY, A_XK = range(9)
N_ARGS = 9
# The quantiser's integer sums per activation block, negated (``-sum(q)``): one per
# (16-weight half, scale group), then one per group over the whole block, [T, K/32,
# KEY_SUMS] int32 (``key_slot``): what ``offset`` times the activations adds in ``auto``.
# Stored ready to use (every offset is a negative power of two: the kernels' part is one
# shift a key), they spare the AVX2 3x3 tile its scalar loads, adds, shifts and negations
# (Q4_0's block 417 -> 399 instructions; ~1 % faster).
KEY_SUMS = 6


def key_slot(n: int, g: int, halves: int) -> int:
    """Where the sum of key (sub-block ``n``, scale group ``g``) of a format with
    ``halves`` sub-blocks a block sits among a block's ``KEY_SUMS``."""
    return 2 * n + g if halves > 1 else 4 + g


_PARAMS = (PTR, I64, I64)
ROWS = 4  # weight rows interleaved in memory for exact tiles: one stream per thread

# Activation scale groups: elements whose index // 4 is even, then odd. They match the
# auto kernels' chunks (chunk j is elements 4j..4j+3, in group j % 2), so each chunk's
# products take one scale, and halve the rounding error of one scale per 32 (outliers hurt
# one group).
X_GROUPS = [[e for e in range(QK) if e // 4 % 2 == k] for k in (0, 1)]


@dataclass(frozen=True)
class Shape:
    mr: int  # activation rows per register tile
    nr: int  # weight rows per register tile (auto: the backend's lanes)
    tc: int  # activation rows per cache chunk
    pf: int = 0  # prefetch weights this many bytes ahead (0: none)
    tiles: bool = False  # int8 tile products (mr = TILE_ROWS)
    warps: bool = False  # a warp's mma tile products (mr = MMA_ROWS, a row group per warp)
    rows: int = 0  # the smallest batch it serves (0: mr)
    panel: bool = False  # auto: weights unpacked once per activation chunk (``_auto``)

    @property
    def serves(self) -> int:
        return self.rows or self.mr

    def describe(self) -> str:
        if self.mr == 1:
            return "gemv"
        kind = "amx tiles" if self.tiles else "mma warp tiles" if self.warps else "tile"
        return f"{kind} {self.mr}x{self.nr}"


# Tiles per batch bucket, smallest T first. GEMV streams weights from memory: prefetching
# 8 KB ahead measured 1.4x (auto Q4_1) to 1.9x (exact Q8_0) on a decode step's 66 MB of
# layer weights. GEMM: 4 KB ahead measured 1.1-1.2x at T = 4..8 for auto; for exact
# 1.2-1.4x at T = 4..8 but 0.7x at T = 512 (off). AVX-512's 32 registers take 8 activation
# rows per tile: 1.15-1.2x over 4 at T = 8 on the FFN shapes, the same at T = 128. AMX
# tiles take batches of 16 rows and more (a tile product is 16 activation rows). A
# backend's ``wide`` prefill tile (AVX2: 3 rows x 3 row groups) serves batches of
# WIDE_ROWS and more, from a panel of its weights unpacked once per activation chunk (at
# T = 512, K = 2048..8192 on Zen 2: Q6_K 1.22-1.25x, Q4_K 1.01-1.05x).
def buckets(mode: str, target: Backend, ggml_type: int | None = None) -> list[Shape]:
    """The tiles of a mode for a backend, by batch bucket: each serves batches of
    ``serves`` rows up to the next bucket's (the first, ``mr = 1``, is the GEMV); for a
    weight format where its tiles differ (a factored min), else for the others."""
    unpack = UNPACKS.get(ggml_type) if ggml_type is not None else None
    if mode == "exact":
        # Dequantised panels make a float tile: one register of each activation row live,
        # 3 x 4 accumulators (1.1-1.45x the 4 x 2 tile at T = 128..512 on F32 weights,
        # K = 384..1536, AVX2, 2 threads). A factored min's block sums keep 4 x 2.
        factored = unpack is not None and unpack.has_min and unpack.halves == 1
        gemv = Shape(mr=1, nr=4, tc=32, pf=8192)
        if target.warps:
            # A GPU thread's stack panel would be local memory reserved for every resident
            # thread (16 bytes per column of K): its GEMV serves every batch, same order.
            return [gemv]
        if unpack is not None and unpack.lanes is six_bits:
            # Q6_K's two planes and two scales a block spill 4 rows' registers: 2 rows a
            # step measured 1.22x main's 4 on the 1B output head (3 rows 1.16x, 4 rows
            # 1.09x, all with ``_integer_floats``' Q6_K unpack; AVX2, one thread). Q4_0 is
            # best at 4 (3 rows equal, 2 rows 0.88x); Q4_K at 3 rows 1.0-1.06x, near noise.
            gemv = Shape(mr=1, nr=2, tc=32, pf=8192)
        gemm = Shape(mr=4, nr=2, tc=32) if factored else Shape(mr=3, nr=4, tc=30)
        return [gemv, gemm]
    lanes = target.lanes
    gemms = [Shape(mr=4, nr=lanes, tc=64, pf=4096)]
    if target.wide:
        mr, groups = target.wide
        # A panel pays where a block costs more to unpack than to reload: not for plain
        # nibbles with f16 scales (Q4_0, Q4_1: equal at T = 512, slower at T = 16).
        plain = unpack is not None and unpack.chunks is nibble_chunks and not unpack.side
        gemms.append(
            Shape(mr=mr, nr=groups * lanes, tc=64, pf=4096, rows=WIDE_ROWS, panel=not plain)
        )
    if lanes >= 16:
        gemms.append(Shape(mr=8, nr=lanes, tc=64, pf=4096))
    if target.tiles:
        gemms.append(Shape(mr=TILE_ROWS, nr=lanes, tc=64, pf=4096, tiles=True))
    if target.warps:  # the prefill on a GPU: a warp's tensor-core mma per 16 rows
        gemms.append(Shape(mr=MMA_ROWS, nr=lanes, tc=64, warps=True))
    return [Shape(mr=1, nr=lanes, tc=64, pf=8192), *sorted(gemms, key=lambda s: s.serves)]


# Batches from which a backend's wide tile serves: at T = 8..16 (weights in cache) it
# measured 1.1x over the 4-row tile, but a batch of 4..8 rows would compute up to 2 rows
# more in tiles of 3 (and decode batches stream their weights from memory anyway).
WIDE_ROWS = 16

# auto tiles read their rows ``t .. t + mr - 1`` without clamping them at the last one
# (one base address for all, the rows at constant offsets; a tile load cannot clamp): the
# quantised activations have this many rows more, their scales and sums zeroed by the
# quantiser when T > 1 (the GEMV reads none).
ROW_OVERREAD = TILE_ROWS - 1


def layout(mode: str, lanes: int) -> Layout:
    return LaneLayout(lanes) if mode == "auto" else RowLayout(ROWS)


class _Args:
    """The argument block's words as values (pointers where they are addresses); the
    number of 32-blocks per row is a constant when the kernel is specialised on K."""

    def __init__(self, k: Kernel, k_blocks: int) -> None:
        words = k.words(k.args[0], N_ARGS)
        self.t_rows, self.ldy = words[A_T], words[A_LDY]
        self.nb = k.i64(k_blocks)
        self.w, self.x, self.xd, self.xs, self.y, self.xk = (
            k.pointer(words[i]) for i in (A_W, A_X, A_XD, A_XS, A_Y, A_XK)
        )


def _clamped(k: Kernel, first: ir.Value, count: int, last: ir.Value) -> list[ir.Value]:
    """Rows ``first .. first+count`` capped at ``last``: a tile over the edge repeats the
    last row (same values stored twice) instead of needing remainder variants."""
    return [first] + [k.smin(k.add(first, i), last) for i in range(1, count)]


def _walk(
    k: Kernel,
    s: Shape,
    t_rows: ir.Value,
    tile: Callable[[ir.Value, ir.Value], None],
    panel: Callable[[ir.Value], None] | None = None,
) -> None:
    """Call ``tile(t, n)`` over activation chunks of ``s.tc`` rows, in each the weight rows
    ``[lo, hi)`` ``s.nr`` at a time (first ``panel(n)``, if given), in each the chunk's
    rows ``s.mr`` at a time."""
    lo, hi = k.args[1], k.args[2]

    def chunk(t0: ir.Value) -> None:
        t_next = k.add(t0, s.tc)
        t_end = k.select(k.lt(t_next, t_rows), t_next, t_rows)

        def rows(n: ir.Value) -> None:
            if panel is not None:
                panel(n)
            k.loop(t0, t_end, s.mr, lambda t: tile(t, n), partial=True)

        k.loop(lo, hi, s.nr, rows, partial=True)

    k.loop(0, t_rows, s.tc, chunk, partial=True)


def _record_at(k: Kernel, u: Unpack, b: ir.Value, record: int, side_record: int) -> ir.Value:
    """Where block ``b``'s record starts in its row group: after ``b`` records and, with
    side fields, the side records of its super-block and those before it
    (``layouts.side_interleave``)."""
    at = k.mul(b, record)
    return k.add(at, k.mul(k.add(k.lshr(b, 3), 1), side_record)) if u.side else at


def _side_at(k: Kernel, b: ir.Value, record: int, side_record: int) -> ir.Value:
    """Where the side record of block ``b``'s super-block starts in its row group."""
    return k.mul(k.lshr(b, 3), SUPER * record + side_record)


def _row_scales(k: Kernel, rule: Scale, at: dict[str, ir.Value], n: int) -> ir.Value:
    """``n`` scales of one weight row (exact's records), the side factor the same for all."""
    side = None
    if rule.side:
        side = k.splat(k.convert(k.load(F16, at[rule.side], 0, 2), F32), n)
    return rule.values(k, at[rule.plane], n, side)


def _integers(k: Kernel, u: Unpack, q: ir.Value) -> ir.Value:
    """Integer lanes -> ``q + offset`` as fp32 (small integers: exact)."""
    qf = k.convert(q, F32, signed=False)
    return k.add(qf, float(u.offset)) if u.offset else qf


def _integer_floats(k: Kernel, u: Unpack, p: dict[str, ir.Value]) -> ir.Value:
    """A block's ``q + offset`` as ``<32 x float>`` straight from the planes: nibbles and
    bytes widen from memory 8 at a time (``vpmovzxbd`` / ``vpmovsxbd`` loads), which
    costs about half the shuffles of converting the ``<32 x i8>`` of ``u.lanes``; Q6_K's
    six bits the same way (its GEMV 1.09x ``u.lanes``); a table format's values looked up
    signed, no offset to add."""
    if u.table is not None:
        return k.convert(u.table.lanes(k, p, signed=True), F32)
    if u.lanes not in (nibbles, six_bits, byte_lanes):
        return _integers(k, u, u.lanes(k, p))

    def widened(plane: str, at: int) -> ir.Value:
        return k.convert(k.load(vec(I8, 8), p[plane], at), I32, signed=False)

    if u.lanes is byte_lanes:
        ints = [widened("qs", at) for at in (0, 8, 16, 24)]
    else:  # byte k holds elements k (low nibble) and k + 16 (high)
        wide = [widened("qs", at) for at in (0, 8)]
        ints = [k.and_(w, 15) for w in wide] + [k.lshr(w, 4) for w in wide]
    if u.lanes is six_bits:
        # Q6_K's 2-bit highs: element e at bits 2 (e // 8) of byte e % 8 of ``q2``, so
        # the 8 bytes widened once serve every 8 elements, moved to bits 4-5 by a shift
        # (instead of ``u.lanes``' 32 bytes, widened after).
        q2 = widened("q2", 0)
        highs = [k.shl(q2, 4 - 2 * c) if c < 2 else k.lshr(q2, 2 * c - 4) for c in range(4)]
        ints = [k.b.or_(v, k.and_(hi, 0x30)) for v, hi in zip(ints, highs, strict=True)]
    if u.offset:  # in integers: the same exact values, ~1.09x the GEMV of a float add
        ints = [k.add(v, u.offset) for v in ints]
    return k.concat([k.convert(v, F32) for v in ints])


def _exact(k: Kernel, u: Unpack, s: Shape, k_blocks: int) -> None:
    """``exact``: one matmul function over weight rows ``[lo, hi)`` and all T activation
    rows, fp32 activations, weights unpacked to fp32 (``_exact_block`` is the float
    order). The GEMV unpacks each block in registers as it streams the weights; a GEMM
    tile's weight rows are unpacked once per activation chunk into a stack panel (a
    block's 32 values, its scales) that every tile of the chunk then reads: the same
    values in the same order, so rows stay bitwise independent of the batch."""
    a = _Args(k, k_blocks)
    aw = k.target.lanes  # fp32 lanes per accumulator
    acc_ty = vec(F32, aw)
    zero = ir.Constant(acc_ty, None)
    x_block = QK * 4  # bytes of one activation block (and of a block's unpacked values)
    h = u.halves
    n_last, t_last = k.add(k.args[2], -1), k.add(a.t_rows, -1)
    group_bytes = ROWS * u.block_bytes
    side_names = {f for f, _ in u.side}
    row_bytes = u.packed_bytes(QK * k_blocks)
    # A min per block (Q4_1, Q5_1, Q4_K, Q5_K) factors out with d: sum(w x) = d sum(q x)
    # + m sum(x), two FMAs a block where dequantising costs one a weight (the GEMV is
    # 1.15x this way). Every other format is dequantised (``per_weight``).
    factored = u.has_min and h == 1
    per_weight = not factored
    n_scales = 2 if factored else 0  # d and m beside a factored block's values

    def per_lane(v: ir.Value, n: int, b: int) -> ir.Value:
        """Block ``b``'s scale(s) of a ``<n x float>`` of ``h`` per block, over 32 lanes
        (with two per block, the first 16 lanes take the first)."""
        return k.shuffle(v, [b * h + lane * h // 32 for lane in range(32)])

    def unpacked(w_rows: list[ir.Value], use: Callable) -> None:
        """``use(j, kb, b, w, scales)`` for every block ``kb + b`` of weight row
        ``w_rows[j]`` in order: ``w`` its 32 values as fp32 (``q + offset``, or the
        weights where ``per_weight``), ``scales(e)`` its e-th scale as a scalar float.
        Scales are loaded and converted ``GROUP`` blocks at a time."""
        # Row r lives in row group r // ROWS at slot r % ROWS (see ``RowLayout``).
        w_group = [k.at(a.w, k.mul(k.and_(r, -ROWS), row_bytes)) for r in w_rows]
        w_slot = [k.and_(r, ROWS - 1) for r in w_rows]

        def group(kb: ir.Value, g: int) -> None:
            w_at, dw, mw = [], [], []
            record = _record_at(k, u, kb, group_bytes, ROWS * u.side_bytes)
            for j in range(len(w_rows)):
                base = k.at(w_group[j], record)
                w_at.append(
                    {
                        f: k.at(base, k.add(k.mul(w_slot[j], g * size), ROWS * g * at_f))
                        for f, size, at_f in u.fields
                    }
                )
                if s.pf and j == 0:
                    k.prefetch(base, s.pf, g * group_bytes)
                if u.side:  # the record's super-block's side record (g <= SUPER blocks)
                    side = k.at(w_group[j], _side_at(k, kb, group_bytes, ROWS * u.side_bytes))
                    w_at[j] |= {
                        f: k.at(side, k.add(k.mul(w_slot[j], size), ROWS * at_f))
                        for f, size, at_f in u.side_fields
                    }
                if u.has_scale:
                    dw.append(_row_scales(k, u.d, w_at[j], g * h))
                    mw.append(_row_scales(k, u.m, w_at[j], g * h) if u.has_min else None)
            for b in range(g):
                # Each block unpacked where it is used (all g up front keeps too many live).
                for j, at in enumerate(w_at):
                    p = {f: v if f in side_names else k.at(v, b * u.size(f)) for f, v in at.items()}
                    if not u.has_scale:  # float weights
                        w = u.lanes(k, p)
                    elif per_weight:
                        # d has at most 18 significant bits (an f16 times Q6_K's int8
                        # sub-scale) and d * (q + offset) at most 24 in every format
                        # (Q8_0: 11 + 8): exact in fp32, the reference's dequantised
                        # value; + m (Q2_K) its one rounding (one FMA, the same).
                        q, d = _integer_floats(k, u, p), per_lane(dw[j], g * h, b)
                        w = k.fma(q, d, per_lane(mw[j], g * h, b)) if u.has_min else k.mul(q, d)
                    else:
                        w = _integer_floats(k, u, p)

                    def scales(e: int, j: int = j, b: int = b) -> ir.Value:
                        v, at = (dw[j], b * h + e) if e < h else (mw[j], b)
                        return k.b.extract_element(v, ir.Constant(I32, at))

                    use(j, kb, b, w, scales)

        rest = k.loop(0, a.nb, GROUP, lambda kb: group(kb, GROUP))
        k.loop(rest, a.nb, 1, lambda kb: group(kb, 1))

    def x_chunks(x_at: ir.Value) -> list[ir.Value]:
        """An activation block's 32 floats as accumulator-wide chunks."""
        xv = k.load(vec(F32, QK), a.x, x_at)
        return [k.part(xv, c, aw) for c in range(0, QK, aw)]

    def finish(accs: list[list[Var]], x_rows: list[ir.Value], w_rows: list[ir.Value]) -> None:
        for i, x_row in enumerate(x_rows):
            y_row = k.mul(x_row, a.ldy)
            for j, w_row in enumerate(w_rows):
                total = k.reduce("fadd", accs[i][j].get())
                k.store(total, a.y, k.mul(k.add(y_row, w_row), 4), 4)

    def x_offsets(x_rows: list[ir.Value]) -> list[ir.Value]:
        return [k.mul(k.mul(r, a.nb), x_block) for r in x_rows]

    def block(acc: Var, w: list[ir.Value], xs: list[ir.Value], xsum, scale: Callable) -> None:
        acc.set(_exact_block(k, acc.get(), w, xs, xsum, scale, per_weight))

    if s.mr == 1:  # GEMV: weights unpacked in registers, streamed once

        def gemv(t: ir.Value, n: ir.Value) -> None:
            w_rows = _clamped(k, n, s.nr, n_last)
            accs = [[k.var(zero) for _ in w_rows]]
            x_off = x_offsets([t])[0]
            seen: dict = {}

            def use(j: int, kb: ir.Value, b: int, w: ir.Value, scales: Callable) -> None:
                if j == 0:  # the block's activations, once for all rows
                    xs = x_chunks(k.add(x_off, k.add(k.mul(kb, x_block), b * x_block)))
                    seen["xs"], seen["xsum"] = xs, k.total(xs) if factored else None
                ws = [k.part(w, c, aw) for c in range(0, QK, aw)]

                def scale(e: int) -> ir.Value:
                    return k.splat(scales(e), aw)

                block(accs[0][j], ws, seen["xs"], seen["xsum"], scale)

            unpacked(w_rows, use)
            finish(accs, [t], w_rows)

        _walk(k, s, a.t_rows, gemv)
        return

    # GEMM: the panel of s.nr weight rows, unpacked once per activation chunk.
    panel_row = k_blocks * x_block
    panel = k.stack(s.nr * panel_row)
    scale_row = k_blocks * n_scales * 4
    scale_panel = k.stack(max(1, s.nr * scale_row))
    align = 4 * aw

    def unpack(n: ir.Value) -> None:
        def use(j: int, kb: ir.Value, b: int, w: ir.Value, scales: Callable) -> None:
            blk = k.add(kb, b)
            k.store(w, panel, k.add(k.mul(blk, x_block), j * panel_row), align)
            for e in range(n_scales):
                at = k.add(k.mul(blk, n_scales * 4), j * scale_row + 4 * e)
                k.store(scales(e), scale_panel, at, 4)

        unpacked(_clamped(k, n, s.nr, n_last), use)

    def tile(t: ir.Value, n: ir.Value) -> None:
        w_rows = _clamped(k, n, s.nr, n_last)
        x_rows = _clamped(k, t, s.mr, t_last)
        x_off = x_offsets(x_rows)
        accs = [[k.var(zero) for _ in w_rows] for _ in x_rows]

        def dequantised(kb: ir.Value) -> None:
            """A register of lanes at a time across the tile: one register of each
            activation row live (each accumulator's FMAs in ``_exact_block``'s order)."""
            at = k.mul(kb, x_block)
            for c in range(0, QK, aw):
                xc = [k.load(acc_ty, a.x, k.add(k.add(o, at), 4 * c)) for o in x_off]
                for j in range(s.nr):
                    wc = k.load(acc_ty, panel, k.add(at, j * panel_row + 4 * c), align)
                    for i in range(s.mr):
                        accs[i][j].set(k.fma(wc, xc[i], accs[i][j].get()))

        def factored_block(kb: ir.Value) -> None:
            at = k.mul(kb, x_block)
            xs = [x_chunks(k.add(o, at)) for o in x_off]
            xsum = [k.total(x) for x in xs]
            for j in range(s.nr):
                ws = [
                    k.load(acc_ty, panel, k.add(at, j * panel_row + 4 * c), align)
                    for c in range(0, QK, aw)
                ]
                sc_at = k.add(k.mul(kb, n_scales * 4), j * scale_row)

                def scale(e: int, sc_at: ir.Value = sc_at) -> ir.Value:
                    return k.splat(k.load(F32, scale_panel, k.add(sc_at, 4 * e), 4), aw)

                for i in range(s.mr):
                    block(accs[i][j], ws, xs[i], xsum[i], scale)

        k.loop(0, a.nb, 1, dequantised if per_weight else factored_block)
        finish(accs, x_rows, w_rows)

    _walk(k, s, a.t_rows, tile, unpack)


def _exact_block(
    k: Kernel,
    acc: ir.Value,
    w: list[ir.Value],
    xs: list[ir.Value],
    xsum: ir.Value | None,
    scale: Callable[[int], ir.Value],
    per_weight: bool,
) -> ir.Value:
    """``acc`` plus one block of one (activation row, weight row): the float order of
    every exact kernel. ``w`` and ``xs`` are the block's values (dequantised weights, or
    a factored block's q) and activations in accumulator-wide chunks; with a factored
    min ``scale(0)``, ``scale(1)`` its d and m broadcast and ``xsum`` the activations'
    chunks summed in order."""
    if per_weight:
        # Float weights (or Q2_K's min per 16, dequantised): each lane's w * x straight
        # into its accumulator, chunk by chunk.
        for wc, xc in zip(w, xs, strict=True):
            acc = k.fma(wc, xc, acc)
        return acc
    # A factored min: the block's sum of q x in fp32, then one FMA by d and one by m.
    part = k.mul(w[0], xs[0])
    for wc, xc in zip(w[1:], xs[1:], strict=True):
        part = k.fma(wc, xc, part)
    return k.fma(xsum, scale(1), k.fma(part, scale(0), acc))


class _AutoBlock:
    """What the ``auto`` kernels share per row group and block: the record's fields and
    scales, the sums' keys, and the float order that turns a block's integer sums into
    the output (the same order in every ``auto`` kernel, so results agree bitwise)."""

    def __init__(self, k: Kernel, u: Unpack, a: _Args, k_blocks: int) -> None:
        self.k, self.u, self.a, self.lanes = k, u, a, k.target.lanes
        self.record = self.lanes * u.block_bytes
        self.field_at = {f: self.lanes * at for f, _, at in u.fields}
        self.side_at = {f: self.lanes * at for f, _, at in u.side_fields}
        self.side_record = self.lanes * u.side_bytes
        self.group_bytes = self.lanes * u.packed_bytes(QK * k_blocks)
        self.h = u.halves

    @staticmethod
    def key(j: int, h: int) -> tuple[int, int]:
        """Chunk j's sum: (sub-block, activation scale group); chunk j is elements 4j..4j+3,
        scale group j % 2 (see X_GROUPS)."""
        return j * h // 8, j % 2

    def group(self, n: ir.Value) -> ir.Value:
        """The records of the row group holding weight row ``n``."""
        k = self.k
        return k.at(self.a.w, k.mul(k.udiv(n, self.lanes), self.group_bytes))

    def planes(self, group: ir.Value, b: ir.Value, pf: int) -> dict[str, ir.Value]:
        """Block ``b``'s fields in the row group, and its super-block's side fields."""
        k = self.k
        base = k.at(group, _record_at(k, self.u, b, self.record, self.side_record))
        if pf:
            k.prefetch(base, pf, self.record)
        fields = {f: k.at(base, at) for f, at in self.field_at.items()}
        if self.side_at:
            side = k.at(group, _side_at(k, b, self.record, self.side_record))
            fields |= {f: k.at(side, at) for f, at in self.side_at.items()}
        return fields

    def weight_scales(self, p: dict[str, ir.Value]) -> tuple[list[ir.Value], ir.Value | None]:
        """The rows' ``d`` per sub-block and their min per ``sum(x)`` (None: no min)."""
        k, u, lanes = self.k, self.u, self.lanes

        def row_scales(rule: Scale, n: int) -> ir.Value:
            side = None
            if rule.side:
                side = k.convert(k.load(vec(F16, lanes), p[rule.side], 0, 2), F32)
            return rule.values(k, k.at(p[rule.plane], n * lanes * rule.bytes), lanes, side)

        return [row_scales(u.d, n) for n in range(self.h)], (row_scales(u.m, 0) if u.m else None)

    def offset_sums(self, blk: ir.Value, width: int = 0) -> dict[tuple[int, int], ir.Value]:
        """Per key of activation block ``blk``: ``offset`` times the sum of its int8
        activations, as the i32 lanes a key's dot sum starts from (the weights are stored
        as ``q - offset``, see ``kernel.formats``): ``width`` lanes (0: the backend's),
        1 an i32."""
        k, a = self.k, self.a
        at = k.mul(blk, 4 * KEY_SUMS)
        out = {}
        for n in range(self.h):
            for g in range(2):
                total = k.load(I32, a.xk, k.add(at, 4 * key_slot(n, g, self.h)), 4)
                if width != 1:  # splat first: one vector shift, no scalar round trip
                    total = k.splat(total, width or self.lanes)
                out[n, g] = k.mul(total, -self.u.offset)  # the sums are stored negated
        return out

    def scaled(
        self,
        acc: ir.Value,
        sums: Callable[[int, int], ir.Value],
        blk: ir.Value,
        dw: list[ir.Value],
        m_eff: ir.Value | None,
    ) -> ir.Value:
        """``acc`` plus activation block ``blk``'s part: ``sums(n, g)`` (fp32) scaled by the
        activation's group scales and the rows' ``d``, then the min's ``m * sum(x)``; lane
        by lane (``acc``'s lanes: the backend's, or a warp lane's columns)."""
        k, lanes = self.k, acc.type.count
        # scalar loads, so each broadcast folds into the multiply (``{1to16}``)
        dx = [
            k.splat(k.load(F32, self.a.xd, k.add(k.mul(blk, 8), 4 * g), 4), lanes) for g in (0, 1)
        ]
        for n in range(self.h):
            f0, f1 = sums(n, 0), sums(n, 1)
            both = k.fma(f1, dx[1], k.mul(f0, dx[0]))
            acc = k.fma(both, dw[n], acc)
        if m_eff is not None:  # the min's part, m * sum(x)
            xs = k.load(F32, self.a.xs, k.mul(blk, 4))
            acc = k.fma(m_eff, k.splat(xs, lanes), acc)
        return acc

    def store_rows(self, accs: list[ir.Value], t: ir.Value, n: ir.Value) -> None:
        """A tile's ``accs`` into y's rows ``t, t + 1, ..``: those before T (the rows past
        it computed the quantiser's zero padding)."""
        k = self.k
        self.store(accs[0], t, n)
        for i, acc in enumerate(accs[1:], 1):
            row = k.add(t, i)
            k.branch(k.lt(row, self.a.t_rows), lambda acc=acc, row=row: self.store(acc, row, n))

    def store(self, acc: ir.Value, row: ir.Value, n: ir.Value) -> None:
        """``acc`` into y's activation row ``row`` at weight rows ``n ..``: all lanes, or
        those that exist in the last row group."""
        k, a, lanes = self.k, self.a, self.lanes
        y = k.at(a.y, k.mul(k.add(k.mul(row, a.ldy), n), 4))
        left = k.sub(a.ldy, n)

        def one_by_one(r: ir.Value) -> None:
            k.store(k.b.extract_element(acc, r), y, k.mul(r, 4), 4)

        k.branch(
            k.ge(left, lanes),
            lambda: k.store(acc, y, 0, 4),
            lambda: k.loop(0, left, 1, one_by_one),
        )


def _auto(k: Kernel, u: Unpack, s: Shape, k_blocks: int) -> None:
    """``auto``: one int8 matmul function over weight rows ``[lo, hi)`` (``lo`` a multiple
    of the lanes) and all T activation rows, one weight row per fp32 lane.

    Per block and activation row: each chunk's integer dot against the activation's 4
    matching elements (broadcast) serves every row of the register, and of each of the
    tile's ``s.nr / lanes`` row groups; the block's sums are
    kept per activation scale group and sub-block, each started from ``offset`` times the
    activations' sum (weights are stored unsigned, ``q - offset``), converted once and
    scaled by the rows' ``d`` in one FMA. The output of a tile is ``lanes`` consecutive
    floats of y: no horizontal sums. Where the backend's unsigned dot would not be exact
    for the format's bytes (Q8_0's 0..255 in int16 pairs or ``sdot``), the bytes are made
    signed again (``q + offset``, offset -128) and dot signed: the same integer sums."""
    a, target = _Args(k, k_blocks), k.target
    blocks = _AutoBlock(k, u, a, k_blocks)
    lanes, h = target.lanes, u.halves
    i32_l = vec(I32, lanes)
    int32_sums = target.accumulate == "int32"
    unsigned = target.u8_dot_exact(u.bound)
    if not unsigned and u.offset != -128:
        raise ValueError(f"{u.name}: {target.name} has no exact dot for bytes up to {u.bound}")
    # int16 pair products summed before widening (signed bytes: magnitudes up to 128)
    run = max(1, 32767 // (2 * (u.bound if unsigned else 128) * 127))
    signed_dots = not unsigned and target.signed_dot
    moved_sign = not unsigned and not signed_dots  # the sign moves onto the activations
    dot = target.dot_s8s8 if signed_dots else target.dot_u8s8

    def widened(products: list[ir.Value]) -> ir.Value:
        """Sum of int16 pair products as i32: in int16 ``run`` at a time, then int32."""
        total = None
        for r in range(0, len(products), run):
            part = products[r]
            for p in products[r + 1 : r + run]:
                part = k.b.add(part, p)
            part = target.pair_sums(k, part)
            total = part if total is None else k.b.add(total, part)
        return total

    groups = s.nr // lanes  # row groups per tile: each activation broadcast serves them all
    keys = [(n, g) for n in range(h) for g in range(2)]
    zero = ir.Constant(i32_l, None)
    chunk_bytes = 4 * lanes

    def row_groups(n: ir.Value) -> tuple[list[ir.Value], list[ir.Value | None], list[ir.Value]]:
        """Row group c of the tile at ``n`` starts at n + c * lanes (``starts``); one past
        the thread's rows [lo, hi) (not ``inside``) recomputes the first (a clamped
        pointer) and is not stored. Returns starts, inside and the groups' records."""
        starts = [n] + [k.add(n, c * lanes) for c in range(1, groups)]
        inside = [None] + [k.lt(r, k.args[2]) for r in starts[1:]]
        records = [blocks.group(n)] + [
            blocks.group(k.select(ok, r, n)) for r, ok in zip(starts[1:], inside[1:], strict=True)
        ]
        return starts, inside, records

    def weight_chunks(p: dict[str, ir.Value]) -> list[ir.Value]:
        if not unsigned and u.table is not None:  # the table's values signed, as looked up
            return u.table.chunks(k, p, lanes, signed=True)
        chunks = u.chunks(k, p, lanes)
        if not unsigned:  # q - offset back to q + offset = q ^ 0x80, as signed bytes
            chunks = [k.b.xor(c, const(c.type, -128)) for c in chunks]
        return chunks

    # A ``panel`` tile (the wide prefill tile) reads its row groups' blocks from a stack
    # panel, unpacked once per activation chunk (``_walk``'s ``panel``), not once per
    # tile: the weight chunks and the rows' scales of block b, row group c at
    # ``(b * groups + c) * record``. The same values: ``y`` is bitwise the same.
    n_scales = h + (1 if u.m else 0)
    record = 8 * chunk_bytes + n_scales * 4 * lanes
    panel = k.stack(groups * k_blocks * record) if s.panel else None

    def unpack(n: ir.Value) -> None:
        records = row_groups(n)[2]

        def block(b: ir.Value) -> None:
            at = k.mul(b, groups * record)
            for c, group in enumerate(records):
                p = blocks.planes(group, b, s.pf if c == 0 else 0)
                out = k.at(panel, k.add(at, c * record))
                for j, chunk in enumerate(weight_chunks(p)):
                    k.store(chunk, out, j * chunk_bytes, 32)
                dw, m_eff = blocks.weight_scales(p)
                for e, v in enumerate(dw if m_eff is None else [*dw, m_eff]):
                    k.store(v, out, 8 * chunk_bytes + 4 * lanes * e, 32)

        k.loop(0, a.nb, 1, block)

    def from_panel(b: ir.Value) -> tuple[list[list[ir.Value]], list[tuple]]:
        """Block ``b``'s weight chunks and scales of every row group, from the panel."""
        at = k.mul(b, groups * record)
        chunks, scales = [], []
        for c in range(groups):
            rec = k.at(panel, k.add(at, c * record))
            chunks.append(
                [k.load(vec(I8, chunk_bytes), rec, j * chunk_bytes, 32) for j in range(8)]
            )
            vs = [
                k.load(vec(F32, lanes), rec, 8 * chunk_bytes + 4 * lanes * e, 32)
                for e in range(n_scales)
            ]
            scales.append((vs[:h], vs[h] if u.m else None))
        return chunks, scales

    def tile(t: ir.Value, n: ir.Value) -> None:
        starts, inside, records = row_groups(n)
        first = k.mul(t, a.nb)  # row t's first block; row t + i's is i * nb further
        accs = [[k.var(ir.Constant(vec(F32, lanes), None)) for _ in range(s.mr)] for _ in starts]

        def block(b: ir.Value) -> None:
            if panel is not None:
                chunks, scales = from_panel(b)
            else:
                ps = [
                    blocks.planes(group, b, s.pf if c == 0 else 0)
                    for c, group in enumerate(records)
                ]
                chunks = [weight_chunks(p) for p in ps]
                scales = [blocks.weight_scales(p) for p in ps]
            if moved_sign:
                absolute = ir.Constant(ir.IntType(1), 0)
                mags = [
                    [k.call(f"llvm.abs.v{4 * lanes}i8", c.type, c, absolute) for c in cs]
                    for cs in chunks
                ]
            else:
                mags = chunks
            blks = [k.add(k.add(first, b), i * k_blocks) for i in range(s.mr)]
            xqs = [k.at(a.x, k.mul(blk, QK)) for blk in blks]
            offsets = [blocks.offset_sums(blk) if unsigned and u.offset else {} for blk in blks]
            # Key by key (a key's chunks for every row and row group, then the next key's):
            # one key's sums are live at a time, which leaves registers for the row groups
            # (the integer sums are exact in any order; the float order is ``scaled``'s).
            floats: dict[tuple[int, int, int, int], ir.Value] = {}
            for key in keys:
                sums: dict[tuple[int, int], list[ir.Value]] = {}
                for j in (j for j in range(8) if blocks.key(j, h) == key):
                    for i in range(s.mr):
                        x32 = k.splat(k.load(I32, xqs[i], 4 * j), lanes)
                        xj = k.bitcast(x32, vec(I8, 4 * lanes))
                        for c in range(groups):
                            xc = target.sign_of(k, xj, chunks[c][j]) if moved_sign else xj
                            if int32_sums:
                                prev = sums.get((i, c), [offsets[i].get(key, zero)])[0]
                                sums[i, c] = [dot(k, prev, mags[c][j], xc)]
                            else:
                                product = target.pair_products(k, mags[c][j], xc)
                                sums.setdefault((i, c), []).append(product)
                for (i, c), part in sums.items():
                    total = part[0] if int32_sums else widened(part)
                    if not int32_sums and key in offsets[i]:
                        total = k.b.add(offsets[i][key], total)
                    floats[(i, c, *key)] = k.convert(total, F32)
            for c, (dw, m_eff) in enumerate(scales):
                for i in range(s.mr):

                    def as_float(n: int, g: int, i: int = i, c: int = c) -> ir.Value:
                        return floats[i, c, n, g]

                    accs[c][i].set(blocks.scaled(accs[c][i].get(), as_float, blks[i], dw, m_eff))

        k.loop(0, a.nb, 1, block)
        blocks.store_rows([acc.get() for acc in accs[0]], t, n)
        for c in range(1, groups):
            rows = [acc.get() for acc in accs[c]]
            k.branch(inside[c], lambda rows=rows, c=c: blocks.store_rows(rows, t, starts[c]))

    _walk(k, s, a.t_rows, tile, unpack if panel is not None else None)


def _auto_tiles(k: Kernel, u: Unpack, s: Shape, k_blocks: int) -> None:
    """``auto`` for ``TILE_ROWS`` activation rows at a time as int8 tile products: per
    block, each (sub-block, scale group) key's sums are C = A x B_key, A the rows'
    quantised block (rows K bytes apart), B_key the block's chunks of that key (zero rows
    for the others' chunks), stored to the stack and scaled as ``_auto`` scales its sums.
    Reads up to ``ROW_OVERREAD`` activation rows past T (their results are not stored)."""
    a, target = _Args(k, k_blocks), k.target
    blocks = _AutoBlock(k, u, a, k_blocks)
    lanes, h, rows = target.lanes, u.halves, s.mr
    keys = [(n, g) for n in range(h) for g in range(2)]
    b_bytes, c_bytes = 8 * 4 * lanes, rows * 4 * lanes  # one B, one C
    b_tiles = k.stack(len(keys) * b_bytes, zeroed=True)  # rows not of the key stay zero
    c_tiles = k.stack(len(keys) * c_bytes)
    bs = [k.at(b_tiles, i * b_bytes) for i in range(len(keys))]
    cs = [k.at(c_tiles, i * c_bytes) for i in range(len(keys))]
    target.tile_begin(k, len(keys))
    x_stride = k.mul(a.nb, QK)

    def tile(t: ir.Value, n: ir.Value) -> None:
        group = blocks.group(n)
        first = k.mul(t, a.nb)
        accs = [k.var(ir.Constant(vec(F32, lanes), None)) for _ in range(rows)]
        x_tile = k.at(a.x, k.mul(t, x_stride))

        def block(b: ir.Value) -> None:
            p = blocks.planes(group, b, s.pf)
            for j, chunk in enumerate(u.chunks(k, p, lanes)):
                k.store(chunk, bs[keys.index(blocks.key(j, h))], 4 * lanes * j, 64)
            target.tile_products(k, k.at(x_tile, k.mul(b, QK)), x_stride, bs, cs)
            dw, m_eff = blocks.weight_scales(p)
            for i in range(rows):
                blk = k.add(k.add(first, b), i * k_blocks)
                start = blocks.offset_sums(blk) if u.offset else {}

                def as_float(n: int, g: int, i: int = i, start: dict = start) -> ir.Value:
                    c = k.load(vec(I32, lanes), cs[keys.index((n, g))], 4 * lanes * i, 64)
                    return k.convert(k.b.add(start[n, g], c) if start else c, F32)

                accs[i].set(blocks.scaled(accs[i].get(), as_float, blk, dw, m_eff))

        k.loop(0, a.nb, 1, block)
        blocks.store_rows([acc.get() for acc in accs], t, n)

    _walk(k, s, a.t_rows, tile)
    target.tile_end(k)


def _auto_mma(k: Kernel, u: Unpack, s: Shape, k_blocks: int) -> None:
    """``auto`` for ``MMA_ROWS`` activation rows at a time by a warp's tensor-core int8
    ``mma`` (``Backend.mma_s8u8``, m16n8k16: A the rows' quantised activations, signed; B
    a row group's unsigned weight chunks, the ``lanes`` = 8 weight rows its columns). A
    warp-cooperative body (``f(args, lo, hi, lane)``, see ``nvptx``): the warp's lanes walk
    the same tiles and blocks. Per block, each (sub-block, scale group) key is one mma over
    that key's chunks only: lane ``q`` of a group gives the key's ``q``-th chunk (k =
    4q .. 4q+3; keys of 2 chunks, with 2 sub-blocks a block, leave lanes 2 and 3 zero), C
    starts from ``offset`` times the activations' key sums: D is the vector kernel's int32
    sum of each (row, weight row). A lane then scales its D elements (rows g and g + 8,
    weight rows 2q and 2q + 1) in ``_AutoBlock.scaled``'s float order, so ``y`` is bitwise
    the dp4a kernel's. Rows past T read the last row (clamped) and are not stored."""
    a, target = _Args(k, k_blocks), k.target
    blocks = _AutoBlock(k, u, a, k_blocks)
    lanes, h = target.lanes, u.halves
    if lanes != 8:
        raise ValueError(f"mma tiles want 8 weight rows a row group (m16n8), not {lanes}")
    keys = [(n, g) for n in range(h) for g in range(2)]
    key_chunks = {key: [j for j in range(8) if blocks.key(j, h) == key] for key in keys}
    lane = k.args[3]
    g, q = k.lshr(lane, 2), k.and_(lane, 3)
    cols = [k.add(k.shl(q, 1), c) for c in (0, 1)]  # this lane's D columns (weight rows)
    t_last, hi = k.add(a.t_rows, -1), k.args[2]
    x_stride = k.mul(a.nb, QK)
    stash = k.stack(8 * 4 * lanes)  # the block's unpacked chunks, chunk j at 4 * lanes * j

    def two(v: ir.Value) -> ir.Value:
        """This lane's two columns of a row group's ``<lanes x float>``."""
        out = ir.Constant(vec(F32, 2), None)
        for c, col in enumerate(cols):
            out = k.b.insert_element(out, k.b.extract_element(v, col), ir.Constant(I32, c))
        return out

    def tile(t: ir.Value, n: ir.Value) -> None:
        group = blocks.group(n)
        first = [k.add(t, g), k.add(t, k.add(g, 8))]  # this lane's D rows (unclamped)
        rows = [k.smin(r, t_last) for r in first]
        accs = [k.var(ir.Constant(vec(F32, 2), None)) for _ in rows]

        def block(b: ir.Value) -> None:
            p = blocks.planes(group, b, 0)
            for j, chunk in enumerate(u.chunks(k, p, lanes)):
                k.store(chunk, stash, 4 * lanes * j, 4)
            x_at = k.at(a.x, k.mul(b, QK))
            blks = [k.add(k.mul(r, a.nb), b) for r in rows]
            starts = [blocks.offset_sums(blk, 1) if u.offset else {} for blk in blks]
            sums = {}
            for key in keys:
                chunks = key_chunks[key]

                def fragment(lane: ir.Value, chunks: list[int] = chunks) -> tuple:
                    g_l, q_l = k.lshr(lane, 2), k.and_(lane, 3)
                    j = k.i64(chunks[0])
                    for i, c in enumerate(chunks[1:], 1):
                        j = k.select(k.b.icmp_signed("==", q_l, k.i64(i)), k.i64(c), j)
                    a_rows = [k.smin(k.add(t, k.add(g_l, 8 * i)), t_last) for i in (0, 1)]
                    a_regs = [k.load(I32, x_at, k.add(k.mul(r, x_stride), k.mul(j, 4)), 4)
                              for r in a_rows]  # fmt: skip
                    b_reg = k.load(I32, stash, k.add(k.mul(j, 4 * lanes), k.mul(g_l, 4)), 4)
                    if len(chunks) < 4:  # lanes past the key's chunks add nothing
                        b_reg = k.select(k.lt(q_l, len(chunks)), b_reg, ir.Constant(I32, 0))
                    return a_regs[0], a_regs[1], b_reg

                c = [starts[e // 2][key] if u.offset else ir.Constant(I32, 0) for e in range(4)]
                sums[key] = target.mma_s8u8(k, lane, fragment, c)
            dw, m_eff = blocks.weight_scales(p)
            dw, m_eff = [two(d) for d in dw], (two(m_eff) if m_eff is not None else None)
            for r in (0, 1):

                def as_float(n: int, g_: int, r: int = r) -> ir.Value:
                    d = sums[n, g_]
                    pair = ir.Constant(vec(I32, 2), None)
                    for c in (0, 1):
                        pair = k.b.insert_element(pair, d[2 * r + c], ir.Constant(I32, c))
                    return k.convert(pair, F32)

                accs[r].set(blocks.scaled(accs[r].get(), as_float, blks[r], dw, m_eff))

        k.loop(0, a.nb, 1, block)
        for r in (0, 1):
            y_row = k.mul(first[r], a.ldy)
            for c, col in enumerate(cols):
                value = k.b.extract_element(accs[r].get(), ir.Constant(I32, c))
                at = k.mul(k.add(y_row, k.add(n, col)), 4)
                inside = k.b.and_(k.lt(first[r], a.t_rows), k.lt(k.add(n, col), hi))
                k.branch(inside, lambda value=value, at=at: k.store(value, a.y, at, 4))

    _walk(k, s, a.t_rows, tile)


def _group_maxima(k: Kernel, v: ir.Value) -> ir.Value:
    """The largest magnitude of each ``X_GROUPS`` group of a block's 32 values, as 2 lanes
    (``Kernel.magnitude_bits``: a group holding a NaN gets a NaN scale, so its products are
    not finite, as in exact): a tree of lane-wise maxima whose every step keeps 4-value
    chunk j in group j % 2 (lanes i and i + 16, then i and i + 8, hold chunks of one
    group)."""
    bits = k.magnitude_bits(v)
    m = k.smax(k.part(bits, 0, 16), k.part(bits, 16, 16))
    m = k.smax(k.part(m, 0, 8), k.part(m, 8, 8))  # lanes 0-3: group 0, lanes 4-7: group 1
    m = k.smax(k.shuffle(m, [0, 1, 4, 5]), k.shuffle(m, [2, 3, 6, 7]))
    return k.bitcast(k.smax(k.shuffle(m, [0, 2]), k.shuffle(m, [1, 3])), vec(F32, 2))


def _quantize(k: Kernel, k_blocks: int) -> None:
    """Activation rows [lo, hi) of fp32 [T, K] -> int8 [T, K], per-block scales dx
    [T, nb, 2] (one per ``X_GROUPS`` group), sum(dx * q) [T, nb] and the negated integer
    sums of q per key (``key_slot``) [T, nb, KEY_SUMS]."""
    a = _Args(k, k_blocks)
    x_in = a.y  # the fp32 source rides in the y slot
    f32x32 = vec(F32, 32)

    def block(b: ir.Value) -> None:
        v = k.load(f32x32, x_in, k.mul(b, QK * 4), 4)
        amax = _group_maxima(k, v)
        pair = vec(F32, 2)
        d = k.b.fdiv(amax, const(pair, 127.0))
        positive = k.b.fcmp_ordered(">", amax, const(pair, 0.0))
        inv = k.select(positive, k.b.fdiv(const(pair, 127.0), amax), const(pair, 0.0))
        scaled = k.mul(v, k.shuffle(inv, [i // 4 % 2 for i in range(QK)]))
        # a NaN or an inf scales to NaN (its group's scale is not finite): stored as 0
        q = k.convert(k.call("llvm.nearbyint.v32f32", f32x32, k.nan_to_zero(scaled)), I8)
        k.store(q, a.x, k.mul(b, QK))
        k.store(d, a.xd, k.mul(b, 8), 4)
        wide = k.convert(q, I32)
        total = ir.Constant(F32, 0.0)
        sums_at = k.mul(b, 4 * KEY_SUMS)

        def store_sum(value: ir.Value, slot: int) -> None:
            k.store(k.b.neg(value), a.xk, k.add(sums_at, 4 * slot), 4)

        for g, lanes in enumerate(X_GROUPS):
            halves = [k.reduce("add", k.shuffle(wide, [e for e in lanes if e // 16 == n]))
                      for n in (0, 1)]  # fmt: skip
            whole = k.b.add(halves[0], halves[1])
            for n, half in enumerate(halves):
                store_sum(half, key_slot(n, g, 2))
            store_sum(whole, key_slot(0, g, 1))
            d_g = k.b.extract_element(d, ir.Constant(I32, g))
            total = k.fma(d_g, k.convert(whole, F32), total)
        k.store(total, a.xs, k.mul(b, 4), 4)

    k.loop(k.mul(k.args[1], a.nb), k.mul(k.args[2], a.nb), 1, block)

    def padding(blk: ir.Value) -> None:
        k.store(ir.Constant(vec(F32, 2), None), a.xd, k.mul(blk, 8), 4)
        k.store(ir.Constant(F32, 0.0), a.xs, k.mul(blk, 4), 4)
        k.store(ir.Constant(vec(I32, KEY_SUMS), None), a.xk, k.mul(blk, 4 * KEY_SUMS), 4)

    last = k.b.and_(k.b.icmp_signed("==", k.args[2], a.t_rows), k.lt(k.i64(1), a.t_rows))
    pad_end = k.mul(k.add(a.t_rows, ROW_OVERREAD), a.nb)
    k.branch(last, lambda: k.loop(k.mul(a.t_rows, a.nb), pad_end, 1, padding))


def _build(module: Module, k_blocks: int, ggml_type: int = -1, mode: str = "", mr: int = 0) -> None:
    """One kernel: the matmul tile of ``mr`` activation rows of a format in a mode, or
    (``mr = 0``) the activations' quantiser (the same for every format), specialised on
    K = 32 * ``k_blocks``."""
    if not mr:
        k = module.kernel(module.ir.name, _PARAMS)
        _quantize(k, k_blocks)
    else:
        shape = next(s for s in buckets(mode, module.target, ggml_type) if s.mr == mr)
        # a warp's tile takes its lane too (a warp-cooperative body, see ``nvptx``)
        k = module.kernel(module.ir.name, (*_PARAMS, I64) if shape.warps else _PARAMS)
        body = (
            _auto_mma
            if shape.warps
            else _auto_tiles
            if shape.tiles
            else _auto
            if mode == "auto"
            else _exact
        )
        body(k, UNPACKS[ggml_type], shape, k_blocks)
    k.ret()


MATMUL = Program("mm", _build)


# What a GEMV row costs in tile rows when it computes the rest of a ragged batch (the
# head's matmul, T = 4..8 rows: 1.8-2.2 on AVX-512 beside tiles of 8, 1.6 on AVX2).
GEMV_ROW_COST = 2.0
# Weight rows the pair's two tiles take turns on: a multiple of every layout's row group
# and of every tile's rows (AVX2's wide tile: 24), and at most ~50 KB of weights (K = 1536
# in Q4_1), which the second tile finds in L2.
PAIR_ROWS = 48


def _build_pair(module: Module) -> None:
    """``pair(block, lo, hi)``, ``block`` = [fn, args, fn2, args2]: ``fn(args, r, r2)``
    then ``fn2(args2, r, r2)`` over ``[lo, hi)`` in runs of ``PAIR_ROWS`` weight rows. A
    ragged batch's two tiles (``MatmulKernels.cover``) over the same weight rows as one
    job of the pool: a thread runs both on each run of the rows it takes while the
    weights are still in its cache (the pool's grabs are up to a quarter of a matrix: the
    second tile would stream a 30 MB head from memory again), and no barrier parts them
    (they write other rows)."""
    k = module.kernel(module.ir.name, _PARAMS)
    block, lo, hi = k.args
    fn, args, fn2, args2 = (k.pointer(w) for w in k.words(block, 4))

    def run(r: ir.Value) -> None:
        end = k.smin(k.add(r, PAIR_ROWS), hi)
        k.call_at(fn, VOID, args, r, end)
        k.call_at(fn2, VOID, args2, r, end)

    k.loop(lo, hi, PAIR_ROWS, run, partial=True)
    k.ret()


PAIR = Program("mm_pair", _build_pair)


def _build_grouped(module: Module) -> None:
    """``grouped(block, lo, hi)``, ``block`` = [rows, stride, fn0, args0, fn1, args1, ...]:
    several matmuls of ``rows`` weight rows each (a mixture's selected experts) as one job
    of the pool over virtual rows, matmul i owning ``[i * stride, i * stride + rows)``
    (``stride``: ``rows`` rounded up to whole row groups and tiles, so every piece starts
    on one): each piece of ``[lo, hi)`` runs ``fn_i(args_i, piece)`` (a tile, or ``pair``
    for a ragged cover). One barrier for all of them instead of one each."""
    k = module.kernel(module.ir.name, _PARAMS)
    block, lo, hi = k.args
    n_rows, stride = k.words(block, 2)

    def part(i: ir.Value) -> None:
        start = k.mul(i, stride)
        a = k.smax(k.sub(lo, start), k.i64(0))
        b = k.smin(k.sub(hi, start), n_rows)
        entry = k.index(block, k.add(k.mul(i, 2), 2), I64)
        fn, args = (k.pointer(w) for w in k.words(entry, 2))
        k.branch(k.lt(a, b), lambda: k.call_at(fn, VOID, args, a, b))

    k.loop(k.b.sdiv(lo, stride), k.b.sdiv(k.add(hi, k.sub(stride, 1)), stride), 1, part)
    k.ret()


GROUPED = Program("mm_grouped", _build_grouped)
_SIG = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def supported(ggml_type: int, mode: str) -> bool:
    """Whether a kernel exists for this GGUF type in ``mode`` ("exact" or "auto"; auto
    falls back to exact for formats without int8 kernels)."""
    return ggml_type in UNPACKS and mode in ("exact", "auto")


def effective_mode(ggml_type: int, mode: str) -> str:
    return mode if UNPACKS[ggml_type].has_int8 else "exact"


class MatmulKernels:
    """A weight format's kernels in one mode for one backend and K -- a tile per batch
    bucket and the activations' quantiser -- each lowered when first asked for (a
    decode-only server never compiles a GEMM)."""

    def __init__(self, ggml_type: int, mode: str, backend: Backend, n_cols: int) -> None:
        self.mode = effective_mode(ggml_type, mode)
        self.backend = backend
        self.layout = layout(self.mode, backend.lanes)
        shapes = buckets(self.mode, backend, ggml_type)
        self._mrs, self._amx = [s.mr for s in shapes], [s.tiles for s in shapes]
        self._warps = [s.warps for s in shapes]
        self._from, self._nrs = [s.serves for s in shapes], [s.nr for s in shapes]
        nb = n_cols // QK
        spec = {"k_blocks": nb, "ggml_type": int(ggml_type), "mode": self.mode}
        self._specs = [{**spec, "mr": mr} for mr in self._mrs] + [{"k_blocks": nb}]
        # what each index lowers: the tiles, the quantiser, then the pair of two tiles
        self._programs = [(MATMUL, spec) for spec in self._specs] + [(PAIR, {}), (GROUPED, {})]
        self._done: list[Executable | None] = [None] * len(self._programs)
        self._covers: dict[int, list[tuple[int, int, int]]] = {}  # cover's, by t_rows
        self._calls: list[Callable[[int, int, int], None] | None] = [None] * len(self._programs)

    @property
    def row_multiple(self) -> int:
        """Weight rows a thread's share should be a multiple of: whole row groups and
        whole tiles; 16 where that makes both. AVX2's 24-row tile: 24 (48 = lcm with 16
        left 4 grabs of a 192-row matrix to 2 threads: 0.85x at T = 512)."""
        whole = math.lcm(self.layout.rows, *self._nrs)
        return 16 if 16 % whole == 0 else whole

    @property
    def specs(self) -> list[dict[str, int]]:
        """Each kernel's spec: the tiles per batch bucket, then the quantiser."""
        return self._specs

    @property
    def quantize(self) -> int:
        """The index of the quantiser (auto mode)."""
        return len(self._specs) - 1

    @property
    def pair(self) -> int:
        """The index of the pair program (two tiles as one call, see ``cover``)."""
        return len(self._programs) - 2

    @property
    def grouped(self) -> int:
        """The index of the grouped program (several weights' matmuls as one job)."""
        return len(self._programs) - 1

    def tile_for(self, t_rows: int) -> int:
        """The index of the tile for a batch of ``t_rows``: the last bucket it reaches (on
        the NVPTX backend: the dp4a GEMV, the dp4a 4-row tile from 4 rows, the warps' mma
        tiles from ``MMA_ROWS``; the CUDA binder launches this one tile over the batch)."""
        return max(i for i, rows in enumerate(self._from) if rows <= max(t_rows, 1))

    def cover(self, t_rows: int) -> list[tuple[int, int, int]]:
        """The tiles a batch of ``t_rows`` runs: (kernel, first row, rows). A partial group
        costs a whole one (its missing rows repeat the last) and a GEMV row about two tile
        rows (``GEMV_ROW_COST``), so of one tile over all rows (the tallest that fits, or a
        taller vector tile: 6 or 7 rows in one tile of 8) and the tallest tile's whole
        groups with the rest on a smaller tile (9 rows: 8 and a GEMV of 1; 11: 8 and a
        tile of 4 over 3), the cheapest: 15 rows stay two tiles of 8. Fewer than the
        smallest tile's rows are the GEMV's (memory-bound: more rows cost it little). Every
        row's products are the same whichever tile computes them. Worked out once per
        ``t_rows`` (an encoder's every step has a new one, asked of each matmul twice)."""
        cover = self._covers.get(t_rows)
        if cover is None:
            cover = self._covers[t_rows] = self._cover(t_rows)
        return cover

    def _cover(self, t_rows: int) -> list[tuple[int, int, int]]:
        which = self.tile_for(t_rows)
        mr = self._mrs[which]
        if mr == 1 or self._warps[which]:  # (a warp's tiles clamp their last rows)
            return [(which, 0, t_rows)]

        def rows(i: int, n: int) -> int:  # what tile i computes for n rows
            return -(-n // self._mrs[i]) * self._mrs[i]

        def cost(i: int, n: int) -> float:
            return rows(i, n) * (GEMV_ROW_COST if self._mrs[i] == 1 else 1)

        rest = t_rows % mr
        whole = t_rows - rest
        if self._amx[which]:  # (an AMX row's cost beside a vector tile's is not measured
            # here: the rest goes to its own bucket's tile where that computes fewer rows)
            other = self.tile_for(rest)
            if rest and rows(other, rest) < mr:
                return [(which, 0, whole), (other, whole, rest)]
            return [(which, 0, t_rows)]

        # the cheapest; of equals, the one with taller tiles (they reuse more), then fewer
        # rows computed, then fewer kernels. One tile over all rows: the bucket's, a
        # smaller or a taller vector tile -- but a bucket from more rows than its tile's
        # (a wide tile) keeps them (its rows cost less than the others', which ``cost``
        # does not know), and serves no smaller batch.
        def single(i: int) -> bool:
            if self._from[which] > mr:
                return i == which
            vector = not self._amx[i] and not self._warps[i]
            return i <= which or vector and self._from[i] == self._mrs[i]

        singles = [
            ((cost(i, t_rows), -self._mrs[i], rows(i, t_rows), 1, 0), [(i, 0, t_rows)])
            for i in range(1, len(self._mrs))
            if single(i)
        ]
        splits = [
            (
                (whole + cost(i, rest), -mr, whole + rows(i, rest), 2, -self._mrs[i]),
                [(which, 0, whole), (i, whole, rest)],
            )
            for i in range(which if rest else 0)
        ]
        return min(singles + splits)[1]

    def pending(self, which: int) -> list[Request]:
        """Kernel ``which`` as a request to ``backends.lower_all`` if not lowered yet."""
        program, spec = self._programs[which]
        done = self._done[which] or self.backend.lowered(program, spec)
        return [] if done else [(self.backend, program, spec)]

    def _lowered(self, which: int) -> Executable:
        done = self._done[which]
        if done is None:
            done = self._done[which] = self.backend.lower(*self._programs[which])
        return done

    def address(self, which: int) -> int:
        """The native entry point of kernel ``which`` (a tile, ``quantize`` or ``pair``)."""
        return self._lowered(which).addresses[""]

    def call(self, which: int) -> Callable[[int, int, int], None]:
        """Kernel ``which`` through ctypes, for one thread: ``call(args, lo, hi)``."""
        fn = self._calls[which]
        if fn is None and which < len(self._warps) and self._warps[which]:
            raise ValueError(
                f"{self.backend.name} tile {which} is warp-cooperative: it runs on a GPU "
                "grid (nvptx entry kernels), not as a CPU call"
            )
        if fn is None:
            fn = self._calls[which] = self._lowered(which).cfunc("", *_SIG)
        return fn

    @property
    def compile_seconds(self) -> float:
        return sum(d.compile_seconds for d in self._done if d is not None)
