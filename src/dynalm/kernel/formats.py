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

Legacy formats split their blocks' fields (Q8_0's bytes biased by 128); K-quants are
decoded in numpy and re-encoded per 32-block: Q4_K/Q5_K as Q4_1/Q5_1 lanes with fp32 ``d =
d*scale`` and ``m = -dmin*min`` planes, Q6_K and Q3_K as biased bytes with one fp32 scale per
16 weights (``Unpack.halves``), Q2_K as bytes with an fp32 scale and min per 16 weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as _T

from dynalm.kernel.gguf_blocks import bit_fields, f16_field, k_scales_mins
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


def byte_chunks(k: Kernel, p: Planes, lanes: int) -> list[ir.Value]:
    return [k.load(vec(I8, 4 * lanes), p["qs"], 4 * lanes * j) for j in range(8)]


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
    # Per 32-block: d = d * scale, m = -dmin * min (both exact in fp32), nibbles as Q4_1.
    scales, mins = k_scales_mins(blocks[:, 4:16])
    q = bit_fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 32)
    d = (f16_field(blocks, 0) * scales).reshape(-1, 1)
    m = (-f16_field(blocks, 2) * mins).reshape(-1, 1)
    return {"d": d, "m": m, "qs": _nibble_plane(q)}


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


def _repack_biased_16(q: np.ndarray, d: np.ndarray) -> dict[str, np.ndarray]:
    """Biased quants [n, 256] (``q - offset`` >= 0) and per-16 scales [n, 16] -> bytes
    [n*8, 32] + two f32 per 32."""
    return {"qs": q.astype(np.uint8).reshape(-1, 32), "d": d.reshape(-1, 2)}


def _repack_q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # 6-bit quants as stored: q + 32 (offset -32)
    low = bit_fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, QK_K)
    high = bit_fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    return _repack_biased_16(
        low | (high << 4), f16_field(blocks, 208) * blocks[:, 192:208].view(np.int8)
    )


def _repack_q3_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # q = low - 4 * (hmask bit unset): biased by 4 (offset -4), 0..7
    low = bit_fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    plus4 = bit_fields(blocks[:, 0:32], 1) << 2
    sc = bit_fields(blocks[:, 96:104], 4) | (bit_fields(blocks[:, 104:108], 2) << 4)
    return _repack_biased_16(low | plus4, f16_field(blocks, 108) * (sc.astype(np.float32) - 32))


