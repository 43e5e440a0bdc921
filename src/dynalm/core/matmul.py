"""Quantised matmul ``y[T, N] = x[T, K] @ W[N, K]^T`` as JIT-compiled LLVM IR kernels.

Every kernel is generated from one pattern over a per-format *unpack*: the IR that turns
one 32-weight block of a repacked row into 32 integer (or float) lanes ``q`` plus a scale
``d`` and an offset, so that ``w = d * (q + offset) + m``. Adding a format is one new
``_Unpack`` row, not a new kernel.

Two modes:

* ``exact`` -- fp32 activations; each weight block is dequantised in registers and
  accumulated with fp32 FMAs (the accuracy contract).
* ``auto`` -- activations are quantised per 32-block to int8 (scale ``dx`` and
  ``dx * sum(q)``, like ggml's Q8_1); integer dot products (AVX2 ``vpmaddubsw`` +
  ``vpmaddwd``, or portable IR), one fp32 FMA per block. Float weights use ``exact``.

One kernel shape serves every batch size: a register tile of ``MR`` activation rows x
``NR`` weight rows (each weight block unpacked once per tile), the activation rows walked
in L1/L2-sized chunks; ``T < MR`` uses a GEMV variant with a wider weight tile. Work is
split over threads by weight rows.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGMLQuantizationType as _T

from dynalm.core import jit
from dynalm.core.quant import quant_format

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
        return self(f"call {flags} {ret} @{fn}({', '.join(args)})")

    def var(self, ty: str, init: str) -> str:
        slot = "%" + self.fresh("slot")
        self.allocas.append(f"  {slot} = alloca {ty}")
        self.do(f"store {ty} {init}, ptr {slot}")
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
    b = e.load(_vec(16, "i8"), p["qs"])
    lo = e(f"and {_vec(16, 'i8')} {b}, {_const('i8', [15] * 16)}")
    hi = e(f"lshr {_vec(16, 'i8')} {b}, {_const('i8', [4] * 16)}")
    return e(
        f"shufflevector {_vec(16, 'i8')} {lo}, {_vec(16, 'i8')} {hi}, {_mask(list(range(32)))}"
    )


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


@dataclass(frozen=True)
class _Unpack:
    """How kernels read one 32-weight block: ``w = d * (q + offset) + m``.

    ``fields`` is the GGUF block layout (name, bytes) in order; repacking splits it into one
    contiguous plane per field. ``kind`` is the lane type ``lanes`` returns: "u8" / "s8"
    (``<32 x i8>``, unsigned / signed) or "float" (``<32 x float>``, no ``d``/``m``).
    """

    fields: tuple[tuple[str, int], ...]
    lanes: Callable[[_Emitter, dict[str, str]], str]
    kind: str
    offset: int = 0

    @property
    def has_min(self) -> bool:
        return any(name == "m" for name, _ in self.fields)

    @property
    def has_scale(self) -> bool:
        return self.kind != "float"

    def size(self, field: str) -> int:
        return dict(self.fields)[field]


_UNPACKS: dict[int, _Unpack] = {
    _T.F32: _Unpack((("qs", 128),), _floats, "float"),
    _T.F16: _Unpack((("qs", 64),), _halves, "float"),
    _T.Q4_0: _Unpack((("d", 2), ("qs", 16)), _nibbles, "u8", offset=-8),
    _T.Q4_1: _Unpack((("d", 2), ("m", 2), ("qs", 16)), _nibbles, "u8"),
    _T.Q5_0: _Unpack((("d", 2), ("qh", 4), ("qs", 16)), _nibbles_and_fifth_bit, "u8", offset=-16),
    _T.Q5_1: _Unpack((("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), _nibbles_and_fifth_bit, "u8"),
    _T.Q8_0: _Unpack((("d", 2), ("qs", 32)), _bytes, "s8"),
}
_PLANES = ("qs", "qh", "d", "m")  # kernel argument order of the weight planes

# --- the kernel pattern ----------------------------------------------------------------

# Argument block (one i64 array per call site and thread), read by every kernel.
_A_PLANES, _A_X, _A_XD, _A_XS, _A_Y, _A_T, _A_N0, _A_N1, _A_NB, _A_LDY = (
    0,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
)
_N_ARGS = 13
_GROUP = 8  # blocks per main-loop step: their scales are loaded and converted as one vector


@dataclass(frozen=True)
class _Shape:
    mr: int  # activation rows per register tile
    nr: int  # weight rows per register tile
    aw: int  # fp32 lanes per accumulator (exact mode: wider = more independent FMA chains)
    tc: int  # activation rows per cache chunk


def _dot_i8(e: _Emitter, u: _Unpack, isa: str, q: str, x: str) -> str:
    """Sum of ``q * x`` over a block as ``<8 x i32>`` partial sums (lane order is free:
    the accumulator is reduced at the end)."""
    v32 = _vec(32, "i8")
    if isa == "avx2":
        if u.kind == "s8":  # vpmaddubsw wants unsigned x signed: move q's sign onto x
            x = e.call(v32, "llvm.x86.avx2.psign.b", f"{v32} {x}", f"{v32} {q}")
            q = e.call(v32, "llvm.abs.v32i8", f"{v32} {q}", "i1 false")
        pairs = e.call(_vec(16, "i16"), "llvm.x86.avx2.pmadd.ub.sw", f"{v32} {q}", f"{v32} {x}")
        return e.call(
            _vec(8, "i32"),
            "llvm.x86.avx2.pmadd.wd",
            f"{_vec(16, 'i16')} {pairs}",
            f"{_vec(16, 'i16')} {_const('i16', [1] * 16)}",
        )
    ext = "sext" if u.kind == "s8" else "zext"
    qw = e(f"{ext} {v32} {q} to {_vec(32, 'i32')}")
    xw = e(f"sext {v32} {x} to {_vec(32, 'i32')}")
    prod = e(f"mul nsw {_vec(32, 'i32')} {qw}, {xw}")
    parts = [e.part(prod, 32, "i32", lo, 8) for lo in range(0, 32, 8)]
    s = e(f"add {_vec(8, 'i32')} {parts[0]}, {parts[1]}")
    s = e(f"add {_vec(8, 'i32')} {s}, {parts[2]}")
    return e(f"add {_vec(8, 'i32')} {s}, {parts[3]}")


def _dequant(e: _Emitter, u: _Unpack, q: str, d: str, m: str | None) -> str:
    """Integer lanes -> fp32 weights ``d * (q + offset) + m`` (``d``, ``m``: 32-lane splats).

    Matches the reference exactly: ``q + offset`` is a small integer and ``d * (q + offset)``
    is exact in fp32, leaving one rounding for ``+ m``."""
    f32 = _vec(32, "float")
    qf = e(f"{'sitofp' if u.kind == 's8' else 'uitofp'} {_vec(32, 'i8')} {q} to {f32}")
    if u.offset:
        qf = e(f"fadd {f32} {qf}, {e.splat(f'{float(u.offset)!r}', 32, 'float')}")
    if m is None:
        return e(f"fmul {f32} {qf}, {d}")
    return e.call(f32, "llvm.fmuladd.v32f32", f"{f32} {qf}", f"{f32} {d}", f"{f32} {m}")


def _kernel(e: _Emitter, name: str, u: _Unpack, mode: str, isa: str, s: _Shape) -> str:
    """One matmul function over rows ``[n0, n1)`` of W and all T activation rows."""
    arg = [e.load("i64", "%args", str(8 * i), 8) for i in range(_N_ARGS)]
    ptr = [e(f"inttoptr i64 {a} to ptr") for a in arg]
    t_rows, n0, n1, nb, ldy = arg[_A_T], arg[_A_N0], arg[_A_N1], arg[_A_NB], arg[_A_LDY]
    planes = {f: ptr[_A_PLANES + i] for i, f in enumerate(_PLANES)}
    x_block = QK * (4 if mode == "exact" else 1)  # bytes of one activation block
    acc_ty = _vec(s.aw, "float")

    def tile(mr: int, nr: int, t: str, n: str) -> None:
        accs = [[e.var(acc_ty, "zeroinitializer") for _ in range(nr)] for _ in range(mr)]
        w_rows = [e(f"add i64 {n}, {j}") for j in range(nr)]
        x_rows = [e(f"add i64 {t}, {i}") for i in range(mr)]
        w_base = {
            (f, j): e.at(planes[f], e(f"mul i64 {e(f'mul i64 {r}, {nb}')}, {u.size(f)}"))
            for f, _ in u.fields
            for j, r in enumerate(w_rows)
        }
        x_off = [e(f"mul i64 {e(f'mul i64 {r}, {nb}')}, {x_block}") for r in x_rows]
        s_off = [e(f"mul i64 {e(f'mul i64 {r}, {nb}')}, 4") for r in x_rows]

        def fma(a: str, b: str, acc: str, ty: str = acc_ty) -> str:
            n_lanes = ty[1 : ty.index(" ")]
            return e.call(
                ty, f"llvm.fmuladd.v{n_lanes}f32", f"{ty} {a}", f"{ty} {b}", f"{ty} {acc}"
            )

        def group(kb: str, g: int) -> None:
            """Blocks kb .. kb+g of the tile; scales are loaded and converted g at a time."""
            gv = _vec(g, "float")
            lanes, dw, mw = [], [], []
            for j in range(nr):
                at = {f: e.at(w_base[f, j], e(f"mul i64 {kb}, {size}")) for f, size in u.fields}
                lanes.append(
                    [
                        u.lanes(e, {f: e.at(p, str(b * u.size(f))) for f, p in at.items()})
                        for b in range(g)
                    ]
                )
                if u.has_scale:
                    half = [
                        e(f"fpext {_vec(g, 'half')} {e.load(_vec(g, 'half'), at[f])} to {gv}")
                        if f in at
                        else None
                        for f in ("d", "m")
                    ]
                    dw.append(half[0])
                    mw.append(half[1])
            xk = [e(f"add i64 {o}, {e(f'mul i64 {kb}, {x_block}')}") for o in x_off]
            sk = [e(f"add i64 {o}, {e(f'mul i64 {kb}, 4')}") for o in s_off]
            if mode == "exact":
                for b in range(g):
                    w = [
                        lanes[j][b]
                        if not u.has_scale
                        else _dequant(
                            e,
                            u,
                            lanes[j][b],
                            e.lane(dw[j], g, b, 32),
                            mw[j] and e.lane(mw[j], g, b, 32),
                        )
                        for j in range(nr)
                    ]
                    for i in range(mr):
                        xv = e.load(
                            _vec(32, "float"), ptr[_A_X], e(f"add i64 {xk[i]}, {b * x_block}")
                        )
                        xs = [e.part(xv, 32, "float", c, s.aw) for c in range(0, 32, s.aw)]
                        for j in range(nr):
                            acc = e.get(acc_ty, accs[i][j])
                            for c in range(0, 32, s.aw):
                                acc = fma(e.part(w[j], 32, "float", c, s.aw), xs[c // s.aw], acc)
                            e.put(acc_ty, accs[i][j], acc)
                return
            dx = [e.load(gv, ptr[_A_XD], o) for o in sk]
            dd = [[e(f"fmul {gv} {dw[j]}, {dx[i]}") for j in range(nr)] for i in range(mr)]
            acc = [[e.get(acc_ty, accs[i][j]) for j in range(nr)] for i in range(mr)]
            if u.has_min or u.offset:
                # The offset/min part, m_eff * dx * sum(xq) per block: g blocks in one FMA
                # into the accumulator's lanes (they are all summed at the end).
                me = [
                    mw[j]
                    if not u.offset
                    else fma(
                        e.splat(f"{float(u.offset)!r}", g, "float"),
                        dw[j],
                        mw[j] or "zeroinitializer",
                        gv,
                    )
                    for j in range(nr)
                ]
                xs = [e.load(gv, ptr[_A_XS], o) for o in sk]
                pad = _mask([min(c, g) for c in range(8)])  # lane g of the zero operand is 0
                for i in range(mr):
                    xs8 = e(f"shufflevector {gv} {xs[i]}, {gv} zeroinitializer, {pad}")
                    for j in range(nr):
                        me8 = e(f"shufflevector {gv} {me[j]}, {gv} zeroinitializer, {pad}")
                        acc[i][j] = fma(me8, xs8, acc[i][j])
            for b in range(g):
                xq = [e.load(_vec(32, "i8"), ptr[_A_X], e(f"add i64 {o}, {b * QK}")) for o in xk]
                for i in range(mr):
                    for j in range(nr):
                        dot = _dot_i8(e, u, isa, lanes[j][b], xq[i])
                        dot = e(f"sitofp {_vec(8, 'i32')} {dot} to {acc_ty}")
                        acc[i][j] = fma(dot, e.lane(dd[i][j], g, b, 8), acc[i][j])
            for i in range(mr):
                for j in range(nr):
                    e.put(acc_ty, accs[i][j], acc[i][j])

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

    def rows(t0: str, t_end: str, n: str, nr: int) -> None:
        t_slot = e.var("i64", t0)
        e.loop(t_slot, t_end, s.mr, lambda t: tile(s.mr, nr, t, n))
        if s.mr > 1:
            e.loop(t_slot, t_end, 1, lambda t: tile(1, nr, t, n))

    def chunk(t0: str) -> None:
        t_next = e(f"add i64 {t0}, {s.tc}")
        full = e(f"icmp slt i64 {t_next}, {t_rows}")
        t_end = e(f"select i1 {full}, i64 {t_next}, i64 {t_rows}")
        n_slot = e.var("i64", n0)
        e.loop(n_slot, n1, s.nr, lambda n: rows(t0, t_end, n, s.nr))
        if s.nr > 1:
            e.loop(n_slot, n1, 1, lambda n: rows(t0, t_end, n, 1))

    # Walk activation chunks of TC rows; a final partial chunk is the loop's last step.
    tc_slot = e.var("i64", "0")
    t_pad = e(f"add i64 {t_rows}, {s.tc - 1}")
    e.loop(tc_slot, t_pad, s.tc, chunk)
    return e.function(name, "ptr noalias nocapture readonly %args")


def _quantize_fn(e: _Emitter, name: str) -> str:
    """Activations fp32 [T, K] -> int8 [T, K], per-block scale dx [T, nb], dx*sum(q) [T, nb]."""
    arg = [e.load("i64", "%args", str(8 * i), 8) for i in range(_N_ARGS)]
    x_in = e(f"inttoptr i64 {arg[_A_Y]} to ptr")  # the fp32 source rides in the y slot
    xq, xd, xs = (e(f"inttoptr i64 {arg[k]} to ptr") for k in (_A_X, _A_XD, _A_XS))
    n_blocks = e(f"mul i64 {arg[_A_T]}, {arg[_A_NB]}")
    f32 = _vec(32, "float")
    slot = e.var("i64", "0")

    def block(b: str) -> None:
        v = e.load(f32, x_in, e(f"mul i64 {b}, {QK * 4}"), 4)
        amax = e.call(
            "float",
            "llvm.vector.reduce.fmax.v32f32",
            f"{f32} {e.call(f32, 'llvm.fabs.v32f32', f'{f32} {v}')}",
        )
        d = e(f"fdiv float {amax}, 127.0")
        inv = e(
            f"select i1 {e(f'fcmp ogt float {amax}, 0.0')}, float "
            f"{e(f'fdiv float 127.0, {amax}')}, float 0.0"
        )
        scaled = e(f"fmul {f32} {v}, {e.splat(inv, 32, 'float')}")
        r = e.call(f32, "llvm.nearbyint.v32f32", f"{f32} {scaled}")
        q = e(f"fptosi {f32} {r} to {_vec(32, 'i8')}")
        e.do(f"store {_vec(32, 'i8')} {q}, ptr {e.at(xq, e(f'mul i64 {b}, {QK}'))}, align 1")
        wide = e(f"sext {_vec(32, 'i8')} {q} to {_vec(32, 'i32')}")
        total = e(
            f"sitofp i32 {e.call('i32', 'llvm.vector.reduce.add.v32i32', f'<32 x i32> {wide}')}"
            " to float"
        )
        s_off = e(f"mul i64 {b}, 4")
        e.do(f"store float {d}, ptr {e.at(xd, s_off)}, align 4")
        e.do(f"store float {e(f'fmul float {d}, {total}')}, ptr {e.at(xs, s_off)}, align 4")

    e.loop(slot, n_blocks, 1, block)
    return e.function(name, "ptr noalias nocapture readonly %args")


_GEMV = {"exact": _Shape(mr=1, nr=4, aw=16, tc=32), "auto": _Shape(mr=1, nr=4, aw=8, tc=64)}
_GEMM = {"exact": _Shape(mr=4, nr=2, aw=8, tc=32), "auto": _Shape(mr=4, nr=2, aw=8, tc=64)}

_Fn = Callable[[int], None]


@dataclass(frozen=True)
class _Kernels:
    gemv: _Fn
    gemm: _Fn
    quantize: _Fn | None
    mr: int


@cache
def _kernels(ggml_type: int, mode: str, isa: str) -> _Kernels:
    u = _UNPACKS[ggml_type]
    stem = f"dynalm_mm_{quant_format(ggml_type).name}_{mode}_{isa}"
    makers = {
        "gemv": lambda e, name: _kernel(e, name, u, mode, isa, _GEMV[mode]),
        "gemm": lambda e, name: _kernel(e, name, u, mode, isa, _GEMM[mode]),
    }
    if mode == "auto":
        makers["quantize"] = _quantize_fn
    names, emitters, texts = [], [], []
    for tag, make in makers.items():
        names.append(f"{stem}_{tag}")
        emitters.append(_Emitter())
        texts.append(make(emitters[-1], names[-1]))
    decls = sorted(set().union(*(e.decls for e in emitters)))
    ir = "\n\n".join([*decls, *texts]) + "\n"
    addrs = jit.compile_ir(ir, names)
    call = [jit.cfunc(addrs[n], None, ctypes.c_void_p) for n in names]
    return _Kernels(call[0], call[1], call[2] if mode == "auto" else None, _GEMM[mode].mr)


# --- threads ---------------------------------------------------------------------------


class _Pool:
    """Persistent worker threads, each running one ctypes kernel call per job (ctypes
    releases the GIL, so the calls run in parallel). A hand-off costs ~15-30 us, so only
    matmuls larger than ``_PARALLEL_MIN_BYTES`` of weights are split."""

    def __init__(self, n_workers: int) -> None:
        self._jobs = [(threading.Lock(), threading.Lock()) for _ in range(n_workers)]
        self._work: list[tuple[_Fn, int] | None] = [None] * n_workers
        self._busy = threading.Lock()  # one job at a time, whichever Python thread calls
        for k, (go, done) in enumerate(self._jobs):
            go.acquire()
            done.acquire()
            threading.Thread(
                target=self._serve, args=(k,), daemon=True, name=f"dynalm-matmul-{k}"
            ).start()

    def _serve(self, k: int) -> None:
        go, done = self._jobs[k]
        while True:
            go.acquire()
            fn, args = self._work[k]
            fn(args)
            done.release()

    def run(self, fn: _Fn, args: list[int]) -> None:
        """Run ``fn(args[0])`` here and ``fn(args[k])`` on worker k-1, then wait for all."""
        with self._busy:
            for k, a in enumerate(args[1:]):
                self._work[k] = (fn, a)
                self._jobs[k][0].release()
            fn(args[0])
            for k in range(len(args) - 1):
                self._jobs[k][1].acquire()


_PARALLEL_MIN_BYTES = 1 << 20


@cache
def _pool(n_threads: int) -> _Pool:
    return _Pool(n_threads - 1)


def default_threads() -> int:
    """Threads for matmuls: ``$DYNALM_THREADS`` or the CPUs this process may run on."""
    env = os.environ.get("DYNALM_THREADS")
    return max(1, int(env)) if env else len(os.sched_getaffinity(0))


# --- the public API --------------------------------------------------------------------


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class QuantMatmul:
    """y[T, N] = x[T, K] @ W[N, K]^T for a GGUF weight kept in its quantised bytes.

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
    ) -> None:
        """``threads``: default ``default_threads()``; ``isa``: "avx2" or "generic" (the
        portable IR), default the host's best."""
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
        self.mode = "exact" if u.kind == "float" else mode
        self._nb = n_cols // QK
        self._kernels = _kernels(ggml_type, self.mode, isa or str(jit.host_features()["isa"]))
        # Repack: one contiguous plane per block field (scales apart from quants).
        blocks = raw.reshape(self.n_rows, self._nb, sum(size for _, size in u.fields))
        self._planes, at = {}, 0
        for f, size in u.fields:
            self._planes[f] = np.ascontiguousarray(blocks[:, :, at : at + size])
            at += size
        threads = threads or default_threads()
        self._threads = 1 if raw.nbytes < _PARALLEL_MIN_BYTES else threads
        # One argument block per thread; thread k owns weight rows [n0, n1), a multiple of NR.
        self._args = [(ctypes.c_int64 * _N_ARGS)() for _ in range(self._threads)]
        self._arg_ptrs = [ctypes.addressof(a) for a in self._args]
        step = -(-self.n_rows // self._threads)
        step += -step % _GEMV[self.mode].nr
        for k, a in enumerate(self._args):
            for i, f in enumerate(_PLANES):
                a[_A_PLANES + i] = _address(self._planes[f]) if f in self._planes else 0
            a[_A_NB], a[_A_LDY] = self._nb, self.n_rows
            a[_A_N0], a[_A_N1] = min(k * step, self.n_rows), min((k + 1) * step, self.n_rows)
        # The quantiser's own argument block: x -> (xq, xd, xs); its y slot is the fp32 source.
        self._qargs = (ctypes.c_int64 * _N_ARGS)()
        self._qargs[_A_NB] = self._nb
        self._qargs_ptr = ctypes.addressof(self._qargs)
        self._x: np.ndarray | None = None
        self._out: np.ndarray | None = None
        self._scratch_rows = 0

    @staticmethod
    def supported(ggml_type: int, mode: str) -> bool:
        """Whether a kernel exists for this GGUF type in ``mode`` ("exact" or "auto")."""
        return ggml_type in _UNPACKS and mode in ("exact", "auto")

    def _set(self, slot: int, value: int) -> None:
        for a in (*self._args, self._qargs):
            a[slot] = value

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
        if t_rows > self._scratch_rows:  # int8 activations, grown and never shrunk
            self._scratch_rows = t_rows
            self._xq = np.empty((t_rows, self.n_cols), np.int8)
            self._xd = np.empty((t_rows, self._nb), np.float32)
            self._xs = np.empty((t_rows, self._nb), np.float32)
            self._set(_A_X, _address(self._xq))
            self._set(_A_XD, _address(self._xd))
            self._set(_A_XS, _address(self._xs))
        self._qargs[_A_Y] = _address(x)

    def _bind_out(self, out: np.ndarray) -> None:
        shape = (self._x.shape[0], self.n_rows)
        if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 {list(shape)}")
        self._out = out
        for a in self._args:
            a[_A_Y] = _address(out)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y = x @ W^T; ``x`` C-contiguous float32 [T, K], ``out`` float32 [T, N] or None."""
        if x is not self._x:
            self._bind_x(x)
        if out is None:
            out = np.empty((x.shape[0], self.n_rows), np.float32)
        if out is not self._out:
            self._bind_out(out)
        k = self._kernels
        if k.quantize is not None:
            k.quantize(self._qargs_ptr)
        fn = k.gemv if x.shape[0] < k.mr else k.gemm
        if self._threads == 1:
            fn(self._arg_ptrs[0])
        else:
            _pool(self._threads).run(fn, self._arg_ptrs)
        return out
