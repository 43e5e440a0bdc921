"""Per-format unpack patterns, keyed by GGUF type id: what the matmul programs know of a
quant format.

A weight is repacked once into *planes* (quants apart from scales; ``repack``), and a
format contributes the in-register decoders of one 32-weight block (``lanes``: 32 integer
or float lanes, for ``exact``) or of a row group's blocks side by side (``chunks``,
for the int8 ``auto`` kernels), plus how to read ``d`` and ``m`` so that
``w = d * (q + offset) + m``. Quants are stored unsigned: signed formats (Q8_0, Q6_K, Q3_K)
keep ``q + bias`` and say ``offset = -bias``, so every ``auto`` kernel multiplies unsigned
weight bytes by signed activation bytes (``vpdpbusd``'s operands) and adds ``offset`` times
the activations' sum once per block, in integers. Adding a format is one new
:class:`Unpack` row, not a new kernel.

Legacy formats split their blocks' fields (Q8_0's bytes biased by 128). K-quants are
decoded in numpy and re-encoded per 32-block, keeping their bits per weight: Q4_K/Q5_K as
Q4_1/Q5_1 quants with the 6-bit scale and min of each 32-block as bytes and the super-block's
f16 ``d`` and ``dmin`` once per 256 weights (``Unpack.side``), so the kernels form ``d =
d * scale`` and ``m = -dmin * min`` in fp32, exactly; Q6_K as 4-bit and 2-bit planes of ``q +
32`` with its int8 scale per 16 weights (``Unpack.halves``) and f16 ``d`` per 256 (6.56 bits
per weight, as in the file). Q3_K (biased bytes, one fp32 scale per 16 weights) and Q2_K
(bytes with an fp32 scale and min per 16 weights) are not packed yet.

IQ4_NL, IQ4_XS and MXFP4 select each weight from a 16-value table by a 4-bit index
(:class:`Table`): the indices stay nibbles in Q4_0's layout and the decoders look them up
in registers (``Target.lookup16``, a byte shuffle where the target has one), so they too
keep their bits per weight: IQ4_NL 4.5, IQ4_XS 4.25 (its 6-bit scale per 32 as an s8
factor of the f16 ``d`` per super-block), MXFP4 4.25 (its e8m0 exponent byte read as
``2**(e - 128)``, ``Scale`` type "e8m0").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as _T

from dynalm.kernel.gguf_blocks import (
    IQ4NL_VALUES,
    MXFP4_VALUES,
    bit_fields,
    f16_field,
    iq4_xs_scales,
    k_scales_mins,
)
from dynalm.kernel.lang import F16, F32, I8, I16, I32, Kernel, const, vec

QK = 32  # elements per kernel block (also the activation quantisation block)
QK_K = 256  # elements per K-quant super-block

Planes = dict[str, ir.Value]  # field name -> pointer to the block's bytes of that field

# --- exact: one block of one row -> 32 lanes --------------------------------------------


def nibbles(k: Kernel, p: Planes) -> ir.Value:
    """16 bytes -> 32 lanes: low nibbles are elements 0-15, high nibbles 16-31."""
    # One 128-bit broadcast load, a per-dword shift of the upper half, one mask: two ALU
    # uops (vpsrlvd, vpand) instead of shift + insert + mask on separate halves.
    b = k.load(vec(I8, 16), p["qs"])
    words = k.bitcast(k.shuffle(b, list(range(16)) * 2), vec(I32, 8))
    words = k.b.lshr(words, const(vec(I32, 8), [0] * 4 + [4] * 4))
    return k.and_(k.bitcast(words, vec(I8, 32)), 15)


def _fifth_bits(k: Kernel, mask: ir.Value, n: int) -> ir.Value:
    """16 in lane i (of ``n``) where bit i of the little-endian ``mask`` bytes is set."""
    spread = k.shuffle(mask, [i // 8 for i in range(n)])
    bit = k.b.and_(spread, const(vec(I8, n), [1 << (i % 8) for i in range(n)]))
    on = k.b.icmp_unsigned("!=", bit, ir.Constant(bit.type, None))
    return k.b.select(on, const(vec(I8, n), 16), ir.Constant(vec(I8, n), None))


def nibbles_and_fifth_bit(k: Kernel, p: Planes) -> ir.Value:
    """Q5: nibbles plus bit i of the little-endian u32 ``qh`` as 16 in lane i."""
    return k.b.or_(nibbles(k, p), _fifth_bits(k, k.load(vec(I8, 4), p["qh"]), 32))


def _two_bit_lanes(k: Kernel, p: Planes) -> ir.Value:
    """8 bytes of ``q2`` -> 32 lanes: element e is the 2 bits at bit 2 * (e // 8) of byte
    e % 8 (one shuffle, a per-dword shift and a mask, as ``nibbles``)."""
    b = k.load(vec(I8, 8), p["q2"])
    words = k.bitcast(k.shuffle(b, [e % 8 for e in range(32)]), vec(I32, 8))
    words = k.b.lshr(words, const(vec(I32, 8), [2 * (w // 2) for w in range(8)]))
    return k.and_(k.bitcast(words, vec(I8, 32)), 3)


def six_bits(k: Kernel, p: Planes) -> ir.Value:
    """Q6_K: the low nibbles of ``qs`` and the 2-bit highs of ``q2``: 0..63."""
    return k.b.or_(nibbles(k, p), k.shl(_two_bit_lanes(k, p), 4))


def byte_lanes(k: Kernel, p: Planes) -> ir.Value:
    return k.load(vec(I8, 32), p["qs"])


def halves(k: Kernel, p: Planes) -> ir.Value:
    return k.convert(k.load(vec(F16, 32), p["qs"]), F32)


def floats(k: Kernel, p: Planes) -> ir.Value:
    return k.load(vec(F32, 32), p["qs"])


def bfloats(k: Kernel, p: Planes) -> ir.Value:
    """bf16 is the top half of an fp32: widen and shift into place."""
    wide = k.convert(k.load(vec(I16, 32), p["qs"]), I32, signed=False)
    return k.bitcast(k.shl(wide, 16), vec(F32, 32))


# --- auto: one block of ``lanes`` rows -> 8 chunks ----------------------------------------
# The ``auto`` kernels read ``L`` weight rows at once (one per fp32 lane) as *chunks*:
# chunk j of a block holds elements 4j..4j+3 of each of the L rows (byte 4r + c: row r,
# element 4j + c), so an int dot against an activation's 4 elements broadcast to every
# lane leaves one row per i32 lane (``kernel.layouts.lane_order`` writes this layout).


def nibble_chunks(k: Kernel, p: Planes, lanes: int) -> list[ir.Value]:
    """4 words of ``4 * lanes`` bytes -> 8 chunks: word w's low nibbles are chunk w, its
    high ones w + 4 (a GGUF nibble byte k holds elements k and k + 16)."""
    width = 4 * lanes
    out: list[ir.Value] = [None] * 8  # type: ignore[list-item]
    for w in range(4):
        word = k.load(vec(I8, width), p["qs"], width * w)
        out[w] = k.and_(word, 15)
        high = k.lshr(k.bitcast(word, vec(I16, width // 2)), 4)
        out[w + 4] = k.and_(k.bitcast(high, vec(I8, width)), 15)
    return out


def fifth_bit_chunks(k: Kernel, p: Planes, lanes: int) -> list[ir.Value]:
    """Q5: nibble chunks plus 16 where bit 4r + c of chunk j's ``lanes / 2`` bytes of
    ``qh`` is set."""
    per = lanes // 2
    return [
        k.b.or_(q, _fifth_bits(k, k.load(vec(I8, per), p["qh"], per * j), 4 * lanes))
        for j, q in enumerate(nibble_chunks(k, p, lanes))
    ]


def six_bit_chunks(k: Kernel, p: Planes, lanes: int) -> list[ir.Value]:
    """Q6_K: nibble chunks plus the 2-bit highs: word w (``4 * lanes`` bytes) of ``q2``
    holds chunk 4w + s's at bits 2s of each byte, moved to bits 4-5 by a 16-bit shift
    (what crosses a byte falls outside the mask)."""
    width = 4 * lanes
    low = nibble_chunks(k, p, lanes)
    out = []
    for w in range(2):
        word = k.bitcast(k.load(vec(I8, width), p["q2"], width * w), vec(I16, width // 2))
        for s in range(4):
            moved = k.shl(word, 4 - 2 * s) if s < 2 else word if s == 2 else k.lshr(word, 2)
            high = k.and_(k.bitcast(moved, vec(I8, width)), 0x30)
            out.append(k.b.or_(low[4 * w + s], high))
    return out


def byte_chunks(k: Kernel, p: Planes, lanes: int) -> list[ir.Value]:
    return [k.load(vec(I8, 4 * lanes), p["qs"], 4 * lanes * j) for j in range(8)]


# --- 16-value tables: 4-bit indices decoded by a byte lookup ------------------------------


@dataclass(frozen=True)
class Table:
    """Formats whose 4-bit indices select from 16 integer values (IQ4_NL, IQ4_XS, MXFP4):
    the indices stay nibbles in the planes (``nibbles`` layout), and the decoders look
    each one up (``Target.lookup16``: ``pshufb``, ``tbl``, or compares and selects) in the
    table biased to unsigned bytes, ``value + bias`` (``Unpack.offset = -bias``)."""

    values: tuple[int, ...]
    bias: int

    @property
    def biased(self) -> list[int]:
        return [v + self.bias for v in self.values]

    def lanes(self, k: Kernel, p: Planes, signed: bool = False) -> ir.Value:
        """The block's 32 values biased (``signed``: as they are, ``q + offset``)."""
        return k.target.lookup16(k, self._table(signed), nibbles(k, p))

    def chunks(self, k: Kernel, p: Planes, lanes: int, signed: bool = False) -> list[ir.Value]:
        table = self._table(signed)
        return [k.target.lookup16(k, table, c) for c in nibble_chunks(k, p, lanes)]

    def _table(self, signed: bool) -> list[int]:
        return list(self.values) if signed else self.biased

    @property
    def bound(self) -> int:
        return max(self.biased)


# IQ4's int8 grid +128 (1..241, offset -128 as Q8_0's bytes); MXFP4's -12..12 +16 (4..28:
# small enough for every backend's unsigned dot, a power of two for the offset sums).
IQ4NL_TABLE = Table(IQ4NL_VALUES, 128)
MXFP4_TABLE = Table(MXFP4_VALUES, 16)


# --- repacking: GGUF blocks -> planes -------------------------------------------------------


def _split(layout: tuple[tuple[str, int], ...]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """Repack of a format whose GGUF block is already one 32-weight block: one plane per
    field of ``layout`` (name, bytes), in block order."""

    def split(blocks: np.ndarray) -> dict[str, np.ndarray]:
        at = np.cumsum([0] + [size for _, size in layout])
        return {f: blocks[:, at[i] : at[i + 1]] for i, (f, _) in enumerate(layout)}

    return split


def _nibble_plane(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values < 16 -> the ``nibbles`` layout: [n, 16] bytes."""
    return q[:, :16] | (q[:, 16:] << 4)


def _repack_q4_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # Per 32-block its 6-bit scale and min as bytes, per 256 the f16 d and dmin; nibbles
    # as Q4_1.
    scales, mins = k_scales_mins(blocks[:, 4:16])
    q = bit_fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 32)
    return {
        "sc": scales.astype(np.uint8).reshape(-1, 1),
        "mn": mins.astype(np.uint8).reshape(-1, 1),
        "qs": _nibble_plane(q),
        "d": blocks[:, 0:2],
        "dmin": blocks[:, 2:4],
    }


def _repack_q5_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # As Q4_K plus the fifth bits, as Q5_1's little-endian u32 per block.
    planes = _repack_q4_k(np.concatenate([blocks[:, :16], blocks[:, 48:176]], axis=1))
    fifth = bit_fields(blocks[:, 16:48], 1).reshape(-1, 32)
    planes["qh"] = np.packbits(fifth, axis=1, bitorder="little")
    return planes


def _repack_q2_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # 2-bit quants as bytes; per 16 weights d = d*scale and m = -dmin*min (two per block).
    sc = blocks[:, 0:16]
    q = bit_fields(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 32)
    d, m = f16_field(blocks, 80) * (sc & 0x0F), -f16_field(blocks, 82) * (sc >> 4)
    return {"d": d.reshape(-1, 2), "m": m.reshape(-1, 2), "qs": q}


def _repack_q8_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # int8 quants biased by 128 (offset -128): bytes 0..255
    return {"d": blocks[:, :2], "qs": blocks[:, 2:] ^ np.uint8(0x80)}


def _two_bit_plane(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values < 4 -> the ``_two_bit_lanes`` layout: [n, 8] bytes, element e
    at bits 2 * (e // 8) of byte e % 8."""
    fields = q.reshape(-1, 4, 8).astype(np.uint8)
    return fields[:, 0] | (fields[:, 1] << 2) | (fields[:, 2] << 4) | (fields[:, 3] << 6)


def _repack_q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # 6-bit quants as stored (q + 32, offset -32): low nibbles as Q4 and the 2-bit highs;
    # the int8 scale per 16 weights, the f16 d per 256.
    low = bit_fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, 32)
    high = bit_fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 32)
    return {
        "sc": blocks[:, 192:208].reshape(-1, 2),
        "qs": _nibble_plane(low),
        "q2": _two_bit_plane(high),
        "d": blocks[:, 208:210],
    }


def _repack_q3_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # q = low - 4 * (hmask bit unset): biased by 4 (offset -4), 0..7
    low = bit_fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    plus4 = bit_fields(blocks[:, 0:32], 1) << 2
    sc = bit_fields(blocks[:, 96:104], 4) | (bit_fields(blocks[:, 104:108], 2) << 4)
    d = f16_field(blocks, 108) * (sc.astype(np.float32) - 32)
    return {"qs": (low | plus4).astype(np.uint8).reshape(-1, 32), "d": d.reshape(-1, 2)}


def _repack_iq4_xs(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # Per 32-block its scale - 32 as an s8 (a factor of the super-block's f16 d, as Q6_K's
    # per 16); the indices as IQ4_NL's.
    scales = iq4_xs_scales(blocks).astype(np.int8) - np.int8(32)
    return {
        "sc": scales.view(np.uint8).reshape(-1, 1),
        "qs": blocks[:, 8:136].reshape(-1, 16),
        "d": blocks[:, 0:2],
    }


SUPER = QK_K // QK  # 32-blocks per K-quant super-block: ``Unpack.side`` comes once per SUPER

_SCALE_TYPES = {
    "half": (F16, 2),
    "float": (F32, 4),
    "u8": (I8, 1),
    "s8": (I8, 1),
    "e8m0": (I8, 1),
}


@dataclass(frozen=True)
class Scale:
    """Where a block's ``d`` (or ``m``) comes from: the ``plane`` field holds one value of
    ``type`` per block (two for 16-weight sub-blocks): an fp16/fp32 scale, or (K-quants)
    an integer factor ("u8" / "s8") of the ``side`` field, an fp16 value per super-block,
    or (MXFP4) an e8m0 exponent byte ``e`` read as ``2**(e - 128)``;
    ``negate``: the product's negative (a min subtracted). An fp16 times an integer of at
    most 8 bits is exact in fp32, so kernels form the file's scales exactly."""

    plane: str
    type: str = "half"
    side: str = ""
    negate: bool = False

    @property
    def ir_type(self) -> ir.Type:
        return _SCALE_TYPES[self.type][0]

    @property
    def bytes(self) -> int:
        return _SCALE_TYPES[self.type][1]

    def values(self, k: Kernel, at: ir.Value, count: int, side: ir.Value | None) -> ir.Value:
        """``count`` values from ``at`` as ``<count x float>``, times ``side`` (the side
        field's fp32 value(s), a vector of ``count`` lanes) where the scale has one."""
        raw = k.load(vec(self.ir_type, count), at)
        if self.type == "e8m0":
            return _e8m0_half(k, raw)
        v = k.convert(raw, F32, signed=self.type == "s8")
        if not self.side:
            return v
        return k.b.fmul(v, k.b.fneg(side) if self.negate else side)


def _e8m0_half(k: Kernel, e: ir.Value) -> ir.Value:
    """e8m0 exponent bytes as fp32 ``2**(e - 128)`` (``gguf_blocks.e8m0_half``): the bits
    ``(e - 1) << 23``, and for ``e`` < 2 the denormals ``0x200000 << e``; exact."""
    e = k.convert(e, I32, signed=False)
    small = k.b.shl(const(e.type, 0x00200000), k.and_(e, 1))
    bits = k.select(k.lt(e, 2), small, k.shl(k.sub(e, 1), 23))
    return k.bitcast(bits, vec(F32, e.type.count))


@dataclass(frozen=True)
class Unpack:
    """How kernels read one 32-weight block of the repacked planes: ``w = d * (q + offset)
    + m``.

    ``planes`` are (name, bytes per 32-block), ``side`` (name, bytes per super-block of
    ``SUPER`` blocks: K-quants' f16 factors), and ``repack`` turns GGUF blocks into them
    (uint8 [n, type_size] -> arrays of [n * blocks per GGUF block, bytes], side fields [n,
    bytes]). ``kind`` is the lane type ``lanes`` returns: "u8" (``<32 x i8>``, unsigned)
    or "float" (``<32 x float>``, no ``d``/``m``). ``d`` and ``m`` say where the scales
    come from (:class:`Scale`); two ``d`` values per block are one per 16 weights.
    ``chunks`` decodes a row group's block for the ``auto`` kernels (see ``nibble_chunks``)
    and ``bound`` is the largest ``q`` it yields (whether a backend's unsigned byte dot is
    exact for it, how many int16 products may be summed). A ``table`` format's decoders
    also give the values signed (``q + offset``: no offset to add, no bias to flip).
    """

    name: str
    type_size: int  # bytes of one GGUF block
    block_size: int  # weights of one GGUF block
    planes: tuple[tuple[str, int], ...]
    repack: Callable[[np.ndarray], dict[str, np.ndarray]]
    lanes: Callable[[Kernel, Planes], ir.Value]
    kind: str
    offset: int = 0
    d: Scale | None = None
    m: Scale | None = None
    side: tuple[tuple[str, int], ...] = ()
    chunks: Callable[[Kernel, Planes, int], list[ir.Value]] | None = None
    bound: int = 0
    table: Table | None = None  # the 16 values its nibbles select (``lanes``, ``chunks``)

    @property
    def has_min(self) -> bool:
        return self.m is not None

    @property
    def has_scale(self) -> bool:
        return self.d is not None

    @property
    def has_int8(self) -> bool:
        """Whether an ``auto`` (int8) kernel exists: not for float weights, nor for mins
        per 16 weights (the activation sums it would need are per 32-block)."""
        return self.chunks is not None and not (self.has_min and self.halves > 1)

    @property
    def halves(self) -> int:
        """Scales per 32-block (1, or 2 for per-16 sub-block scales)."""
        return self.size(self.d.plane) // self.d.bytes if self.d else 0

    def size(self, field: str) -> int:
        return dict(self.planes)[field]

    def unit(self, field: str) -> int:
        """Bytes of one value of a scale plane or side field (the lane layout keeps each
        row's values whole)."""
        rule = next((r for r in (self.d, self.m) if r and r.plane == field), None)
        return rule.bytes if rule else 2  # side fields are fp16

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.planes)

    @property
    def side_bytes(self) -> int:
        return sum(size for _, size in self.side)

    @property
    def fields(self) -> list[tuple[str, int, int]]:
        """(name, bytes per block, offset of the field in a block's record)."""
        return _offsets(self.planes)

    @property
    def side_fields(self) -> list[tuple[str, int, int]]:
        """(name, bytes per super-block, offset in a super-block's side record)."""
        return _offsets(self.side)

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one GGUF row of ``n_cols`` weights."""
        return n_cols // self.block_size * self.type_size

    def packed_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` weights as the kernels hold it (its blocks'
        records, then its super-blocks' side records)."""
        nb = n_cols // QK
        return nb * self.block_bytes + nb // SUPER * self.side_bytes


def _offsets(fields: tuple[tuple[str, int], ...]) -> list[tuple[str, int, int]]:
    at = np.cumsum([0] + [size for _, size in fields])
    return [(f, size, int(at[i])) for i, (f, size) in enumerate(fields)]


def _row(ggml_type: _T, planes: tuple[tuple[str, int], ...], repack, *rest, **kw) -> Unpack:  # noqa: ANN001
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    repack = repack or _split(planes)
    return Unpack(ggml_type.name, type_size, block_size, planes, repack, *rest, **kw)


_HALF_D, _HALF_M = Scale("d"), Scale("m")
_Q41 = (("d", 2), ("m", 2), ("qs", 16))
_Q50 = (("d", 2), ("qh", 4), ("qs", 16))
_Q51 = (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))
_5BIT = (nibbles_and_fifth_bit, "u8")
# K-quants with a 6-bit scale and min per 32-block (Q4_K, Q5_K)
_K_SCALES = {
    "d": Scale("sc", "u8", side="d"),
    "m": Scale("mn", "u8", side="dmin", negate=True),
    "side": (("d", 2), ("dmin", 2)),
}

