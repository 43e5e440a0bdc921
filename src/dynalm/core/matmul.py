"""Quantised matmul ``y[T, N] = x[T, K] @ W[N, K]^T`` as JIT-compiled LLVM IR kernels.

Every kernel is generated from one pattern per mode over a per-format *unpack*: the IR
that turns one 32-weight block of a repacked row into 32 integer (or float) lanes ``q``
(``exact``), or the blocks of 8 rows into 8 chunks of int8 lanes (``auto``), plus a scale
``d`` and an offset, so that ``w = d * (q + offset) + m``. Adding a format is one new
``_Unpack`` row, not a new kernel.

Two modes:

* ``exact`` -- fp32 activations and fp32 FMAs (the accuracy contract). A block's
  ``(q + offset) * x`` is summed first and ``d`` applied once, and a min per block as
  ``m * sum(x)`` (``d`` and ``m`` factor out; fewer multiplies); only Q2_K's per-16 mins
  dequantise each weight in registers.
  A register tile of ``MR`` activation rows x ``NR`` weight rows, ``_ROWS`` weight rows
  interleaved in memory so a tile reads one contiguous stream (``_interleave``).
* ``auto`` -- activations are quantised per 32-block to int8 (two scales ``dx`` per block
  and ``dx * sum(q)``, like ggml's Q8_1) and dot products are integer (AVX2
  ``vpmaddubsw`` + ``vpmaddwd``, or portable IR). One fp32 lane per weight row
  (``_lane_kernel``): ``_LANES`` rows are stored as *chunks* (4 elements of each row side
  by side, ``_lane_order``), so one ``vpmaddubsw`` against 4 broadcast activation bytes
  serves 8 rows; a block's products are summed in int16 and converted and scaled once per
  8 rows. Float weights and Q2_K (a min per 16 weights) use ``exact``.

Weights are repacked once at load into fields (quants apart from scales). Legacy formats
split their blocks' fields; K-quants are decoded in numpy and re-encoded per 32-block:
Q4_K/Q5_K as Q4_1/Q5_1 lanes with fp32 ``d = d*scale`` and ``m = -dmin*min`` planes, Q6_K
and Q3_K as signed bytes with one fp32 scale per 16 weights (``_Unpack.halves``), Q2_K as
bytes with an fp32 scale and min per 16 weights.

One kernel pattern per mode serves every batch size: the activation rows walked in
L1/L2-sized chunks, ``T < MR`` by a GEMV variant (``MR = 1``, weights prefetched). Tiles
over the edge of the matrix repeat its last row instead of needing remainder variants
(less code, faster compiles). Every output sums in the same order whatever the tile, so
rows are bitwise independent of the batch. Threads take chunks of weight rows from the
native pool of ``core.pool``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGMLQuantizationType as _T

from dynalm.core import jit, pool
from dynalm.core.quant import QK_K, _bits, _f16, _k_scales_mins, quant_format

QK = 32  # elements per kernel block (also the activation quantisation block)

# --- a tiny LLVM IR text emitter -------------------------------------------------------


def _vec(n: int, ty: str) -> str:
    return f"<{n} x {ty}>"


def _const(ty: str, values: list[int] | list[float]) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _mask(idx: list[int]) -> str:
    return f"{_vec(len(idx), 'i32')} {_const('i32', idx)}"


def _type_of(arg: str) -> str:
    """The type of a typed operand ``"<8 x float> %v3"`` / ``"i1 false"``."""
    return arg[: arg.index(">") + 1] if arg.startswith("<") else arg.split(" ", 1)[0]


class _Emitter:
    """Builds one function's body; loop state and accumulators live in allocas (mem2reg
    turns them into SSA), which keeps the generator free of phi bookkeeping."""

    def __init__(self) -> None:
        self.allocas: list[str] = []
        self.body: list[str] = []
        self.decls: set[str] = set()
        self._n = 0

    def fresh(self, stem: str = "v") -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def __call__(self, expr: str) -> str:
        name = "%" + self.fresh()
        self.body.append(f"  {name} = {expr}")
        return name

    def do(self, stmt: str) -> None:
        self.body.append(f"  {stmt}")

    def call(self, ret: str, fn: str, *args: str, flags: str = "") -> str:
        self.decls.add(f"declare {ret} @{fn}({', '.join(_type_of(a) for a in args)})")
        text = f"call {flags} {ret} @{fn}({', '.join(args)})"
        if ret == "void":
            self.do(text)
            return ""
        return self(text)

    def var(self, ty: str, init: str) -> str:
        slot = "%" + self.fresh("slot")
        self.allocas.append(f"  {slot} = alloca {ty}")
        self.do(f"store {ty} {init}, ptr {slot}")
        return slot

    def alloca(self, ty: str) -> str:
        """A stack slot of type ``ty`` (allocated once, in the entry block)."""
        slot = "%" + self.fresh("buf")
        self.allocas.append(f"  {slot} = alloca {ty}, align 32")
        return slot

    def get(self, ty: str, slot: str) -> str:
        return self(f"load {ty}, ptr {slot}")

    def put(self, ty: str, slot: str, value: str) -> None:
        self.do(f"store {ty} {value}, ptr {slot}")

    def at(self, base: str, offset: str) -> str:
        return self(f"getelementptr i8, ptr {base}, i64 {offset}")

    def load(self, ty: str, base: str, offset: str = "0", align: int = 1) -> str:
        return self(f"load {ty}, ptr {self.at(base, offset)}, align {align}")

    def splat(self, value: str, n: int, ty: str) -> str:
        v = self(f"insertelement {_vec(1, ty)} poison, {ty} {value}, i32 0")
        return self(f"shufflevector {_vec(1, ty)} {v}, {_vec(1, ty)} poison, {_mask([0] * n)}")

    def lane(self, value: str, n: int, lane: int, width: int) -> str:
        """Lane ``lane`` of an ``n``-lane float vector, broadcast to ``width`` lanes."""
        return self(
            f"shufflevector {_vec(n, 'float')} {value}, {_vec(n, 'float')} poison, "
            f"{_mask([lane] * width)}"
        )

    def part(self, value: str, n: int, ty: str, lo: int, count: int) -> str:
        """Lanes ``lo .. lo+count`` of an ``n``-lane vector."""
        return self(
            f"shufflevector {_vec(n, ty)} {value}, {_vec(n, ty)} poison, "
            f"{_mask(list(range(lo, lo + count)))}"
        )

    def pick(self, value: str, n: int, ty: str, idx: list[int]) -> str:
        """Lanes ``idx`` of an ``n``-lane vector."""
        return self(f"shufflevector {_vec(n, ty)} {value}, {_vec(n, ty)} poison, {_mask(idx)}")

    def loop(self, slot: str, stop: str, step: int, body: Callable[[str], None]) -> None:
        """``while *slot + step <= stop: body(*slot); *slot += step``."""
        head, blk, end = self.fresh("head"), self.fresh("body"), self.fresh("end")
        self.do(f"br label %{head}")
        self.body.append(f"{head}:")
        i = self.get("i64", slot)
        nxt = self(f"add i64 {i}, {step}")
        ok = self(f"icmp sle i64 {nxt}, {stop}")
        self.do(f"br i1 {ok}, label %{blk}, label %{end}")
        self.body.append(f"{blk}:")
        body(i)
        self.put("i64", slot, nxt)
        self.do(f"br label %{head}")
        self.body.append(f"{end}:")

    def branch(self, cond: str, then: Callable[[], None], otherwise: Callable[[], None]) -> None:
        """``if cond: then() else: otherwise()``."""
        yes, no, end = self.fresh("then"), self.fresh("else"), self.fresh("endif")
        self.do(f"br i1 {cond}, label %{yes}, label %{no}")
        for label, body in ((yes, then), (no, otherwise)):
            self.body.append(f"{label}:")
            body()
            self.do(f"br label %{end}")
        self.body.append(f"{end}:")

    def function(self, name: str, params: str) -> str:
        return "\n".join(
            [
                f"define void @{name}({params}) {{",
                "entry:",
                *self.allocas,
                *self.body,
                "  ret void",
                "}",
            ]
        )


# --- per-format unpacks ----------------------------------------------------------------


def _nibbles(e: _Emitter, p: dict[str, str]) -> str:
    """16 bytes -> 32 lanes: low nibbles are elements 0-15, high nibbles 16-31."""
    # One 128-bit broadcast load, a per-dword shift of the upper half, one mask: two ALU
    # uops (vpsrlvd, vpand) instead of shift + insert + mask on separate halves.
    b = e.load(_vec(16, "i8"), p["qs"])
    words = e(f"bitcast {_vec(32, 'i8')} {e.pick(b, 16, 'i8', list(range(16)) * 2)} to <8 x i32>")
    words = e(f"lshr {_vec(8, 'i32')} {words}, {_const('i32', [0] * 4 + [4] * 4)}")
    both = e(f"bitcast {_vec(8, 'i32')} {words} to {_vec(32, 'i8')}")
    return e(f"and {_vec(32, 'i8')} {both}, {_const('i8', [15] * 32)}")


def _nibbles_and_fifth_bit(e: _Emitter, p: dict[str, str]) -> str:
    """Q5: nibbles plus bit i of the little-endian u32 ``qh`` as 16 in lane i."""
    q = _nibbles(e, p)
    qh = e.load(_vec(4, "i8"), p["qh"])
    spread = e(
        f"shufflevector {_vec(4, 'i8')} {qh}, {_vec(4, 'i8')} poison, "
        f"{_mask([i // 8 for i in range(32)])}"
    )
    bit = e(f"and {_vec(32, 'i8')} {spread}, {_const('i8', [1 << (i % 8) for i in range(32)])}")
    bit = e(f"icmp ne {_vec(32, 'i8')} {bit}, zeroinitializer")
    v32 = _vec(32, "i8")
    high = e(
        f"select {_vec(32, 'i1')} {bit}, {v32} {_const('i8', [16] * 32)}, {v32} zeroinitializer"
    )
    return e(f"or {_vec(32, 'i8')} {q}, {high}")


def _bytes(e: _Emitter, p: dict[str, str]) -> str:
    return e.load(_vec(32, "i8"), p["qs"])


def _halves(e: _Emitter, p: dict[str, str]) -> str:
    return e(f"fpext {_vec(32, 'half')} {e.load(_vec(32, 'half'), p['qs'])} to {_vec(32, 'float')}")


def _floats(e: _Emitter, p: dict[str, str]) -> str:
    return e.load(_vec(32, "float"), p["qs"])


def _bfloats(e: _Emitter, p: dict[str, str]) -> str:
    """bf16 is the top half of an fp32: widen and shift into place."""
    wide = e(f"zext {_vec(32, 'i16')} {e.load(_vec(32, 'i16'), p['qs'])} to {_vec(32, 'i32')}")
    wide = e(f"shl {_vec(32, 'i32')} {wide}, {_const('i32', [16] * 32)}")
    return e(f"bitcast {_vec(32, 'i32')} {wide} to {_vec(32, 'float')}")


# The ``auto`` kernels read 8 weight rows at once as *chunks*: chunk j of a block holds
# elements 4j..4j+3 of each of the 8 rows (lane 4r + c: row r, element 4j + c), so an int
# dot against an activation's 4 elements broadcast to every lane leaves one row per i32
# lane (see ``_lane_order`` for the byte layout these decoders read).


def _nibble_chunks(e: _Emitter, p: dict[str, str]) -> list[str]:
    """4 x 32 bytes -> 8 chunks: word w's low nibbles are chunk w, its high ones w + 4
    (a GGUF nibble byte k holds elements k and k + 16)."""
    v32, v16 = _vec(32, "i8"), _vec(16, "i16")
    out = [""] * 8
    for w in range(4):
        word = e.load(v32, p["qs"], str(32 * w))
        out[w] = e(f"and {v32} {word}, {_const('i8', [15] * 32)}")
        high = e(f"lshr {v16} {e(f'bitcast {v32} {word} to {v16}')}, {_const('i16', [4] * 16)}")
        out[w + 4] = e(
            f"and {v32} {e(f'bitcast {v16} {high} to {v32}')}, {_const('i8', [15] * 32)}"
        )
    return out


def _fifth_bit_chunks(e: _Emitter, p: dict[str, str]) -> list[str]:
    """Q5: nibble chunks plus 16 where bit 4r + c of chunk j's u32 in ``qh`` is set."""
    v32, v4 = _vec(32, "i8"), _vec(4, "i8")
    out = []
    for j, q in enumerate(_nibble_chunks(e, p)):
        mask = e.load(v4, p["qh"], str(4 * j))
        spread = e(f"shufflevector {v4} {mask}, {v4} poison, {_mask([i // 8 for i in range(32)])}")
        bit = e(f"and {v32} {spread}, {_const('i8', [1 << (i % 8) for i in range(32)])}")
        bit = e(f"icmp ne {v32} {bit}, zeroinitializer")
        high = e(
            f"select {_vec(32, 'i1')} {bit}, {v32} {_const('i8', [16] * 32)}, {v32} zeroinitializer"
        )
        out.append(e(f"or {v32} {q}, {high}"))
    return out


