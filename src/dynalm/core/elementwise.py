"""Fused element-wise kernels (RMSNorm, RoPE, SwiGLU / GeGLU, add) as JIT-compiled LLVM IR.

The IR is generated from Python with ``llvmlite.ir`` and compiled for the host by
``kernel.jit`` (on-disk object cache). Each kernel is specialised on its constant shapes
(row width, head size, eps, rope layout) and written as explicit 8-lane vector loops
plus a 1-lane tail, so odd sizes work and nothing depends on the auto-vectoriser
(which would give up on in-place calls such as ``out += residual``).

A kernel is *bound* once to its arrays: the addresses and the row count go into an
int64 argument block, and the returned :class:`BoundKernel` is a zero-argument
callable costing one ctypes call (~1-2 us) per run. Every binder takes an optional
``block`` (``MAX_WORDS`` int64s), so a caller can keep the blocks of many kernels as rows
of one array and rewrite all their counts with one numpy assignment. The executor binds each step
shape once and then only calls. ``exp`` is a Cephes-style polynomial (about 1 ulp),
so SiLU and GELU vectorise instead of calling libm per element.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from collections.abc import Callable

import llvmlite.ir as ir
import numpy as np

from dynalm.core import pool
from dynalm.core.buffers import check, require
from dynalm.kernel import jit

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_PTR = ir.PointerType()
LANES = 8  # one AVX2 register of fp32


def _vt(w: int) -> ir.VectorType:
    return ir.VectorType(_F32, w)


def _splat(w: int, value: float) -> ir.Constant:
    return ir.Constant(_vt(w), [value] * w)


def intrinsic(
    b: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Value, flags: tuple = ()
) -> ir.Value:
    """Call the LLVM intrinsic ``name`` (declared in the builder's module on first use)."""
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return b.call(fn, args, fastmath=flags)


def exp(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """IR for e**x of an f32 vector ``x``: x = n ln2 + r, |r| <= ln2/2, a degree-6
    polynomial of r times 2**n (inputs clamped to the normal range)."""
    w = x.type.count
    x = intrinsic(b, f"llvm.maxnum.v{w}f32", _vt(w), x, _splat(w, -87.33654))
    x = intrinsic(b, f"llvm.minnum.v{w}f32", _vt(w), x, _splat(w, 88.37626))
    n = intrinsic(b, f"llvm.rint.v{w}f32", _vt(w), b.fmul(x, _splat(w, 1.4426950408889634)))
    r = b.fsub(x, b.fmul(n, _splat(w, 0.693359375)))
    r = b.fsub(r, b.fmul(n, _splat(w, -2.12194440e-4)))
    p = _splat(w, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5):
        p = b.fadd(b.fmul(p, r), _splat(w, c))
    p = b.fadd(b.fadd(b.fmul(p, b.fmul(r, r)), r), _splat(w, 1.0))
    iv = ir.VectorType(_I32, w)
    bits = b.shl(b.add(b.fptosi(n, iv), ir.Constant(iv, [127] * w)), ir.Constant(iv, [23] * w))
    return b.fmul(p, b.bitcast(bits, _vt(w)))


class _Kernel:
    """Builds ``void name(ptr args)`` where ``args`` is ``int64[1 + n_ptrs]``:
    a count (rows or elements) followed by the arrays' addresses."""

    def __init__(self, module: ir.Module, name: str, n_ptrs: int):
        self.module = module
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_PTR]), name)
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        slots = [
            self.b.gep(fn.args[0], [ir.Constant(_I64, i)], source_etype=_I64)
            for i in range(n_ptrs + 1)
        ]
        words = [self.b.load(s, typ=_I64) for s in slots]
        self.count = words[0]
        self.ptrs = [self.b.inttoptr(w, _PTR) for w in words[1:]]

    def finish(self) -> None:
        self.b.ret_void()

    # -- memory -----------------------------------------------------------------
    def at(self, ptr: ir.Value, index: ir.Value, ty: ir.Type = _F32) -> ir.Value:
        return self.b.gep(ptr, [index], source_etype=ty)

    def load(self, ptr: ir.Value, index: ir.Value, w: int) -> ir.Value:
        return self.b.load(self.at(ptr, index), typ=_vt(w), align=4)

    def store(self, value: ir.Value, ptr: ir.Value, index: ir.Value) -> None:
        self.b.store(value, self.at(ptr, index), align=4)

    # -- arithmetic ---------------------------------------------------------------
    def i64(self, v: int) -> ir.Constant:
        return ir.Constant(_I64, v)

    def intrinsic(self, name: str, ret: ir.Type, *args: ir.Value, flags: tuple = ()) -> ir.Value:
        return intrinsic(self.b, name, ret, *args, flags=flags)

    # -- loops --------------------------------------------------------------------
    def loop(
        self, start: ir.Value, stop: ir.Value, step: int, body: Callable[[ir.Value], None]
    ) -> ir.Value:
        return loop(self.b, start, stop, step, body)

    def lanes(self, start: ir.Value, stop: ir.Value, body: Callable[[ir.Value, int], None]) -> None:
        """``body(i, w)`` over ``[start, stop)`` in ``LANES``-wide steps, then 1-wide."""
        rest = self.loop(start, stop, LANES, lambda i: body(i, LANES))
        self.loop(rest, stop, 1, lambda i: body(i, 1))