@dataclass(frozen=True)
class Unpack:
    """How kernels read one 32-weight block of the repacked planes: ``w = d * (q + offset)
    + m``.

    ``planes`` are (name, bytes per 32-block) and ``repack`` turns GGUF blocks into them
    (uint8 [n, type_size] -> arrays of [n * blocks per GGUF block, bytes]). ``kind`` is the
    lane type ``lanes`` returns: "u8" (``<32 x i8>``, unsigned) or "float" (``<32 x
    float>``, no ``d``/``m``). ``scale`` is the type of ``d``/``m`` ("half" / "float"); a
    ``d`` plane of two scales per block holds one per 16 weights (K-quants with 16-weight
    sub-blocks).
    ``chunks`` decodes a row group's block for the ``auto`` kernels (see ``nibble_chunks``)
    and ``bound`` is the largest ``q`` it yields (whether a backend's unsigned byte dot is
    exact for it, how many int16 products may be summed).
    """

    name: str
    type_size: int  # bytes of one GGUF block
    block_size: int  # weights of one GGUF block
    planes: tuple[tuple[str, int], ...]
    repack: Callable[[np.ndarray], dict[str, np.ndarray]]
    lanes: Callable[[Kernel, Planes], ir.Value]
    kind: str
    offset: int = 0
    scale: str = "half"
    chunks: Callable[[Kernel, Planes, int], list[ir.Value]] | None = None
    bound: int = 0

    @property
    def scale_type(self) -> ir.Type:
        return F16 if self.scale == "half" else F32

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale == "half" else 4

    @property
    def has_min(self) -> bool:
        return any(name == "m" for name, _ in self.planes)

    @property
    def has_scale(self) -> bool:
        return self.kind != "float"

    @property
    def has_int8(self) -> bool:
        """Whether an ``auto`` (int8) kernel exists: not for float weights, nor for mins
        per 16 weights (the activation sums it would need are per 32-block)."""
        return self.chunks is not None and not (self.has_min and self.halves > 1)

    @property
    def halves(self) -> int:
        """Scales per 32-block (1, or 2 for per-16 sub-block scales)."""
        return self.size("d") // self.scale_bytes if self.has_scale else 0

    def size(self, field: str) -> int:
        return dict(self.planes)[field]

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.planes)

    @property
    def fields(self) -> list[tuple[str, int, int]]:
        """(name, bytes per block, offset of the field in a block's record)."""
        at = np.cumsum([0] + [size for _, size in self.planes])
        return [(f, size, int(at[i])) for i, (f, size) in enumerate(self.planes)]

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one GGUF row of ``n_cols`` weights."""
        return n_cols // self.block_size * self.type_size


def _row(ggml_type: _T, planes: tuple[tuple[str, int], ...], repack, *rest, **kw) -> Unpack:  # noqa: ANN001
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    repack = repack or _split(planes)
    return Unpack(ggml_type.name, type_size, block_size, planes, repack, *rest, **kw)


_K_PLANES = (("d", 4), ("m", 4), ("qs", 16))
_Q41 = (("d", 2), ("m", 2), ("qs", 16))
_Q50 = (("d", 2), ("qh", 4), ("qs", 16))
_Q51 = (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))
_5BIT = (nibbles_and_fifth_bit, "u8")

UNPACKS: dict[int, Unpack] = {
    _T.F32: _row(_T.F32, (("qs", 128),), None, floats, "float"),
    _T.F16: _row(_T.F16, (("qs", 64),), None, halves, "float"),
    _T.BF16: _row(_T.BF16, (("qs", 64),), None, bfloats, "float"),
    _T.Q4_0: _row(
        _T.Q4_0, (("d", 2), ("qs", 16)), None, nibbles, "u8", -8, "half", nibble_chunks, 15
    ),
    _T.Q4_1: _row(_T.Q4_1, _Q41, None, nibbles, "u8", 0, "half", nibble_chunks, 15),
    _T.Q5_0: _row(_T.Q5_0, _Q50, None, *_5BIT, -16, "half", fifth_bit_chunks, 31),
    _T.Q5_1: _row(_T.Q5_1, _Q51, None, *_5BIT, 0, "half", fifth_bit_chunks, 31),
    _T.Q8_0: _row(
        _T.Q8_0,
        (("d", 2), ("qs", 32)),
        _repack_q8_0,
        byte_lanes,
        "u8",
        -128,
        "half",
        byte_chunks,
        255,
    ),
    _T.Q2_K: _row(
        _T.Q2_K, (("d", 8), ("m", 8), ("qs", 32)), _repack_q2_k, byte_lanes, "u8", scale="float"
    ),
    _T.Q3_K: _row(
        _T.Q3_K, (("d", 8), ("qs", 32)), _repack_q3_k, byte_lanes, "u8", -4, "float", byte_chunks, 7
    ),
    _T.Q4_K: _row(_T.Q4_K, _K_PLANES, _repack_q4_k, nibbles, "u8", 0, "float", nibble_chunks, 15),
    _T.Q5_K: _row(
        _T.Q5_K, (*_K_PLANES, ("qh", 4)), _repack_q5_k, *_5BIT, 0, "float", fifth_bit_chunks, 31
    ),
    _T.Q6_K: _row(
        _T.Q6_K,
        (("d", 8), ("qs", 32)),
        _repack_q6_k,
        byte_lanes,
        "u8",
        -32,
        "float",
        byte_chunks,
        63,
    ),
}