def _byte_chunks(e: _Emitter, p: dict[str, str]) -> list[str]:
    return [e.load(_vec(32, "i8"), p["qs"], str(32 * j)) for j in range(8)]


def _split(layout: tuple[tuple[str, int], ...]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """Repack of a format whose GGUF block is already one 32-weight block: one plane per
    field of ``layout`` (name, bytes), in block order."""

    def split(blocks: np.ndarray) -> dict[str, np.ndarray]:
        at = np.cumsum([0] + [size for _, size in layout])
        return {f: blocks[:, at[i] : at[i + 1]] for i, (f, _) in enumerate(layout)}

    return split


def _nibble_plane(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values < 16 -> the ``_nibbles`` layout: [n, 16] bytes."""
    return q[:, :16] | (q[:, 16:] << 4)


def _repack_q4_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # Per 32-block: d = d * scale, m = -dmin * min (both exact in fp32), nibbles as Q4_1.
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _bits(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 32)
    d = (_f16(blocks, 0) * scales).reshape(-1, 1)
    m = (-_f16(blocks, 2) * mins).reshape(-1, 1)
    return {"d": d, "m": m, "qs": _nibble_plane(q)}


def _repack_q5_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # As Q4_K plus the fifth bits, as Q5_1's little-endian u32 per block.
    planes = _repack_q4_k(np.concatenate([blocks[:, :16], blocks[:, 48:176]], axis=1))
    fifth = _bits(blocks[:, 16:48], 1).reshape(-1, 32)
    planes["qh"] = np.packbits(fifth, axis=1, bitorder="little")
    return planes


def _repack_q2_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # 2-bit quants as bytes; per 16 weights d = d*scale and m = -dmin*min (two per block).
    sc = blocks[:, 0:16]
    q = _bits(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 32)
    d, m = _f16(blocks, 80) * (sc & 0x0F), -_f16(blocks, 82) * (sc >> 4)
    return {"d": d.reshape(-1, 2), "m": m.reshape(-1, 2), "qs": q}


def _repack_signed_16(q: np.ndarray, d: np.ndarray) -> dict[str, np.ndarray]:
    """Signed quants [n, 256] and per-16 scales [n, 16] -> int8 [n*8, 32] + two f32 per 32."""
    return {"qs": q.astype(np.int8).view(np.uint8).reshape(-1, 32), "d": d.reshape(-1, 2)}


def _repack_q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    low = _bits(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, QK_K)
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    q = (low | (high << 4)).astype(np.int16) - 32
    return _repack_signed_16(q, _f16(blocks, 208) * blocks[:, 192:208].view(np.int8))


def _repack_q3_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    low = _bits(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    minus4 = (_bits(blocks[:, 0:32], 1) ^ 1) << 2
    sc = _bits(blocks[:, 96:104], 4) | (_bits(blocks[:, 104:108], 2) << 4)
    q = low.astype(np.int16) - minus4
    return _repack_signed_16(q, _f16(blocks, 108) * (sc.astype(np.float32) - 32))


@dataclass(frozen=True)
class _Unpack:
    """How kernels read one 32-weight block of the repacked planes: ``w = d * (q + offset)
    + m``.

    ``planes`` are (name, bytes per 32-block) and ``repack`` turns GGUF blocks into them
    (uint8 [n, type_size] -> arrays of [n * blocks per GGUF block, bytes]). ``kind`` is the
    lane type ``lanes`` returns: "u8" / "s8" (``<32 x i8>``) or "float" (``<32 x float>``,
    no ``d``/``m``). ``scale`` is the type of ``d``/``m`` ("half" / "float"); a ``d`` plane
    of two scales per block holds one per 16 weights (K-quants with 16-weight sub-blocks).
    ``chunks`` decodes 8 rows' block for the ``auto`` kernels (see ``_nibble_chunks``) and
    ``bound`` is the largest ``|q|`` it yields (how many int16 products may be summed).
    """

    planes: tuple[tuple[str, int], ...]
    repack: Callable[[np.ndarray], dict[str, np.ndarray]]
    lanes: Callable[[_Emitter, dict[str, str]], str]
    kind: str
    offset: int = 0
    scale: str = "half"
    chunks: Callable[[_Emitter, dict[str, str]], list[str]] | None = None
    bound: int = 0

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
        return self.size("d") // (2 if self.scale == "half" else 4) if self.has_scale else 0

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


def _legacy(layout: tuple[tuple[str, int], ...], *rest: object, **kw: object) -> _Unpack:
    return _Unpack(layout, _split(layout), *rest, **kw)


_K_PLANES = (("d", 4), ("m", 4), ("qs", 16))
_UNPACKS: dict[int, _Unpack] = {
    _T.F32: _legacy((("qs", 128),), _floats, "float"),
    _T.F16: _legacy((("qs", 64),), _halves, "float"),
    _T.BF16: _legacy((("qs", 64),), _bfloats, "float"),
    _T.Q4_0: _legacy((("d", 2), ("qs", 16)), _nibbles, "u8", -8, "half", _nibble_chunks, 15),
    _T.Q4_1: _legacy(
        (("d", 2), ("m", 2), ("qs", 16)), _nibbles, "u8", 0, "half", _nibble_chunks, 15
    ),
    _T.Q5_0: _legacy(
        (("d", 2), ("qh", 4), ("qs", 16)),
        _nibbles_and_fifth_bit,
        "u8",
        -16,
        "half",
        _fifth_bit_chunks,
        31,
    ),
    _T.Q5_1: _legacy(
        (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
        _nibbles_and_fifth_bit,
        "u8",
        0,
        "half",
        _fifth_bit_chunks,
        31,
    ),
    _T.Q8_0: _legacy((("d", 2), ("qs", 32)), _bytes, "s8", 0, "half", _byte_chunks, 128),
    _T.Q2_K: _Unpack((("d", 8), ("m", 8), ("qs", 32)), _repack_q2_k, _bytes, "u8", scale="float"),
    _T.Q3_K: _Unpack(
        (("d", 8), ("qs", 32)), _repack_q3_k, _bytes, "s8", 0, "float", _byte_chunks, 4
    ),
    _T.Q4_K: _Unpack(_K_PLANES, _repack_q4_k, _nibbles, "u8", 0, "float", _nibble_chunks, 15),
    _T.Q5_K: _Unpack(
        (*_K_PLANES, ("qh", 4)),
        _repack_q5_k,
        _nibbles_and_fifth_bit,
        "u8",
        0,
        "float",
        _fifth_bit_chunks,
        31,
    ),
    _T.Q6_K: _Unpack(
        (("d", 8), ("qs", 32)), _repack_q6_k, _bytes, "s8", 0, "float", _byte_chunks, 32
    ),
}

# Formats whose ``auto`` (int8) kernels met the model-level budget of
# tests/models/test_auto_mode.py (top-1 agreement with exact >= 98 %, mean KL <= 0.005 on
# the SmolLM2 test prompts); ``CpuDevice`` runs the others' ``exact`` kernels in auto.
# Measured with the lane kernels on SmolLM2 requantised per format (top-1 / KL): the test
# model (Q4_1 layers, Q8_0 head) 98.7 % / 0.0026 (99.4 % / 0.0023 with an exact head);
# llama.cpp's Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0) 98.7 % / 0.0025; all-Q5_0 99.4 % / 0.0030;
# all-Q8_0 100 % / 0.0023. Missed: all-Q5_1 97.5 % / 0.0040; all-Q4_0 96.2 % / 0.0035.
# Q3_K and Q5_K have no model to measure on yet.
AUTO_VALIDATED = frozenset({_T.Q4_1, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q6_K})


# --- the kernel pattern ----------------------------------------------------------------

# Argument block (one i64 array per call site), read by every kernel; the row range
# [lo, hi) comes as arguments, so the pool can hand out chunks of rows.
_A_W, _A_X, _A_XD, _A_XS, _A_Y, _A_T, _A_NB, _A_LDY = range(8)
_N_ARGS = 8
_PARAMS = "ptr noalias nocapture readonly %args, i64 %lo, i64 %hi"
_GROUP = 8  # blocks per main-loop step: their scales are loaded and converted as one vector
_ROWS = 4  # weight rows interleaved in memory (the GEMV tile): one stream per thread


def _interleave(
    u: _Unpack, planes: dict[str, np.ndarray], n_rows: int, nb: int, out: np.ndarray
) -> None:
    """Repacked planes (``[n_rows * nb, size]`` per field, in block order) -> ``out``, uint8
    ``[ceil(n_rows / _ROWS), _ROWS * nb * block_bytes]``, in the order the kernels walk it,
    so a tile reads one contiguous stream.

    Rows are padded with zero blocks to a multiple of ``_ROWS`` and taken ``_ROWS`` at a
    time; each such row group is a run of records, one per step of the kernel's block loop
    (``_GROUP`` blocks while a whole group fits, then single blocks). A record holds each
    field in turn, and a field the ``_ROWS`` rows' blocks one row after the other, so a
    row's scales for the record's blocks are one vector load.
    """
    groups = out.shape[0]
    main = nb - nb % _GROUP
    for lo, hi, g in ((0, main, _GROUP), (main, nb, 1)):
        n_rec = (hi - lo) // g
        if not n_rec:
            continue
        records = out[:, _ROWS * lo * u.block_bytes : _ROWS * hi * u.block_bytes]
        records = records.reshape(groups, n_rec, -1)
        for f, size, at in u.fields:
            src = planes[f].view(np.uint8).reshape(n_rows, nb, size)[:, lo:hi]
            if n_rows % _ROWS:  # pad the last row group with zero blocks
                src = np.concatenate(
                    [src, np.zeros((groups * _ROWS - n_rows, *src.shape[1:]), np.uint8)]
                )
            dst = records[:, :, _ROWS * g * at : _ROWS * g * (at + size)]
            dst = dst.reshape(groups, n_rec, _ROWS, g, size)
            dst[...] = src.reshape(groups, _ROWS, n_rec, g, size).transpose(0, 2, 1, 3, 4)


_LANES = 8  # weight rows an ``auto`` kernel reads at once: one per fp32 lane of a vector


def _lane_order(u: _Unpack, field: str, rows: np.ndarray, dst: np.ndarray) -> None:
    """One field of whole row groups, uint8 ``[groups * _LANES, nb, size]``, into ``dst``
    ``[groups, nb, _LANES * size]`` in the order the ``auto`` kernels read: quants as
    chunks (``qs``: the rows' 4-byte units side by side, unit j of every row, then j + 1;
    ``qh``: chunk j's 4 bits of each row as one u32, bit 4r + c), scales as one vector of
    the rows per sub-block scale. One strided copy (the weights may be large)."""
    groups, nb, width = dst.shape
    size = width // _LANES
    src = rows.reshape(groups, _LANES, nb, size)
    if field == "qh":
        bits = np.unpackbits(src, axis=-1, bitorder="little").reshape(groups, _LANES, nb, 8, 4)
        bits = bits.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8, _LANES * 4)
        dst[...] = np.packbits(bits, axis=-1, bitorder="little").reshape(groups, nb, width)
        return
    unit = 4 if field == "qs" else (2 if u.scale == "half" else 4)
    view = dst.reshape(groups, nb, size // unit, _LANES, unit)
    if not np.may_share_memory(view, dst):  # a copy would leave dst unwritten
        raise ValueError(f"{field}: the lane order needs a view of the destination")
    view[...] = src.reshape(groups, _LANES, nb, size // unit, unit).transpose(0, 2, 3, 1, 4)


def _interleave_lanes(
    u: _Unpack, planes: dict[str, np.ndarray], n_rows: int, nb: int, out: np.ndarray
) -> None:
    """Repacked planes -> ``out``, uint8 ``[ceil(n_rows / _LANES), nb * _LANES *
    block_bytes]``, the ``auto`` kernels' stream: rows taken ``_LANES`` at a time (the last
    group padded with zero rows); per row group one record per block, holding each field of
    the group's rows in ``_lane_order``."""
    groups, full = out.shape[0], n_rows // _LANES
    out = out.reshape(groups, nb, _LANES * u.block_bytes)
    for f, size, at in u.fields:
        src = planes[f].view(np.uint8).reshape(n_rows, nb, size)
        dst = out[:, :, _LANES * at : _LANES * (at + size)]
        if full:
            _lane_order(u, f, src[: full * _LANES], dst[:full])
        if full < groups:
            last = np.zeros((_LANES, nb, size), np.uint8)
            last[: n_rows - full * _LANES] = src[full * _LANES :]
            _lane_order(u, f, last, dst[full:])


@dataclass(frozen=True)
class _Shape:
    mr: int  # activation rows per register tile
    nr: int  # weight rows per register tile
    aw: int  # fp32 lanes per accumulator (exact mode: wider = more independent FMA chains)
    tc: int  # activation rows per cache chunk
    pf: int = 0  # prefetch weights this many bytes of quants ahead (0: none)


def _integers(e: _Emitter, u: _Unpack, q: str) -> str:
    """Integer lanes -> ``q + offset`` as fp32 (exact: small integers)."""
    f32 = _vec(32, "float")
    qf = e(f"{'sitofp' if u.kind == 's8' else 'uitofp'} {_vec(32, 'i8')} {q} to {f32}")
    if u.offset:
        qf = e(f"fadd {f32} {qf}, {e.splat(f'{float(u.offset)!r}', 32, 'float')}")
    return qf


def _integer_floats(e: _Emitter, u: _Unpack, p: dict[str, str]) -> str:
    """A block's ``q + offset`` as ``<32 x float>`` straight from the planes: nibbles and
    bytes widen from memory 8 at a time (``vpmovzxbd`` / ``vpmovsxbd`` loads), which
    costs about half the shuffles of converting the ``<32 x i8>`` of ``u.lanes``."""
    if u.lanes not in (_nibbles, _bytes):
        return _integers(e, u, u.lanes(e, p))
    i8, i32, f8 = _vec(8, "i8"), _vec(8, "i32"), _vec(8, "float")
    ext, to_float = ("sext", "sitofp") if u.kind == "s8" else ("zext", "uitofp")
    if u.lanes is _bytes:
        ints = [e(f"{ext} {i8} {e.load(i8, p['qs'], str(k))} to {i32}") for k in range(0, 32, 8)]
    else:  # byte k holds elements k (low nibble) and k + 16 (high)
        wide = [e(f"zext {i8} {e.load(i8, p['qs'], str(k))} to {i32}") for k in (0, 8)]
        low = [e(f"and {i32} {w}, {_const('i32', [15] * 8)}") for w in wide]
        ints = low + [e(f"lshr {i32} {w}, {_const('i32', [4] * 8)}") for w in wide]
    parts = [e(f"{to_float} {i32} {v} to {f8}") for v in ints]
    if u.offset:
        parts = [e(f"fadd {f8} {v}, {e.splat(f'{float(u.offset)!r}', 8, 'float')}") for v in parts]
    pairs = [
        e(f"shufflevector {f8} {parts[k]}, {f8} {parts[k + 1]}, {_mask(list(range(16)))}")
        for k in (0, 2)
    ]
    f16 = _vec(16, "float")
    return e(f"shufflevector {f16} {pairs[0]}, {f16} {pairs[1]}, {_mask(list(range(32)))}")


def _dequant(e: _Emitter, u: _Unpack, q: str, d: str, m: str) -> str:
    """Integer lanes -> fp32 weights ``d * (q + offset) + m`` (``d``, ``m``: 32 lanes).

    Matches the reference exactly: ``q + offset`` is a small integer and ``d * (q + offset)``
    is exact in fp32, leaving one rounding for ``+ m``."""
    f32 = _vec(32, "float")
    qf = _integers(e, u, q)
    return e.call(f32, "llvm.fmuladd.v32f32", f"{f32} {qf}", f"{f32} {d}", f"{f32} {m}")


def _fma(e: _Emitter, a: str, b: str, acc: str, ty: str) -> str:
    n_lanes = ty[1 : ty.index(" ")]
    return e.call(ty, f"llvm.fmuladd.v{n_lanes}f32", f"{ty} {a}", f"{ty} {b}", f"{ty} {acc}")


def _sum(e: _Emitter, vs: list[str], ty: str) -> str:
    total = vs[0]
    for v in vs[1:]:
        total = e(f"fadd {ty} {total}, {v}")
    return total


def _clamped(e: _Emitter, first: str, count: int, last: str) -> list[str]:
    """Rows ``first .. first+count`` capped at ``last``: a tile over the edge repeats the
    last row (same values stored twice) instead of needing remainder variants."""
    rows = [e(f"add i64 {first}, {k}") for k in range(count)]
    return [rows[0]] + [e.call("i64", "llvm.smin.i64", f"i64 {r}", f"i64 {last}") for r in rows[1:]]


def _walk(e: _Emitter, s: _Shape, t_rows: str, nr: int, tile: Callable[[str, str], None]) -> None:
    """Call ``tile(t, n)`` over activation chunks of ``s.tc`` rows, in each the weight rows
    ``[lo, hi)`` ``nr`` at a time, in each the chunk's rows ``s.mr`` at a time (a final
    partial step is the loop's last)."""

    def rows(t0: str, t_end: str, n: str) -> None:
        t_slot = e.var("i64", t0)
        e.loop(t_slot, e(f"add i64 {t_end}, {s.mr - 1}"), s.mr, lambda t: tile(t, n))

    def chunk(t0: str) -> None:
        t_next = e(f"add i64 {t0}, {s.tc}")
        full = e(f"icmp slt i64 {t_next}, {t_rows}")
        t_end = e(f"select i1 {full}, i64 {t_next}, i64 {t_rows}")
        n_slot = e.var("i64", "%lo")
        e.loop(n_slot, e(f"add i64 %hi, {nr - 1}"), nr, lambda n: rows(t0, t_end, n))

    tc_slot = e.var("i64", "0")
    e.loop(tc_slot, e(f"add i64 {t_rows}, {s.tc - 1}"), s.tc, chunk)


def _prefetch(e: _Emitter, at: str, ahead: int, nbytes: int) -> None:
    """Prefetch the ``nbytes`` at ``at + ahead`` (streamed weights: the hardware prefetcher
    alone keeps too little in flight)."""
    for line in range(0, nbytes, 64):
        e.call(
            "void",
            "llvm.prefetch.p0",
            f"ptr {e.at(at, str(ahead + line))}",
            "i32 0",
            "i32 3",
            "i32 1",
        )


def _kernel(e: _Emitter, name: str, u: _Unpack, s: _Shape) -> str:
    """``exact``: one matmul function over weight rows ``[lo, hi)`` and all T activation
    rows, fp32 activations, weights dequantised in registers."""
    arg = [e.load("i64", "%args", str(8 * i), 8) for i in range(_N_ARGS)]
    ptr = [e(f"inttoptr i64 {a} to ptr") for a in arg]
    t_rows, nb, ldy = arg[_A_T], arg[_A_NB], arg[_A_LDY]
    x_block = QK * 4  # bytes of one activation block
    acc_ty = _vec(s.aw, "float")
    h = u.halves
    n_last, t_last = e("add i64 %hi, -1"), e(f"add i64 {t_rows}, -1")

    def fma(a: str, b: str, acc: str) -> str:
        return _fma(e, a, b, acc, acc_ty)

    def scales(at: str, n: int) -> str:
        """``n`` weight scales at ``at`` as ``<n x float>``."""
        v = e.load(_vec(n, u.scale), at)
        return v if u.scale == "float" else e(f"fpext {_vec(n, 'half')} {v} to {_vec(n, 'float')}")

    def per_lane(v: str, n: int, b: int, width: int) -> str:
        """Block ``b``'s scale(s) of a ``<n x float>`` of ``h`` per block, over ``width``
        lanes (with two per block, the first half of the lanes takes the first)."""
        return e.pick(v, n, "float", [b * h + lane * h // width for lane in range(width)])

    def tile(t: str, n: str) -> None:
        mr, nr = s.mr, s.nr
        accs = [[e.var(acc_ty, "zeroinitializer") for _ in range(nr)] for _ in range(mr)]
        w_rows = _clamped(e, n, nr, n_last)
        x_rows = _clamped(e, t, mr, t_last)
        # Row r lives in row group r // ROWS at slot r % ROWS (see ``_interleave``).
        group_bytes = _ROWS * u.block_bytes
        w_group = [
            e.at(
                ptr[_A_W],
                e(f"mul i64 {e(f'and i64 {r}, {-_ROWS}')}, {e(f'mul i64 {nb}, {u.block_bytes}')}"),
            )
            for r in w_rows
        ]
        w_slot = [e(f"and i64 {r}, {_ROWS - 1}") for r in w_rows]
        x_off = [e(f"mul i64 {e(f'mul i64 {r}, {nb}')}, {x_block}") for r in x_rows]

        def group(kb: str, g: int) -> None:
            """Blocks kb .. kb+g of the tile; scales are loaded and converted g at a time."""
            w_at, dw, mw = [], [], []
            record = e(f"mul i64 {kb}, {group_bytes}")
            for j in range(nr):
                base = e.at(w_group[j], record)
                slot = w_slot[j]
                at = {
                    f: e.at(
                        base, e(f"add i64 {e(f'mul i64 {slot}, {g * size}')}, {_ROWS * g * at_f}")
                    )
                    for f, size, at_f in u.fields
                }
                w_at.append(at)
                if s.pf and j == 0:
                    _prefetch(e, base, s.pf, g * group_bytes)
                if u.has_scale:
                    dw.append(scales(at["d"], g * h))
                    mw.append(scales(at["m"], g * h) if u.has_min else None)
            xk = [e(f"add i64 {o}, {e(f'mul i64 {kb}, {x_block}')}") for o in x_off]
            for b in range(g):
                # Each block unpacked where it is used (unpacking all g up front keeps too
                # many registers live).
                planes = [{f: e.at(p, str(b * u.size(f))) for f, p in at.items()} for at in w_at]
                xs = []
                for i in range(mr):
                    xv = e.load(_vec(32, "float"), ptr[_A_X], e(f"add i64 {xk[i]}, {b * x_block}"))
                    xs.append([e.part(xv, 32, "float", c, s.aw) for c in range(0, 32, s.aw)])
                # A min per block factors out like d: sum(w x) = d sum(q x) + m sum(x), two
                # FMAs per block instead of dequantising every weight (~15 % faster GEMV).
                factored = u.has_min and h == 1
                xsum = [_sum(e, xs[i], acc_ty) for i in range(mr)] if factored else []
                for j in range(nr):
                    if u.has_min and not factored:
                        d, m = (per_lane(v[j], g * h, b, 32) for v in (dw, mw))
                        w = _dequant(e, u, u.lanes(e, planes[j]), d, m)
                    elif u.has_scale:
                        w = _integer_floats(e, u, planes[j])
                    else:
                        w = u.lanes(e, planes[j])
                    w = [e.part(w, 32, "float", c, s.aw) for c in range(0, 32, s.aw)]
                    for i in range(mr):
                        acc = e.get(acc_ty, accs[i][j])
                        if factored:
                            part = e(f"fmul {acc_ty} {w[0]}, {xs[i][0]}")
                            for c in range(1, len(w)):
                                part = fma(w[c], xs[i][c], part)
                            acc = fma(part, e.lane(dw[j], g * h, b, s.aw), acc)
                            acc = fma(xsum[i], e.lane(mw[j], g * h, b, s.aw), acc)
                        elif u.has_min or not u.has_scale:
                            for c, wc in enumerate(w):
                                acc = fma(wc, xs[i][c], acc)
                        else:
                            # Without a min, d factors out of each of the block's h parts:
                            # sum q * x in fp32, then one FMA by d (instead of multiplying
                            # every weight by d).
                            per = len(w) // h
                            for k in range(h):
                                part = e(f"fmul {acc_ty} {w[k * per]}, {xs[i][k * per]}")
                                for c in range(k * per + 1, (k + 1) * per):
                                    part = fma(w[c], xs[i][c], part)
                                acc = fma(part, e.lane(dw[j], g * h, b * h + k, s.aw), acc)
                        e.put(acc_ty, accs[i][j], acc)

        kb_slot = e.var("i64", "0")
        e.loop(kb_slot, nb, _GROUP, lambda kb: group(kb, _GROUP))
        e.loop(kb_slot, nb, 1, lambda kb: group(kb, 1))
        for i in range(mr):
            y_row = e(f"mul i64 {x_rows[i]}, {ldy}")
            for j in range(nr):
                total = e.call(
                    "float",
                    f"llvm.vector.reduce.fadd.v{s.aw}f32",
                    "float 0.0",
                    f"{acc_ty} {e.get(acc_ty, accs[i][j])}",
                    flags="reassoc",
                )
                y_off = e(f"mul i64 {e(f'add i64 {y_row}, {w_rows[j]}')}, 4")
                e.do(f"store float {total}, ptr {e.at(ptr[_A_Y], y_off)}, align 4")

    _walk(e, s, t_rows, s.nr, tile)
    return e.function(name, _PARAMS)


def _pair_products(e: _Emitter, isa: str, q: str, x: str) -> str:
    """Unsigned ``q`` times signed ``x`` (``<32 x i8>``), adjacent products summed:
    ``<16 x i16>`` (no sums here come near int16 saturation, see ``_Unpack.bound``)."""
    v32, v16 = _vec(32, "i8"), _vec(16, "i16")
    if isa == "avx2":
        return e.call(v16, "llvm.x86.avx2.pmadd.ub.sw", f"{v32} {q}", f"{v32} {x}")
    w32 = _vec(32, "i16")
    prod = e(f"mul {w32} {e(f'zext {v32} {q} to {w32}')}, {e(f'sext {v32} {x} to {w32}')}")
    even, odd = (e.pick(prod, 32, "i16", list(range(k, 32, 2))) for k in (0, 1))
    return e(f"add {v16} {even}, {odd}")


def _pair_sums(e: _Emitter, isa: str, v: str) -> str:
    """``<16 x i16>`` -> ``<8 x i32>``, adjacent lanes summed."""
    v16, v8 = _vec(16, "i16"), _vec(8, "i32")
    if isa == "avx2":
        ones = _const("i16", [1] * 16)
        return e.call(v8, "llvm.x86.avx2.pmadd.wd", f"{v16} {v}", f"{v16} {ones}")
    wide = e(f"sext {v16} {v} to {_vec(16, 'i32')}")
    even, odd = (e.pick(wide, 16, "i32", list(range(k, 16, 2))) for k in (0, 1))
    return e(f"add {v8} {even}, {odd}")


def _with_sign_of(e: _Emitter, isa: str, x: str, q: str) -> str:
    """``x`` negated where ``q < 0`` and zeroed where ``q == 0`` (so ``|q| * result == q *
    x``: the signed weights' sign moves onto the activations, as ``vpmaddubsw`` wants)."""
    v32 = _vec(32, "i8")
    if isa == "avx2":
        return e.call(v32, "llvm.x86.avx2.psign.b", f"{v32} {x}", f"{v32} {q}")
    neg = e(f"icmp slt {v32} {q}, zeroinitializer")
    zero = e(f"icmp eq {v32} {q}, zeroinitializer")
    flipped = e(
        f"select {_vec(32, 'i1')} {neg}, {v32} {e(f'sub {v32} zeroinitializer, {x}')}, {v32} {x}"
    )
    return e(f"select {_vec(32, 'i1')} {zero}, {v32} zeroinitializer, {v32} {flipped}")


def _lane_kernel(e: _Emitter, name: str, u: _Unpack, isa: str, s: _Shape) -> str:
    """``auto``: one int8 matmul function over weight rows ``[lo, hi)`` (``lo`` a multiple
    of ``_LANES``) and all T activation rows, one weight row per fp32 lane.

    Per block and activation row: each chunk's int dot against the activation's 4
    matching elements (broadcast) is one ``vpmaddubsw``; a block's products are summed in
    int16 (same row, same scales) per activation scale group and sub-block, widened once
    (``vpmaddwd``), converted once and scaled by the 8 rows' ``d`` in one FMA. The output
    of a tile is 8 consecutive floats of y: no horizontal sums."""
    arg = [e.load("i64", "%args", str(8 * i), 8) for i in range(_N_ARGS)]
    ptr = [e(f"inttoptr i64 {a} to ptr") for a in arg]
    t_rows, nb, ldy = arg[_A_T], arg[_A_NB], arg[_A_LDY]
    f8, i16, i32, v32 = _vec(8, "float"), _vec(16, "i16"), _vec(8, "i32"), _vec(32, "i8")
    h = u.halves
    record = _LANES * u.block_bytes
    field_at = {f: _LANES * at for f, _, at in u.fields}
    run = max(1, 32767 // (2 * u.bound * 127))  # int16 products summed before widening
    t_last = e(f"add i64 {t_rows}, -1")

    def row_scales(at: str, k: int) -> str:
        """The 8 rows' ``k``-th scale of the block as ``<8 x float>``."""
        v = e.load(_vec(_LANES, u.scale), at, str(k * _LANES * (2 if u.scale == "half" else 4)))
        return v if u.scale == "float" else e(f"fpext {_vec(8, 'half')} {v} to {f8}")

    def widened(products: list[str]) -> str:
        """Sum of ``<16 x i16>`` products as ``<8 x i32>``: in int16 ``run`` at a time."""
        total = ""
        for r in range(0, len(products), run):
            part = products[r]
            for p in products[r + 1 : r + run]:
                part = e(f"add {i16} {part}, {p}")
            part = _pair_sums(e, isa, part)
            total = e(f"add {i32} {total}, {part}") if total else part
        return e(f"sitofp {i32} {total} to {f8}")

    def tile(t: str, n: str) -> None:
        x_rows = _clamped(e, t, s.mr, t_last)
        group = e(f"mul i64 {e(f'udiv i64 {n}, {_LANES}')}, {e(f'mul i64 {nb}, {record}')}")
        group = e.at(ptr[_A_W], group)
        first = [e(f"mul i64 {r}, {nb}") for r in x_rows]  # each row's first block
        accs = [e.var(f8, "zeroinitializer") for _ in range(s.mr)]

        def block(b: str) -> None:
            base = e.at(group, e(f"mul i64 {b}, {record}"))
            if s.pf:
                _prefetch(e, base, s.pf, record)
            p = {f: e.at(base, str(at)) for f, at in field_at.items()}
            chunks = u.chunks(e, p)
            mags = (
                [e.call(v32, "llvm.abs.v32i8", f"{v32} {c}", "i1 false") for c in chunks]
                if u.kind == "s8"
                else chunks
            )
            dw = [row_scales(p["d"], k) for k in range(h)]
            m_eff = row_scales(p["m"], 0) if u.has_min else None
            if u.offset:  # w = d * (q + offset) + m: the offset joins the min
                offset = e.splat(f"{float(u.offset)!r}", 8, "float")
                m_eff = _fma(e, offset, dw[0], m_eff or "zeroinitializer", f8)
            for i in range(s.mr):
                blk = e(f"add i64 {first[i]}, {b}")
                xq = e.at(ptr[_A_X], e(f"mul i64 {blk}, {QK}"))
                # Products by (sub-block, activation scale group): chunk j is elements
                # 4j..4j+3, scale group j % 2 (see _X_GROUPS).
                products: dict[tuple[int, int], list[str]] = {}
                for j in range(8):
                    xj = e.splat(e.load("i32", xq, str(4 * j)), 8, "i32")
                    xj = e(f"bitcast {i32} {xj} to {v32}")
                    if u.kind == "s8":
                        xj = _with_sign_of(e, isa, xj, chunks[j])
                    key = (j * h // 8, j % 2)
                    products.setdefault(key, []).append(_pair_products(e, isa, mags[j], xj))
                dx = e.load("<2 x float>", ptr[_A_XD], e(f"mul i64 {blk}, 8"))
                dx = [e.lane(dx, 2, k, 8) for k in range(2)]
                acc = e.get(f8, accs[i])
                for k in range(h):
                    both = e(f"fmul {f8} {widened(products[k, 0])}, {dx[0]}")
                    both = _fma(e, widened(products[k, 1]), dx[1], both, f8)
                    acc = _fma(e, both, dw[k], acc, f8)
                if m_eff:  # the min's part, m * sum(x)
                    xs = e.load("float", ptr[_A_XS], e(f"mul i64 {blk}, 4"))
                    acc = _fma(e, m_eff, e.splat(xs, 8, "float"), acc, f8)
                e.put(f8, accs[i], acc)

        b_slot = e.var("i64", "0")
        e.loop(b_slot, nb, 1, block)
        left = e(f"sub i64 {ldy}, {n}")  # rows of the group that exist
        for i in range(s.mr):
            acc = e.get(f8, accs[i])
            row = e(f"mul i64 {x_rows[i]}, {ldy}")
            y = e.at(ptr[_A_Y], e(f"mul i64 {e(f'add i64 {row}, {n}')}, 4"))

            def one_by_one(k: str, acc: str = acc, y: str = y) -> None:
                value = e(f"extractelement {f8} {acc}, i64 {k}")
                e.do(f"store float {value}, ptr {e.at(y, e(f'mul i64 {k}, 4'))}, align 4")

            e.branch(
                e(f"icmp sge i64 {left}, {_LANES}"),
                lambda acc=acc, y=y: e.do(f"store {f8} {acc}, ptr {y}, align 4"),
                lambda: e.loop(e.var("i64", "0"), left, 1, one_by_one),
            )

    _walk(e, s, t_rows, _LANES, tile)
    return e.function(name, _PARAMS)


# Activation scale groups: elements whose index // 4 is even, then odd. They match the
# auto kernels' chunks (chunk j is elements 4j..4j+3, in group j % 2), so each chunk's
# products take one scale, and halve the rounding error of one scale per 32 (outliers hurt
# one group).
_X_GROUPS = [[e for e in range(QK) if e // 4 % 2 == k] for k in (0, 1)]


def _quantize_fn(e: _Emitter, name: str) -> str:
    """Activation rows [lo, hi) of fp32 [T, K] -> int8 [T, K], per-block scales dx
    [T, nb, 2] (one per ``_X_GROUPS`` group) and sum(dx * q) [T, nb]."""
    arg = [e.load("i64", "%args", str(8 * i), 8) for i in range(_N_ARGS)]
    x_in = e(f"inttoptr i64 {arg[_A_Y]} to ptr")  # the fp32 source rides in the y slot
    xq, xd, xs = (e(f"inttoptr i64 {arg[k]} to ptr") for k in (_A_X, _A_XD, _A_XS))
    f32, f16v, i16v = _vec(32, "float"), _vec(16, "float"), _vec(16, "i32")
    slot = e.var("i64", e(f"mul i64 %lo, {arg[_A_NB]}"))

    def block(b: str) -> None:
        v = e.load(f32, x_in, e(f"mul i64 {b}, {QK * 4}"), 4)
        mag = e.call(f32, "llvm.fabs.v32f32", f"{f32} {v}")
        amax = [
            e.call(
                "float", "llvm.vector.reduce.fmax.v16f32", f"{f16v} {e.pick(mag, 32, 'float', g)}"
            )
            for g in _X_GROUPS
        ]
        d = [e(f"fdiv float {a}, 127.0") for a in amax]
        nonzero = [e(f"fcmp ogt float {a}, 0.0") for a in amax]
        inv = [
            e(f"select i1 {z}, float {e(f'fdiv float 127.0, {a}')}, float 0.0")
            for z, a in zip(nonzero, amax, strict=True)
        ]
        pair = e(f"insertelement <2 x float> poison, float {inv[0]}, i32 0")
        pair = e(f"insertelement <2 x float> {pair}, float {inv[1]}, i32 1")
        scaled = e(f"fmul {f32} {v}, {e.pick(pair, 2, 'float', [i // 4 % 2 for i in range(QK)])}")
        r = e.call(f32, "llvm.nearbyint.v32f32", f"{f32} {scaled}")
        q = e(f"fptosi {f32} {r} to {_vec(32, 'i8')}")
        e.do(f"store {_vec(32, 'i8')} {q}, ptr {e.at(xq, e(f'mul i64 {b}, {QK}'))}, align 1")
        wide = e(f"sext {_vec(32, 'i8')} {q} to {_vec(32, 'i32')}")
        total = e("fadd float 0.0, 0.0")
        for k, g in enumerate(_X_GROUPS):
            part = e.call(
                "i32", "llvm.vector.reduce.add.v16i32", f"{i16v} {e.pick(wide, 32, 'i32', g)}"
            )
            total = e.call(
                "float",
                "llvm.fmuladd.f32",
                f"float {d[k]}",
                f"float {e(f'sitofp i32 {part} to float')}",
                f"float {total}",
            )
            at = e.at(xd, e(f"add i64 {e(f'mul i64 {b}, 8')}, {4 * k}"))
            e.do(f"store float {d[k]}, ptr {at}, align 4")
        e.do(f"store float {total}, ptr {e.at(xs, e(f'mul i64 {b}, 4'))}, align 4")

    e.loop(slot, e(f"mul i64 %hi, {arg[_A_NB]}"), 1, block)
    return e.function(name, _PARAMS)


# GEMV and GEMM tiles sum each output in the same order, so a row's results are bitwise
# the same whatever the batch size (exact: the same accumulator width; auto: one lane per
# row whatever the tile). GEMV streams weights from memory: prefetching 8 KB ahead
# measured 1.4x (auto Q4_1) to 1.9x (exact Q8_0) on a decode step's 66 MB of layer weights.
_GEMV = {
    "exact": _Shape(mr=1, nr=4, aw=8, tc=32, pf=8192),
    "auto": _Shape(mr=1, nr=_LANES, aw=8, tc=64, pf=8192),
}
_GEMM = {
    # No prefetch here: 4 KB ahead measured 1.2-1.4x at T = 4..8 but 0.7x at T = 512.
    "exact": _Shape(mr=4, nr=2, aw=8, tc=32),
    "auto": _Shape(mr=4, nr=_LANES, aw=8, tc=64, pf=4096),  # pf: 1.1-1.2x at T = 4..8
}

_Fn = Callable[[int, int, int], None]  # (args, lo, hi)


@dataclass(frozen=True)
class _Kernels:
    addresses: list[int]  # gemv, gemm, quantize: what the pool calls natively
    calls: list[_Fn]  # the same through ctypes, for one thread
    mr: int


@cache
def _kernels(ggml_type: int, mode: str, isa: str) -> _Kernels:
    u = _UNPACKS[ggml_type]
    stem = f"dynalm_mm_{quant_format(ggml_type).name}_{mode}_{isa}"
    if mode == "auto":
        makers = {
            "gemv": lambda e, name: _lane_kernel(e, name, u, isa, _GEMV[mode]),
            "gemm": lambda e, name: _lane_kernel(e, name, u, isa, _GEMM[mode]),
            "quantize": _quantize_fn,
        }
    else:
        makers = {
            "gemv": lambda e, name: _kernel(e, name, u, _GEMV[mode]),
            "gemm": lambda e, name: _kernel(e, name, u, _GEMM[mode]),
        }
    names, emitters, texts = [], [], []
    for tag, make in makers.items():
        names.append(f"{stem}_{tag}")
        emitters.append(_Emitter())
        texts.append(make(emitters[-1], names[-1]))
    decls = sorted(set().union(*(e.decls for e in emitters)))
    ir = "\n\n".join([*decls, *texts]) + "\n"
    compiled = jit.compile_ir(ir, names)
    addrs = [compiled[n] for n in names]
    sig = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
    return _Kernels(addrs, [jit.cfunc(a, None, *sig) for a in addrs], _GEMM[mode].mr)


# --- threads ---------------------------------------------------------------------------

# Split matmuls with more weight bytes than this over the native pool (a split costs a few
# microseconds; a 192x576 Q4_1 GEMV takes ~7 us on one thread).
_PARALLEL_MIN_BYTES = 32 * 1024


def default_threads() -> int:
    """Threads for matmuls: ``$DYNALM_THREADS`` or the CPUs this process may run on."""
    env = os.environ.get("DYNALM_THREADS")
    return max(1, int(env)) if env else len(os.sched_getaffinity(0))


# --- the public API --------------------------------------------------------------------


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# Repack this many bytes of GGUF rows at a time: the temporaries stay small, and the mapped
# source of a chunk can be dropped from memory (``release_rows``) before the next is read.
_REPACK_CHUNK_BYTES = 4 << 20


class ActivationScratch:
    """The int8 activations of ``auto`` matmuls (quants, block scales, block sums), one
    buffer shared by every matmul that is given it: matmuls of one executor run one at a
    time, so one buffer for the largest ``[T, K]`` serves them all (a buffer per matmul
    cost 75 MB at T = 512 on SmolLM2). Grown, never shrunk; ``generation`` counts the
    regrowths, which move the buffer (matmuls bound to the old one rebind)."""

    def __init__(self) -> None:
        self.generation = 0
        self._buffer = np.empty(0, np.uint8)

    @staticmethod
    def _sizes(t_rows: int, n_cols: int) -> tuple[int, int, int]:
        align = lambda n: -(-n // 64) * 64  # noqa: E731 - each part cache-line aligned
        nb = n_cols // QK
        return align(t_rows * n_cols), align(t_rows * nb * 8), align(t_rows * nb * 4)

    def reserve(self, t_rows: int, n_cols: int) -> None:
        need = sum(self._sizes(t_rows, n_cols)) + 64
        if need > self._buffer.size:
            self._buffer = np.empty(need, np.uint8)
            self.generation += 1

    def views(self, t_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int8 ``[T, K]`` quants, fp32 ``[T, K/32, 2]`` scales, fp32 ``[T, K/32]`` sums."""
        self.reserve(t_rows, n_cols)
        nb, (q, d, _) = n_cols // QK, self._sizes(t_rows, n_cols)
        start = -_address(self._buffer) % 64
        base = self._buffer[start:]
        return (
            base[: t_rows * n_cols].view(np.int8).reshape(t_rows, n_cols),
            base[q : q + t_rows * nb * 8].view(np.float32).reshape(t_rows, nb, 2),
            base[q + d : q + d + t_rows * nb * 4].view(np.float32).reshape(t_rows, nb),
        )


class QuantMatmul:
    """y[T, N] = x[T, K] @ W[N, K]^T for a GGUF weight, repacked once into kernel planes.

    Calls are cheapest when the same ``x`` and ``out`` arrays are passed each time (their
    addresses are remembered); one instance must not be called from two threads at once.
    """

    def __init__(
        self,
        raw: np.ndarray,
        ggml_type: int,
        n_cols: int,
        *,
        mode: str = "exact",
        threads: int | None = None,
        isa: str | None = None,
        scratch: ActivationScratch | None = None,
        release_rows: Callable[[int, int], None] | None = None,
    ) -> None:
        """``threads``: default ``default_threads()``; ``isa``: "avx2" or "generic" (the
        portable IR), default the host's best; ``scratch``: where ``auto`` quantises the
        activations (default: a buffer of its own); ``release_rows(lo, hi)``: called once
        rows ``lo:hi`` of ``raw`` are repacked, e.g. to drop their mapped pages."""
        if not self.supported(ggml_type, mode):
            raise ValueError(f"no {mode} matmul kernel for {quant_format(ggml_type).name}")
        fmt = quant_format(ggml_type)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != fmt.row_bytes(n_cols):
            raise ValueError(
                f"{fmt.name}: expected uint8 [N, {fmt.row_bytes(n_cols)}], "
                f"got {raw.dtype} {raw.shape}"
            )
        if n_cols % QK:
            raise ValueError(f"{fmt.name}: K={n_cols} is not a multiple of {QK}")
        u = _UNPACKS[ggml_type]
        self.ggml_type, self.n_rows, self.n_cols = ggml_type, raw.shape[0], n_cols
        self.mode = mode if u.has_int8 else "exact"
        self._nb = n_cols // QK
        self._kernels = _kernels(ggml_type, self.mode, isa or str(jit.host_features()["isa"]))
        self._weights = self._repack(u, raw, release_rows)
        threads = threads or default_threads()
        small = raw.nbytes < _PARALLEL_MIN_BYTES
        self._threads = 1 if small or not pool.available() else threads
        # The pool's smallest grab (its first grabs are larger, see core.pool): small enough
        # to even out uneven threads at the end of a job.
        self._chunk = max(16, -(-self.n_rows // (16 * self._threads)) + 15 & ~15)
        self._args = (ctypes.c_int64 * _N_ARGS)()
        self._args_at = ctypes.addressof(self._args)
        self._args[_A_W] = _address(self._weights)
        self._args[_A_NB], self._args[_A_LDY] = self._nb, self.n_rows
        # The quantiser's own argument block: x -> (xq, xd, xs); its y slot is the fp32 source.
        self._qargs = (ctypes.c_int64 * _N_ARGS)()
        self._qargs[_A_NB] = self._nb
        self._qargs_at = ctypes.addressof(self._qargs)
        self._pool = pool.pool(self._threads) if self._threads > 1 else None
        self._x: np.ndarray | None = None
        self._out: np.ndarray | None = None
        self._calls: list[tuple[int, int, int, int, int]] = []
        self._scratch = scratch or ActivationScratch()
        self._generation = -1  # the scratch's generation the bound addresses belong to

    def _repack(
        self, u: _Unpack, raw: np.ndarray, release_rows: Callable[[int, int], None] | None
    ) -> np.ndarray:
        """Fields split into planes (scales apart from quants), rows interleaved; done a
        chunk of whole row groups at a time, so memory holds one chunk's temporaries."""
        auto = self.mode == "auto"
        per_group, interleave = (_LANES, _interleave_lanes) if auto else (_ROWS, _interleave)
        fmt = quant_format(self.ggml_type)
        groups = -(-self.n_rows // per_group)
        out = np.empty((groups, per_group * self._nb * u.block_bytes), np.uint8)
        step = max(1, _REPACK_CHUNK_BYTES // raw.shape[1] // _LANES) * _LANES
        for lo in range(0, self.n_rows, step):
            hi = min(lo + step, self.n_rows)
            planes = u.repack(np.ascontiguousarray(raw[lo:hi]).reshape(-1, fmt.type_size))
            interleave(u, planes, hi - lo, self._nb, out[lo // per_group : -(-hi // per_group)])
            if release_rows is not None:
                release_rows(lo, hi)
        return out.reshape(-1)

    @staticmethod
    def supported(ggml_type: int, mode: str) -> bool:
        """Whether a kernel exists for this GGUF type in ``mode`` ("exact" or "auto")."""
        return ggml_type in _UNPACKS and mode in ("exact", "auto")

    def _set(self, slot: int, value: int) -> None:
        self._args[slot] = self._qargs[slot] = value

    def _bind_x(self, x: np.ndarray) -> None:
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.n_cols:
            raise ValueError(f"x must be float32 [T, {self.n_cols}], got {x.dtype} {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError("x must be C-contiguous")
        t_rows = x.shape[0]
        self._x, self._out = x, None
        self._set(_A_T, t_rows)
        if self.mode == "exact":
            self._set(_A_X, _address(x))
            return
        xq, xd, xs = self._scratch.views(t_rows, self.n_cols)
        self._generation = self._scratch.generation
        self._set(_A_X, _address(xq))
        self._set(_A_XD, _address(xd))
        self._set(_A_XS, _address(xs))
        self._qargs[_A_Y] = _address(x)

    def _bind_out(self, out: np.ndarray) -> None:
        shape = (self._x.shape[0], self.n_rows)
        if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 {list(shape)}")
        self._out = out
        self._args[_A_Y] = _address(out)

    def records(self, x: np.ndarray, out: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """``self(x, out)`` as native calls: ``pool.Program`` records (kind, fn, args,
        total, chunk), valid while ``x`` and ``out`` stay this object's bound arrays."""
        fns = self._kernels.addresses
        return [(kind, fns[k], *rest) for kind, k, *rest in self._plan(x, out)]

    def _plan(self, x: np.ndarray, out: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """Bind ``x``/``out``; the calls of one product: (kind, kernel, args, total, chunk)."""
        moved = self.mode == "auto" and self._generation != self._scratch.generation
        if x is self._x and out is self._out and not moved:
            return self._calls
        if x is not self._x or moved:
            self._bind_x(x)
        self._bind_out(out)
        t_rows, threads = x.shape[0], self._threads
        calls = [(0 if t_rows < self._kernels.mr else 1, self._args_at, self.n_rows, self._chunk)]
        if self.mode == "auto":  # quantise the activations first
            calls.insert(0, (2, self._qargs_at, t_rows, -(-t_rows // threads)))
        self._calls = [
            (pool.SPLIT if threads > 1 and total > chunk else pool.RANGE, which, args, total, chunk)
            for which, args, total, chunk in calls
        ]
        return self._calls

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y = x @ W^T; ``x`` C-contiguous float32 [T, K], ``out`` float32 [T, N] or None."""
        if out is None:
            out = np.empty((x.shape[0], self.n_rows), np.float32)
        for kind, which, args, total, chunk in self._plan(x, out):
            if kind == pool.SPLIT:
                self._pool.run(self._kernels.addresses[which], args, total, chunk)
            else:
                self._kernels.calls[which](args, 0, total)
        return out