def loop(
    b: ir.IRBuilder,
    start: ir.Value,
    stop: ir.Value,
    step: int,
    body: Callable[[ir.Value], None],
    *,
    partial: bool = False,
) -> ir.Value:
    """``for i = start; i + step <= stop; i += step: body(i)`` (with ``partial``, while
    ``i < stop``: a last, shorter step runs too); returns the final ``i``."""
    pre = b.block
    head, blk, end = (b.append_basic_block() for _ in range(3))
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(_I64)
    i.add_incoming(start, pre)
    nxt = b.add(i, ir.Constant(_I64, step))
    b.cbranch(b.icmp_signed("<", i, stop) if partial else b.icmp_signed("<=", nxt, stop), blk, end)
    b.position_at_end(blk)
    body(i)
    i.add_incoming(nxt, b.block)
    b.branch(head)
    b.position_at_end(end)
    return i


def _gated(k: _Kernel, activation: str) -> None:
    """out = act(gate) * up with act(g) = g * sigmoid(z): z = g for SiLU, and
    z = 2 sqrt(2/pi) (g + 0.044715 g^3) for tanh-GELU (0.5 (1 + tanh(y)) = sigmoid(2y))."""
    out, gate, up = k.ptrs
    b = k.b

    def body(i: ir.Value, w: int) -> None:
        g = k.load(gate, i, w)
        z = g
        if activation == "gelu_tanh":
            cube = b.fmul(b.fmul(g, g), g)
            inner = b.fadd(g, b.fmul(cube, _splat(w, 0.044715)))
            z = b.fmul(inner, _splat(w, 2.0 * math.sqrt(2.0 / math.pi)))
        e = exp(b, b.fsub(_splat(w, 0.0), z))
        act = b.fdiv(g, b.fadd(_splat(w, 1.0), e))
        k.store(b.fmul(act, k.load(up, i, w)), out, i)

    k.lanes(k.i64(0), k.count, body)


def _add(k: _Kernel) -> None:
    out, x, y = k.ptrs
    k.lanes(
        k.i64(0),
        k.count,
        lambda i, w: k.store(k.b.fadd(k.load(x, i, w), k.load(y, i, w)), out, i),
    )


def _rms_norm(k: _Kernel, width: int, eps: float) -> None:
    """Per row: out = x / sqrt(mean(x^2) + eps) * w (the reference's order of operations)."""
    out, x, weight = k.ptrs
    b = k.b
    d = k.i64(width)

    def row(r: ir.Value) -> None:
        base = b.mul(r, d)
        acc = {w: b.alloca(_vt(w)) for w in (LANES, 1)}
        for w, slot in acc.items():
            b.store(_splat(w, 0.0), slot)

        def square(i: ir.Value, w: int) -> None:
            v = k.load(x, b.add(base, i), w)
            b.store(b.fadd(b.load(acc[w], typ=_vt(w)), b.fmul(v, v)), acc[w])

        k.lanes(k.i64(0), d, square)
        total = k.intrinsic(
            f"llvm.vector.reduce.fadd.v{LANES}f32",
            _F32,
            b.extract_element(b.load(acc[1], typ=_vt(1)), _I32(0)),
            b.load(acc[LANES], typ=_vt(LANES)),
            flags=("reassoc",),
        )
        ms = b.fadd(b.fdiv(total, ir.Constant(_F32, float(width))), ir.Constant(_F32, eps))
        inv = b.fdiv(ir.Constant(_F32, 1.0), k.intrinsic("llvm.sqrt.f32", _F32, ms))

        def scale(i: ir.Value, w: int) -> None:
            at = b.add(base, i)
            splat = b.shuffle_vector(
                b.insert_element(ir.Constant(_vt(1), None), inv, _I32(0)),
                ir.Constant(_vt(1), None),
                ir.Constant(ir.VectorType(_I32, w), [0] * w),
            )
            y = b.fmul(b.fmul(k.load(x, at, w), splat), k.load(weight, i, w))
            k.store(y, out, at)

        k.lanes(k.i64(0), d, scale)

    k.loop(k.i64(0), k.count, 1, row)


