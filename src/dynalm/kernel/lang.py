"""The kernel language: one builder API in which every DynaLM kernel is written.

A kernel program is a Python function that builds LLVM IR through a :class:`Kernel`
(typed values from ``llvmlite.ir``, with the loops, vector shuffles, memory access,
reductions, prefetch and intrinsics kernels use) for a :class:`Target` -- the backend
(``kernel.backends``) that decides how the ISA-dependent primitives become instructions
(``dot_u8s8``: ``vpdpbusd`` on VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2, widened
integer IR on the portable twin; ``lookup16``: a 16-byte table looked up per byte,
``pshufb`` / ``tbl`` or compares and selects) and how many fp32 lanes a vector has. The same program
built for two targets computes the same integer sums and, where it says so, the same
float order; only the instructions differ.

:class:`Module` collects a program's functions and is compiled once by ``kernel.jit``.

Values are ``llvmlite.ir`` values; arithmetic is ``k.b`` (the ``IRBuilder``) or the
helpers here, which also accept Python numbers where a constant of the other operand's
type is meant (``k.add(i, 8)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import llvmlite.ir as ir

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F16, F32 = ir.HalfType(), ir.FloatType()
PTR = ir.PointerType()
VOID = ir.VoidType()

Number = int | float
Operand = ir.Value | Number
Values = list[ir.Value]
# A warp-collective primitive's operands: lane index -> that lane's registers (see
# ``Backend.mma_s8u8``)
Fragment = Callable[[ir.Value], tuple[ir.Value, ...]]


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def elem_of(ty: ir.Type) -> ir.Type:
    return ty.element if isinstance(ty, ir.VectorType) else ty


def is_float(ty: ir.Type) -> bool:
    return isinstance(elem_of(ty), ir.types._BaseFloatType)


def const(ty: ir.Type, value: Number | Sequence[Number]) -> ir.Constant:
    """A constant of ``ty``; a number for a vector type is splatted to every lane."""
    if isinstance(ty, ir.VectorType) and not isinstance(value, Sequence):
        value = [value] * ty.count
    return ir.Constant(ty, value)


class Target(Protocol):
    """What a program asks of its backend (see ``kernel.backends.Backend``)."""

    name: str
    lanes: int  # fp32 lanes per vector register
    signed_dot: bool  # whether signed weights take ``dot_s8s8`` (else ``sign_of`` + dot_u8s8)

    def u8_dot_exact(self, bound: int) -> bool: ...

    def dot_u8s8(self, k: Kernel, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value: ...

    def dot_s8s8(self, k: Kernel, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value: ...

    def pair_products(self, k: Kernel, u: ir.Value, s: ir.Value) -> ir.Value: ...

    def pair_sums(self, k: Kernel, v: ir.Value) -> ir.Value: ...

    def sign_of(self, k: Kernel, x: ir.Value, q: ir.Value) -> ir.Value: ...

    def lookup16(self, k: Kernel, table: Sequence[int], idx: ir.Value) -> ir.Value: ...

    # Warp-collective (the NVPTX backend and its twin, ``warps``): a warp's int8 tile
    # product, each lane's operands a function of its lane index (``Backend.mma_s8u8``),
    # inside a warp-cooperative function ``f(args, lo, hi, lane)`` (``nvptx``'s entries).
    warps: bool

    def mma_s8u8(self, k: Kernel, lane: ir.Value, fragment: Fragment, acc: Values) -> Values: ...


class Module:
    """The functions of one program, built for one target, compiled together."""

    def __init__(self, name: str, target: Target, triple: str) -> None:
        self.ir = ir.Module(name=name)
        self.ir.triple = triple
        self.target = target
        self.names: list[str] = []

    def kernel(
        self, name: str, params: Sequence[ir.Type], *, ret: ir.Type = VOID, private: bool = False
    ) -> Kernel:
        """A new function ``ret name(params)`` (``void`` unless ``ret``); exported (named in
        ``names``) unless ``private``."""
        fn = ir.Function(self.ir, ir.FunctionType(ret, list(params)), name)
        if private:
            fn.linkage = "private"
        else:
            self.names.append(name)
        return Kernel(self, fn)

    def function(self, name: str) -> ir.Function:
        return self.ir.globals[name]

    def declare(
        self, name: str, ret: ir.Type, params: Sequence[ir.Type], *, var_arg: bool = False
    ) -> ir.Function:
        """An external function (a symbol the JIT resolves), e.g. a C varargs function."""
        return ir.Function(self.ir, ir.FunctionType(ret, list(params), var_arg=var_arg), name)

    def text(self) -> str:
        return str(self.ir)


class Var:
    """A mutable local (a stack slot in the entry block; ``mem2reg`` makes it SSA)."""

    def __init__(self, k: Kernel, init: ir.Value) -> None:
        self._k = k
        with k.b.goto_entry_block():
            self.slot = k.b.alloca(init.type)
        k.b.store(init, self.slot)

    def get(self) -> ir.Value:
        return self._k.b.load(self.slot)

    def set(self, value: ir.Value) -> None:
        self._k.b.store(value, self.slot)


class Kernel:
    """Builds one function. ``args`` are its parameters; ``b`` the ``IRBuilder``."""

    def __init__(self, module: Module, fn: ir.Function) -> None:
        self.module, self.fn, self.target = module, fn, module.target
        entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(entry)
        self.args = list(fn.args)

    def ret(self, value: ir.Value | None = None) -> None:
        """Return ``value`` (nothing from a ``void`` function)."""
        if value is None:
            self.b.ret_void()
        else:
            self.b.ret(value)

    # -- constants and operands ---------------------------------------------------------
    @staticmethod
    def i64(v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    @staticmethod
    def like(value: ir.Value, x: Operand) -> ir.Value:
        """``x`` as an operand of ``value``'s type (numbers become constants)."""
        return x if isinstance(x, ir.Value) else const(value.type, x)

    def splat(self, x: Operand, n: int, elem: ir.Type | None = None) -> ir.Value:
        """``x`` in all ``n`` lanes of a vector."""
        if not isinstance(x, ir.Value):
            return const(vec(elem or F32, n), x)
        one = self.b.insert_element(ir.Constant(vec(x.type, 1), None), x, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(one.type, None), const(vec(I32, n), 0))

    # -- integer and float arithmetic taking numbers for constants ----------------------
    def add(self, a: ir.Value, x: Operand) -> ir.Value:
        x = self.like(a, x)
        return self.b.fadd(a, x) if is_float(a.type) else self.b.add(a, x)

    def sub(self, a: ir.Value, x: Operand) -> ir.Value:
        x = self.like(a, x)
        return self.b.fsub(a, x) if is_float(a.type) else self.b.sub(a, x)

    def mul(self, a: ir.Value, x: Operand) -> ir.Value:
        x = self.like(a, x)
        return self.b.fmul(a, x) if is_float(a.type) else self.b.mul(a, x)

    def and_(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.and_(a, self.like(a, x))

    def or_(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.or_(a, self.like(a, x))

    def shl(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.shl(a, self.like(a, x))

    def lshr(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.lshr(a, self.like(a, x))

    def udiv(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.udiv(a, self.like(a, x))

    def lt(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.icmp_signed("<", a, self.like(a, x))

    def ge(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.b.icmp_signed(">=", a, self.like(a, x))

    def select(self, cond: ir.Value, a: Operand, x: Operand) -> ir.Value:
        a = a if isinstance(a, ir.Value) else self.like(x, a)
        return self.b.select(cond, a, self.like(a, x))

    def smin(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.call(f"llvm.smin.{_suffix(a.type)}", a.type, a, self.like(a, x))

    def smax(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.call(f"llvm.smax.{_suffix(a.type)}", a.type, a, self.like(a, x))

    def fmin(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.call(f"llvm.minnum.{_suffix(a.type)}", a.type, a, self.like(a, x))

    def fmax(self, a: ir.Value, x: Operand) -> ir.Value:
        return self.call(f"llvm.maxnum.{_suffix(a.type)}", a.type, a, self.like(a, x))

    def fma(self, a: ir.Value, x: ir.Value, acc: ir.Value) -> ir.Value:
        """``a * x + acc`` (one rounding where the target has FMA)."""
        return self.call(f"llvm.fmuladd.{_suffix(a.type)}", a.type, a, x, acc)

    def total(self, values: Sequence[ir.Value]) -> ir.Value:
        """``values[0] + values[1] + ...`` in that order."""
        out = values[0]
        for v in values[1:]:
            out = self.add(out, v)
        return out

    def reduce(self, op: str, v: ir.Value) -> ir.Value:
        """All lanes of ``v`` combined by ``op`` ("add", "fadd" in any order, "fmax")."""
        ty = v.type
        name = f"llvm.vector.reduce.{op}.{_suffix(ty)}"
        if op == "fadd":
            return self.call(name, ty.element, ir.Constant(ty.element, 0.0), v, flags=("reassoc",))
        return self.call(name, ty.element, v)

    def halving_sum(self, v: ir.Value) -> ir.Value:
        """The lanes of ``v`` summed by halves (lanes i and i + n/2 first, down to one):
        the same order on every target, where a reassociating ``reduce("fadd")`` lets
        each target choose (x86 sums halves, AArch64 adjacent pairs)."""
        while v.type.count > 1:
            n = v.type.count // 2
            v = self.add(self.part(v, 0, n), self.part(v, n, n))
        return self.b.extract_element(v, ir.Constant(I32, 0))

    def convert(self, v: ir.Value, elem: ir.Type, *, signed: bool = True) -> ir.Value:
        """Lane-wise conversion of ``v`` to ``elem`` (widen, narrow, int <-> float)."""
        ty = vec(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem
        src_float, dst_float = is_float(v.type), is_float(ty)
        b = self.b
        if src_float and dst_float:
            wider = _bits(elem) > _bits(elem_of(v.type))
            return b.fpext(v, ty) if wider else b.fptrunc(v, ty)
        if src_float:
            return b.fptosi(v, ty) if signed else b.fptoui(v, ty)
        if dst_float:
            return b.sitofp(v, ty) if signed else b.uitofp(v, ty)
        if _bits(elem) > _bits(elem_of(v.type)):
            return b.sext(v, ty) if signed else b.zext(v, ty)
        return b.trunc(v, ty)

    def bitcast(self, v: ir.Value, ty: ir.Type) -> ir.Value:
        return self.b.bitcast(v, ty)

    def nan_to_zero(self, x: ir.Value) -> ir.Value:
        """``x`` with NaN lanes 0: before a conversion to an integer, which is undefined
        for NaN."""
        return self.b.select(self.b.fcmp_ordered("ord", x, x), x, const(x.type, 0.0))

    def magnitude_bits(self, v: ir.Value) -> ir.Value:
        """``|v|``'s bit patterns as int32 lanes. They order non-negative floats as their
        values do and put inf, then NaN, above every finite one: their integer maximum
        (``smax``, exact in any order; ``bitcast`` back to f32) is the largest magnitude,
        a NaN kept (``maxnum`` drops one, and a vector ``fmax`` reduction lowers to a chain
        of scalar maxima and NaN tests on x86)."""
        ints = vec(I32, v.type.count) if isinstance(v.type, ir.VectorType) else I32
        return self.bitcast(self.call(f"llvm.fabs.{_suffix(v.type)}", v.type, v), ints)

    def call(self, name: str, ret: ir.Type, *args: ir.Value, flags: Sequence[str] = ()) -> ir.Value:
        """Call the intrinsic or function ``name`` (declared on first use)."""
        fn = self.module.ir.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module.ir, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args, fastmath=tuple(flags))

    def call_at(self, fn: ir.Value, ret: ir.Type, *args: ir.Value) -> ir.Value:
        """Call the function whose address is the pointer ``fn`` (``ret fn(args)``)."""
        return self.b.call(_Callee(fn, ir.FunctionType(ret, [a.type for a in args])), args)

    # -- vectors ------------------------------------------------------------------------
    def shuffle(self, a: ir.Value, idx: Sequence[int], x: ir.Value | None = None) -> ir.Value:
        """Lanes ``idx`` of ``a`` (then ``x``'s lanes, numbered after ``a``'s)."""
        other = x if x is not None else ir.Constant(a.type, None)
        return self.b.shuffle_vector(a, other, const(vec(I32, len(idx)), list(idx)))

    def part(self, v: ir.Value, lo: int, count: int) -> ir.Value:
        """Lanes ``lo .. lo + count`` of ``v``."""
        return self.shuffle(v, range(lo, lo + count))

    def lane(self, v: ir.Value, i: int | ir.Value, width: int) -> ir.Value:
        """Lane ``i`` of ``v`` broadcast to ``width`` lanes."""
        if isinstance(i, int):
            return self.shuffle(v, [i] * width)
        return self.splat(self.b.extract_element(v, i), width)

    def concat(self, parts: Sequence[ir.Value]) -> ir.Value:
        """Equal-width vectors joined into one (pairwise, so a power-of-two count)."""
        parts = list(parts)
        while len(parts) > 1:
            n = parts[0].type.count
            parts = [
                self.shuffle(a, range(2 * n), x)
                for a, x in zip(parts[::2], parts[1::2], strict=True)
            ]
        return parts[0]

    # -- memory -------------------------------------------------------------------------
    def at(self, base: ir.Value, offset: Operand) -> ir.Value:
        """``base + offset`` bytes."""
        if isinstance(offset, int) and offset == 0:
            return base
        off = offset if isinstance(offset, ir.Value) else self.i64(offset)
        return self.b.gep(base, [off], source_etype=I8)

    def index(self, base: ir.Value, i: Operand, elem: ir.Type) -> ir.Value:
        """The address of ``base[i]``, ``base`` an array of ``elem``."""
        return self.b.gep(base, [self.like(self.i64(0), i)], source_etype=elem)

    def load(self, ty: ir.Type, base: ir.Value, offset: Operand = 0, align: int = 1) -> ir.Value:
        return self.b.load(self.at(base, offset), typ=ty, align=align)

    def store(self, value: ir.Value, base: ir.Value, offset: Operand = 0, align: int = 1) -> None:
        self.b.store(value, self.at(base, offset), align=align)

    def load_atomic(
        self, ty: ir.Type, base: ir.Value, offset: Operand, ordering: str, align: int
    ) -> ir.Value:
        """An atomic load (``ordering``: "monotonic", "acquire", "seq_cst", ...)."""
        return self.b.load_atomic(self.at(base, offset), ordering, align, typ=ty)

    def store_atomic(
        self, value: ir.Value, base: ir.Value, offset: Operand, ordering: str, align: int
    ) -> None:
        """An atomic store (``IRBuilder.store_atomic`` wants typed pointers)."""
        at = self.at(base, offset)
        self.b._insert(ir.instructions.StoreAtomicInstr(self.b.block, value, at, ordering, align))

    def stack(self, nbytes: int, *, zeroed: bool = False) -> ir.Value:
        """``nbytes`` of 64-byte aligned stack memory for the whole call (allocated, and
        zeroed if asked, in the entry block)."""
        with self.b.goto_entry_block():
            slot = self.b.alloca(ir.ArrayType(I8, nbytes))
            slot.align = 64
            if zeroed:
                self.b.store(ir.Constant(slot.allocated_type, None), slot, align=64)
            # as an untyped pointer, like every other address kernels compute with
            return self.b.inttoptr(self.b.ptrtoint(slot, I64), PTR)

    def words(self, block: ir.Value, n: int) -> list[ir.Value]:
        """The first ``n`` int64 words of an argument block."""
        return [self.load(I64, block, 8 * i, 8) for i in range(n)]

    def pointer(self, word: ir.Value) -> ir.Value:
        return self.b.inttoptr(word, PTR)

    def prefetch(self, base: ir.Value, ahead: Operand, nbytes: int) -> None:
        """Prefetch the ``nbytes`` at ``base + ahead`` into all cache levels (streamed
        weights: the hardware prefetcher alone keeps too little in flight)."""
        at = self.at(base, ahead)
        for line in range(0, nbytes, 64):
            self.call(
                "llvm.prefetch.p0",
                VOID,
                self.at(at, line),
                ir.Constant(I32, 0),
                ir.Constant(I32, 3),
                ir.Constant(I32, 1),
            )

    # -- control flow -------------------------------------------------------------------
    def var(self, init: Operand, ty: ir.Type = I64) -> Var:
        return Var(self, init if isinstance(init, ir.Value) else const(ty, init))

    def loop(
        self,
        start: Operand,
        stop: ir.Value | int,
        step: int,
        body: Callable[[ir.Value], None],
        *,
        partial: bool = False,
    ) -> ir.Value:
        """``for i = start; i + step <= stop; i += step: body(i)`` -- whole steps only;
        with ``partial`` while ``i < stop`` (a last, shorter step runs too). Returns the
        final ``i`` (where a loop over the rest starts)."""
        b = self.b
        start = start if isinstance(start, ir.Value) else self.i64(start)
        stop = stop if isinstance(stop, ir.Value) else self.i64(stop)
        pre = b.block
        head, blk, end = (b.append_basic_block() for _ in range(3))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(start, pre)
        nxt = b.add(i, self.i64(step))
        go = b.icmp_signed("<", i, stop) if partial else b.icmp_signed("<=", nxt, stop)
        b.cbranch(go, blk, end)
        b.position_at_end(blk)
        body(i)
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(end)
        return i

    def lanes(
        self, start: ir.Value, stop: ir.Value, width: int, body: Callable[[ir.Value, int], None]
    ) -> None:
        """``body(i, w)`` over ``[start, stop)`` in ``width``-wide steps, then 1-wide."""
        rest = self.loop(start, stop, width, lambda i: body(i, width))
        self.loop(rest, stop, 1, lambda i: body(i, 1))

    def branch(
        self, cond: ir.Value, then: Callable[[], None], otherwise: Callable[[], None] | None = None
    ) -> None:
        """``if cond: then() else: otherwise()``."""
        if otherwise is None:
            with self.b.if_then(cond):
                then()
            return
        with self.b.if_else(cond) as (yes, no):
            with yes:
                then()
            with no:
                otherwise()

    # -- numeric building blocks --------------------------------------------------------
    def exp(self, x: ir.Value) -> ir.Value:
        """e**x of f32 lanes (a scalar or a vector): x = n ln2 + r, |r| <= ln2/2, a degree-6
        polynomial of r times 2**n (Cephes; about 1 ulp; inputs clamped to the normal range).
        NaN stays NaN, as numpy's: the clamps compare (``maxnum`` would have made it
        e**-87.3), and its 2**n is built from n = 0 (converting NaN is undefined)."""
        ty = x.type
        lo, hi = const(ty, -87.33654), const(ty, 88.37626)
        x = self.b.select(self.b.fcmp_ordered("<", x, lo), lo, x)
        x = self.b.select(self.b.fcmp_ordered(">", x, hi), hi, x)
        n = self.call(f"llvm.rint.{_suffix(ty)}", ty, self.mul(x, 1.4426950408889634))
        r = self.sub(x, self.mul(n, 0.693359375))
        r = self.sub(r, self.mul(n, -2.12194440e-4))
        p = const(ty, 1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5):
            p = self.add(self.mul(p, r), c)
        p = self.add(self.add(self.mul(p, self.mul(r, r)), r), 1.0)
        bits = self.shl(self.add(self.convert(self.nan_to_zero(n), I32), 127), 23)
        return self.mul(p, self.bitcast(bits, ty))

    def tanh(self, x: ir.Value) -> ir.Value:
        """tanh of f32 lanes as sign(x) (1 - e) / (1 + e), e = exp(-2|x|) (``exp``), which
        cannot overflow; within a few ulps of 1 absolutely (the cancellation near 0)."""
        ty = x.type
        e = self.exp(self.mul(self.call(f"llvm.fabs.{_suffix(ty)}", ty, x), -2.0))
        t = self.b.fdiv(self.sub(const(ty, 1.0), e), self.add(e, 1.0))
        return self.call(f"llvm.copysign.{_suffix(ty)}", ty, t, x)


class _Callee:
    """A pointer called as a function of type ``function_type`` (what ``IRBuilder.call``
    asks of its callee; a pointer value alone has no function type)."""

    def __init__(self, ptr: ir.Value, function_type: ir.FunctionType) -> None:
        self.ptr, self.type, self.function_type = ptr, ptr.type, function_type

    def get_reference(self) -> str:
        return self.ptr.get_reference()


def _bits(ty: ir.Type) -> int:
    if isinstance(ty, ir.IntType):
        return ty.width
    return {"half": 16, "float": 32, "double": 64}[str(ty)]


def _suffix(ty: ir.Type) -> str:
    """An intrinsic's type suffix: ``v8f32``, ``i64``, ``v32i8``."""
    elem = elem_of(ty)
    name = f"i{elem.width}" if isinstance(elem, ir.IntType) else f"f{_bits(elem)}"
    return f"v{ty.count}{name}" if isinstance(ty, ir.VectorType) else name