UNPACKS: dict[int, Unpack] = {
    _T.F32: _row(_T.F32, (("qs", 128),), None, floats, "float"),
    _T.F16: _row(_T.F16, (("qs", 64),), None, halves, "float"),
    _T.BF16: _row(_T.BF16, (("qs", 64),), None, bfloats, "float"),
    _T.Q4_0: _row(
        _T.Q4_0, (("d", 2), ("qs", 16)), None, nibbles, "u8", -8, _HALF_D,
        chunks=nibble_chunks, bound=15,
    ),
    _T.Q4_1: _row(
        _T.Q4_1, _Q41, None, nibbles, "u8", 0, _HALF_D, _HALF_M, chunks=nibble_chunks, bound=15
    ),
    _T.Q5_0: _row(_T.Q5_0, _Q50, None, *_5BIT, -16, _HALF_D, chunks=fifth_bit_chunks, bound=31),
    _T.Q5_1: _row(
        _T.Q5_1, _Q51, None, *_5BIT, 0, _HALF_D, _HALF_M, chunks=fifth_bit_chunks, bound=31
    ),
    _T.Q8_0: _row(
        _T.Q8_0, (("d", 2), ("qs", 32)), _repack_q8_0, byte_lanes, "u8", -128, _HALF_D,
        chunks=byte_chunks, bound=255,
    ),
    _T.Q2_K: _row(
        _T.Q2_K, (("d", 8), ("m", 8), ("qs", 32)), _repack_q2_k, byte_lanes, "u8", 0,
        Scale("d", "float"), Scale("m", "float"),
    ),
    _T.Q3_K: _row(
        _T.Q3_K, (("d", 8), ("qs", 32)), _repack_q3_k, byte_lanes, "u8", -4,
        Scale("d", "float"), chunks=byte_chunks, bound=7,
    ),
    _T.Q4_K: _row(
        _T.Q4_K, (("sc", 1), ("mn", 1), ("qs", 16)), _repack_q4_k, nibbles, "u8",
        **_K_SCALES, chunks=nibble_chunks, bound=15,
    ),
    _T.Q5_K: _row(
        _T.Q5_K, (("sc", 1), ("mn", 1), ("qh", 4), ("qs", 16)), _repack_q5_k, *_5BIT,
        **_K_SCALES, chunks=fifth_bit_chunks, bound=31,
    ),
    _T.Q6_K: _row(
        _T.Q6_K, (("sc", 2), ("qs", 16), ("q2", 8)), _repack_q6_k, six_bits, "u8", -32,
        Scale("sc", "s8", side="d"), side=(("d", 2),), chunks=six_bit_chunks, bound=63,
    ),
    _T.IQ4_NL: _row(
        _T.IQ4_NL, (("d", 2), ("qs", 16)), None, IQ4NL_TABLE.lanes, "u8", -128, _HALF_D,
        chunks=IQ4NL_TABLE.chunks, bound=IQ4NL_TABLE.bound, table=IQ4NL_TABLE,
    ),
    _T.IQ4_XS: _row(
        _T.IQ4_XS, (("sc", 1), ("qs", 16)), _repack_iq4_xs, IQ4NL_TABLE.lanes, "u8", -128,
        Scale("sc", "s8", side="d"), side=(("d", 2),), chunks=IQ4NL_TABLE.chunks,
        bound=IQ4NL_TABLE.bound, table=IQ4NL_TABLE,
    ),
    _T.MXFP4: _row(
        _T.MXFP4, (("d", 1), ("qs", 16)), None, MXFP4_TABLE.lanes, "u8", -16,
        Scale("d", "e8m0"), chunks=MXFP4_TABLE.chunks, bound=MXFP4_TABLE.bound, table=MXFP4_TABLE,
    ),
}  # fmt: skip