def _rope(k: _Kernel, n_heads: int, head_dim: int, rope_dim: int, neox: bool, stride: int) -> None:
    """Rotate each head's first ``rope_dim`` dims by the token's angles; NeoX pairs
    (i, i + rope_dim/2), the GGUF llama layout pairs (2i, 2i + 1); the rest is copied.
    The rows of ``x`` are ``stride`` floats apart (a column range of a wider buffer)."""
    out, x, pos, cos, sin = k.ptrs
    b = k.b
    half = k.i64(rope_dim // 2)

    def token(t: ir.Value) -> None:
        p = b.load(k.at(pos, t, _I64), typ=_I64)
        angle0 = b.mul(p, half)

        def head(h: ir.Value) -> None:
            base = b.mul(b.add(b.mul(t, k.i64(n_heads)), h), k.i64(head_dim))
            src = b.add(b.mul(t, k.i64(stride)), b.mul(h, k.i64(head_dim)))

            def pair(i: ir.Value, w: int) -> None:
                c = k.load(cos, b.add(angle0, i), w)
                s = k.load(sin, b.add(angle0, i), w)
                if neox:
                    ia, ib = b.add(base, i), b.add(b.add(base, half), i)
                    xa = k.load(x, b.add(src, i), w)
                    xb = k.load(x, b.add(b.add(src, half), i), w)
                else:
                    at = b.add(base, b.mul(i, k.i64(2)))
                    both = k.load(x, b.add(src, b.mul(i, k.i64(2))), 2 * w)
                    xa, xb = (
                        b.shuffle_vector(
                            both,
                            both,
                            ir.Constant(ir.VectorType(_I32, w), list(range(o, 2 * w, 2))),
                        )
                        for o in (0, 1)
                    )
                ya = b.fsub(b.fmul(xa, c), b.fmul(xb, s))
                yb = b.fadd(b.fmul(xb, c), b.fmul(xa, s))
                if neox:
                    k.store(ya, out, ia)
                    k.store(yb, out, ib)
                else:
                    mix = [j // 2 + (j % 2) * w for j in range(2 * w)]
                    k.store(
                        b.shuffle_vector(ya, yb, ir.Constant(ir.VectorType(_I32, 2 * w), mix)),
                        out,
                        at,
                    )

            k.lanes(k.i64(0), half, pair)
            if rope_dim < head_dim:
                k.lanes(
                    k.i64(rope_dim),
                    k.i64(head_dim),
                    lambda i, w: k.store(k.load(x, b.add(src, i), w), out, b.add(base, i)),
                )

        k.loop(k.i64(0), k.i64(n_heads), 1, head)

    k.loop(k.i64(0), k.count, 1, token)


_BUILDERS: dict[str, tuple[int, Callable[..., None]]] = {
    "add": (3, _add),
    "gated": (3, _gated),
    "rms_norm": (3, _rms_norm),
    "rope": (5, _rope),
}


@functools.cache
def _compiled(kind: str, **params: object) -> Callable[[int], None]:
    n_ptrs, build = _BUILDERS[kind]
    tag = hashlib.sha256(repr(sorted(params.items())).encode()).hexdigest()[:12]
    name = f"dynalm_ew_{kind}_{tag}"
    module = ir.Module(name=name)
    module.triple = str(jit.host_features()["triple"])
    k = _Kernel(module, name, n_ptrs)
    build(k, **params)
    k.finish()
    address = jit.compile_ir(str(module), [name])[name]
    return jit.cfunc(address, None, ctypes.c_void_p)


class BoundKernel(functools.partial):
    """A compiled kernel bound to its arrays: ``kernel()`` runs it (one ctypes call).

    ``block[0]`` is the count it runs over (rows, or elements for ``add``/``gated``);
    lowering it runs the kernel over a prefix of the bound rows, never beyond them.
    """

    block: np.ndarray  # int64 [1 + n_arrays]: the count, then the arrays' addresses
    arrays: tuple[np.ndarray, ...]  # kept alive while the kernel may run

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """This call as a ``pool.Program`` record."""
        return [(pool.PLAIN, ctypes.cast(self.func, ctypes.c_void_p).value, self.args[0], 0, 0)]


MAX_WORDS = 6  # the largest argument block (rope: count + 5 arrays)


def _bind(
    fn: Callable[[int], None], count: int, arrays: tuple[np.ndarray, ...], block: np.ndarray | None
) -> BoundKernel:
    words = [count, *(a.__array_interface__["data"][0] for a in arrays)]
    if block is None:
        block = np.empty(len(words), np.int64)
    check("argument block", block, np.int64, (None,))
    require(block.size >= len(words), f"argument block of {block.size} words, need {len(words)}")
    block[: len(words)] = words
    bound = BoundKernel(fn, block.__array_interface__["data"][0])
    bound.block, bound.arrays = block, arrays
    return bound


def _same(names: str, *arrays: np.ndarray) -> tuple[int, ...]:
    """Dense float32 arrays of one shape (the first one's), which is returned."""
    shape = arrays[0].shape
    for name, a in zip(names.split(), arrays, strict=True):
        check(name, a, np.float32, shape)
    return shape


def add(
    out: np.ndarray, x: np.ndarray, y: np.ndarray, block: np.ndarray | None = None
) -> BoundKernel:
    """``out = x + y`` (same shapes; ``out`` may be ``x`` or ``y``)."""
    _same("out x y", out, x, y)
    return _bind(_compiled("add"), out.size, (out, x, y), block)


def gated(
    out: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    activation: str,
    block: np.ndarray | None = None,
) -> BoundKernel:
    """``out = act(gate) * up`` with ``activation`` "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    _same("out gate up", out, gate, up)
    require(activation in ("silu", "gelu_tanh"), f"unknown gate activation {activation!r}")
    return _bind(_compiled("gated", activation=activation), out.size, (out, gate, up), block)


def rms_norm(
    out: np.ndarray,
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    block: np.ndarray | None = None,
) -> BoundKernel:
    """RMSNorm of each row of ``x [rows, width]`` scaled by ``weight [width]``."""
    rows, width = check("x", x, np.float32, (None, None)).shape
    check("out", out, np.float32, (rows, width))
    check("weight", weight, np.float32, (width,))
    require(math.isfinite(eps) and eps > 0, f"rms_norm epsilon {eps} is not a positive number")
    fn = _compiled("rms_norm", width=width, eps=float(np.float32(eps)))
    return _bind(fn, rows, (out, x, weight), block)


def rope(
    out: np.ndarray,
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    head_dim: int,
    rope_dim: int,
    neox: bool,
    block: np.ndarray | None = None,
) -> BoundKernel:
    """Rotary embedding of ``x [T, heads * head_dim]`` at ``positions [T]`` (int64) with
    angle tables ``cos``/``sin`` ``[max_position + 1, rope_dim / 2]``. The rows of ``x``
    may be strided (a view of some columns of a wider buffer). The caller keeps every
    position below the tables' length (the kernel cannot see it)."""
    require(
        0 < rope_dim <= head_dim and rope_dim % 2 == 0,
        f"rope over {rope_dim} of {head_dim} dimensions per head",
    )
    rows, width = check("out", out, np.float32, (None, None)).shape
    require(width % head_dim == 0, f"rows of {width} values are not heads of {head_dim}")
    check("x", x, np.float32, (rows, width), strided_rows=True)
    check("positions", positions, np.int64, (None,))
    require(len(positions) >= rows, f"{len(positions)} positions for {rows} rows")
    check("cos", cos, np.float32, (None, rope_dim // 2))
    check("sin", sin, np.float32, cos.shape)
    fn = _compiled(
        "rope",
        n_heads=width // head_dim,
        head_dim=head_dim,
        rope_dim=rope_dim,
        neox=neox,
        stride=x.strides[0] // 4,
    )
    return _bind(fn, rows, (out, x, positions, cos, sin), block)
