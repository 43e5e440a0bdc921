"""Backends: how a kernel program becomes machine code for one target.

A backend is ``name``, ``capabilities()`` and ``lower(program, spec) -> Executable``. It
fixes the vector width programs are written for (``lanes`` fp32 lanes) and lowers the
ISA-dependent primitives of ``kernel.lang``:

==============  =====  ===========================================  =====================
backend         lanes  int8 dot (u8 x s8, 4 products per i32 lane)  needs (LLVM features)
==============  =====  ===========================================  =====================
x86-amx         16     ``tdpbsud`` tiles for batches of >= 16 rows,  x86-avx512's +
                       else as x86-avx512                            amx-tile/int8
x86-avx512      16     ``vpdpbusd`` (AVX-512 VNNI)                   avx512f/bw/vl/vnni
x86-avx2        8      ``vpmaddubsw`` + ``vpmaddwd``                 avx2, fma, f16c
aarch64-neon-   8      ``sdot`` (signed weights straight, unsigned   an aarch64 CPU with
dotprod                ones < 128 as they are)                       neon, dotprod
aarch64-neon    8      widened integer IR (``smull``/``umull`` +     an aarch64 CPU
                       ``saddlp``)
generic         8      widened integer IR (any LLVM target)          --
==============  =====  ===========================================  =====================

The AArch64 backends keep 8 fp32 lanes (two NEON registers per vector): the auto kernels'
lane layout, integer sums and float order are then those of x86-avx2 and generic, so
``auto`` is bitwise the same on every CPU. On another host they are cross-compiled for
``aarch64-unknown-linux-gnu`` (``kernel.cross``) and tested under ``qemu-aarch64``.

Every backend has a *portable twin* (``backend.twin()``): the same program at the same
width with the primitives written as plain integer IR (a tile product as a loop of
4-byte dots). Integer sums are exact, so a twin computes bitwise what its backend
computes; the tests run each backend's twin on any host and the native instructions
where the host has them.

Selection (``select``) takes the best backend the host supports, or the one named by
``$DYNALM_ISA`` (``amx``, ``avx512``, ``avx2``, ``neon-dotprod``, ``neon``, ``generic``) --
refused, naming the missing features, where the host cannot run it natively. AMX also needs Linux's
permission to use tile state (``jit.amx_permission``); where it is refused the host's best
is x86-avx512 and the reason is shown.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

import llvmlite.ir as ir

from dynalm.kernel import jit
from dynalm.kernel.lang import I8, I16, I32, VOID, Fragment, Kernel, Module, Values, const, vec

Spec = Mapping[str, object]  # the values a program is specialised on (shapes, format, ...)


@dataclass(frozen=True)
class Program:
    """A kernel program: ``build(module, **spec)`` adds its functions to ``module``."""

    name: str
    build: Callable[..., None]


@dataclass(frozen=True)
class Executable:
    """A lowered program: its exported functions' addresses (by name, without the
    module's prefix), and how long lowering took (0 when loaded from the disk cache)."""

    addresses: dict[str, int]
    compile_seconds: float

    def cfunc(self, name: str, *argtypes: type) -> ctypes._CFuncPtr:
        return jit.cfunc(self.addresses[name], None, *argtypes)


@dataclass(frozen=True)
class Backend:
    name: str
    isa: str  # the short name ``$DYNALM_ISA`` takes
    lanes: int
    requires: tuple[str, ...] = ()
    int8_dot: str = "widened integer IR"
    accumulate: str = "int16"  # where auto kernels sum byte products: "int16" pairs or "int32"
    native: bool = True
    vector_isa: str | None = None  # the intrinsics lowered: "avx2", "avx512", "neon-dotprod"
    tiles: bool = False  # int8 tile products (AMX) for tall batches
    # Warp-cooperative int8 tile products (``mma_s8u8``: the NVPTX backend's tensor-core
    # ``mma`` on sm_80+, and its twin) for batches of >= MMA_ROWS rows.
    warps: bool = False
    # Signed weights dot straight into int32 (``dot_s8s8``) instead of their magnitudes
    # against sign-moved activations (``sdot`` has no u8 x s8 form).
    signed_dot: bool = False
    # The auto prefill tile (activation rows, row groups of ``lanes`` weight rows) where a
    # wider one pays (``matmul_programs.buckets``); () for none.
    wide: tuple[int, ...] = ()
    machine: str | None = None  # the CPU architecture of its native code (None: any)
    cross_cpu: str = ""  # LLVM's CPU and features when cross-compiled (``kernel.cross``)
    cross_features: str = ""
    # Host LLVM features its native code is built without, so that a host with more builds
    # what a CPU with only ``requires`` runs (x86-avx2 on an AVX-512 host: no EVEX, 16
    # registers; its figures there are an AVX2 CPU's).
    host_off: str = ""
    _lowered: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def capabilities(self) -> dict[str, object]:
        missing = self.missing()
        return {
            "backend": self.name,
            "fp32_lanes": self.lanes,
            "int8_dot": self.int8_dot if self.native else "widened integer IR (twin)",
            "native": self.native,
            "runs_here": not missing,
            "missing": missing,
        }

    def missing(self) -> list[str]:
        """Host features this backend's native instructions need and the host lacks."""
        if not self.native:
            return []
        if self.machine and jit.host_machine() != self.machine:
            return [f"{self.machine} (host is {jit.host_machine()})"]
        have = jit.host_flags()
        missing = [f for f in self.requires if not have.get(f, False)]
        if self.tiles and not missing:
            refused = jit.amx_permission()
            missing += [refused] if refused else []
        return missing

    def twin(self) -> Backend:
        """The same width with portable primitives: same integer sums, any host."""
        return Backend(
            f"{self.name}-twin",
            self.isa,
            self.lanes,
            accumulate=self.accumulate,
            native=False,
            tiles=self.tiles,
            warps=self.warps,
            signed_dot=self.signed_dot,
            wide=self.wide,
        )

    def lower(self, program: Program, spec: Spec) -> Executable:
        """Build ``program`` for this backend, specialised on ``spec``; compile (or load
        from the disk cache) once per process."""
        key = (program.name, tuple(sorted(spec.items())))
        done = self._lowered.get(key)
        if done is not None:
            return done
        if self.triple() != jit.triple():
            raise BackendUnavailable(
                f"{self.name} code cannot run on this {jit.host_machine()} host "
                "(kernel.cross compiles it to object files for another machine)"
            )
        module = self.module(program, spec)
        addresses, seconds = jit.compile_module(module.text(), module.names, self.host_off)
        return self._done(key, module.ir.name, addresses, seconds)

    def lowered(self, program: Program, spec: Spec) -> bool:
        """Whether ``lower(program, spec)`` is done (costs nothing now)."""
        return (program.name, tuple(sorted(spec.items()))) in self._lowered

    def _done(
        self, key: tuple, prefix: str, addresses: dict[str, int], seconds: float
    ) -> Executable:
        short = {
            n.removeprefix(prefix + "_") if n != prefix else "": a for n, a in addresses.items()
        }
        done = self._lowered[key] = Executable(short, seconds)
        return done

    def module(self, program: Program, spec: Spec) -> Module:
        """``program`` built for this backend, specialised on ``spec`` (not compiled)."""
        key = (program.name, tuple(sorted(spec.items())))
        tag = hashlib.sha256(repr((self.name, key)).encode()).hexdigest()[:12]
        module = Module(f"dynalm_{program.name}_{tag}", self, self.triple())
        program.build(module, **spec)
        return module

    def triple(self) -> str:
        """The target triple modules are built for: the host's, or (for another CPU
        architecture's backend) that architecture's Linux triple, cross-compiled."""
        if not self.native or self.machine in (None, jit.host_machine()):
            return jit.triple()
        return f"{self.machine}-unknown-linux-gnu"

    # -- the ISA-dependent primitives ---------------------------------------------------
    def _x86(self) -> str | None:
        """The x86 intrinsic family to use: "avx2", "avx512" or None (portable IR)."""
        isa = self.vector_isa if self.native else None
        return isa if isa in ("avx2", "avx512") else None

    def _has_sdot(self) -> bool:
        return self.native and self.vector_isa == "neon-dotprod"

    def pair_products(self, k: Kernel, u: ir.Value, s: ir.Value) -> ir.Value:
        """Unsigned bytes ``u`` times signed bytes ``s``, adjacent products summed to
        int16 (the caller keeps the sums far from saturation)."""
        n = u.type.count
        isa = self._x86()
        if isa:
            name = (
                "llvm.x86.avx2.pmadd.ub.sw" if isa == "avx2" else "llvm.x86.avx512.pmaddubs.w.512"
            )
            return k.call(name, vec(I16, n // 2), u, s)
        prod = k.b.mul(k.convert(u, I16, signed=False), k.convert(s, I16))
        return k.b.add(k.shuffle(prod, range(0, n, 2)), k.shuffle(prod, range(1, n, 2)))

    def pair_sums(self, k: Kernel, v: ir.Value) -> ir.Value:
        """int16 lanes -> int32, adjacent lanes summed."""
        n = v.type.count
        isa = self._x86()
        if isa:
            name = "llvm.x86.avx2.pmadd.wd" if isa == "avx2" else "llvm.x86.avx512.pmaddw.d.512"
            return k.call(name, vec(I32, n // 2), v, const(v.type, 1))
        wide = k.convert(v, I32)
        return k.b.add(k.shuffle(wide, range(0, n, 2)), k.shuffle(wide, range(1, n, 2)))

    def dot_u8s8(self, k: Kernel, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value:
        """``acc`` (int32 lanes) plus, per lane, the sum of its 4 ``u`` x ``s`` byte
        products, exactly (``vpdpbusd``)."""
        n = acc.type.count
        if self._x86() == "avx512":
            args = [k.bitcast(x, vec(I32, n)) for x in (u, s)]
            return k.call("llvm.x86.avx512.vpdpbusd.512", acc.type, acc, *args)
        if self._x86() == "avx2":  # exact while u <= 128: two products < 2**15 per int16
            return k.b.add(acc, self.pair_sums(k, self.pair_products(k, u, s)))
        if self._has_sdot():  # exact while u <= 127 (sdot reads it signed; see ``signed_dot``)
            return _sdot(k, acc, u, s)
        return _quad_sums(k, acc, u, s, u_signed=False)

    def u8_dot_exact(self, bound: int) -> bool:
        """Whether ``dot_u8s8`` sums unsigned bytes up to ``bound`` exactly: always into
        int32 lanes (``vpdpbusd``, the widened IR); ``sdot`` reads them signed (< 128); int16
        pairs hold two products of at most 127 in magnitude (``vpmaddubsw`` saturates)."""
        if self._has_sdot():
            return bound <= 127
        return self.accumulate == "int32" or 2 * bound * 127 <= 32767

    def dot_s8s8(self, k: Kernel, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value:
        """``acc`` plus, per int32 lane, the sum of its 4 signed byte products ``a`` x
        ``s``, exactly (``sdot``; for backends with ``signed_dot``)."""
        return _sdot(k, acc, a, s) if self._has_sdot() else _quad_sums(k, acc, a, s, u_signed=True)

    def sign_of(self, k: Kernel, x: ir.Value, q: ir.Value) -> ir.Value:
        """``x`` negated where ``q < 0`` and zeroed where ``q == 0`` (``|q| * result ==
        q * x``: a signed weight's sign moves onto the activation, as the unsigned-by-
        signed byte products want)."""
        if self._x86() == "avx2":
            return k.call("llvm.x86.avx2.psign.b", x.type, x, q)
        zero = ir.Constant(x.type, None)
        flipped = k.b.select(k.b.icmp_signed("<", q, zero), k.b.sub(zero, x), x)
        return k.b.select(k.b.icmp_signed("==", q, zero), zero, flipped)

    def lookup16(self, k: Kernel, table: Sequence[int], idx: ir.Value) -> ir.Value:
        """``table[i]`` for each byte ``i`` (0..15) of ``idx`` (``<n x i8>``, ``n`` a
        multiple of 16; ``table``: 16 byte values, signed or unsigned): ``pshufb`` on x86
        (the table in each 128-bit lane), ``tbl`` on AArch64; elsewhere, and on the twins,
        a compare and a select per entry. The same bytes either way."""
        n = idx.type.count
        values = [t - 256 if t > 127 else t for t in table]
        isa = self._x86()
        if isa or (self.native and self.machine == "aarch64"):
            step = 64 if isa == "avx512" and n % 64 == 0 else 32 if isa and n % 32 == 0 else 16
            name = _LOOKUP[isa or "neon"][step]
            tab = const(vec(I8, step), values * (step // 16))
            parts = [k.call(name, vec(I8, step), tab, k.part(idx, lo, step))
                     for lo in range(0, n, step)]  # fmt: skip
            return k.concat(parts)
        out = const(idx.type, values[0])
        for v in range(1, 16):
            hit = k.b.icmp_unsigned("==", idx, const(idx.type, v))
            out = k.b.select(hit, const(idx.type, values[v]), out)
        return out

    # -- int8 tile products (x86-amx) -----------------------------------------------------
    # A tile product multiplies TILE_ROWS rows of 32 signed bytes (A, rows ``a_stride``
    # apart) by 8 rows of 64 unsigned bytes (B: row r holds 4 bytes for each of 16 columns,
    # the VNNI order), C[m][n] = sum over r, i of A[m][4r + i] * B[r][4n + i], as TILE_ROWS
    # rows of 16 int32 (``tdpbsud``). Tile registers: 0 for A, then the Bs, then the Cs
    # (the Bs share register 1 where there are too many to keep apart).

    def tile_begin(self, k: Kernel, products: int) -> None:
        """Configure the tile registers for ``products`` tile products per A (``ldtilecfg``;
        nothing on the twin)."""
        if not self.native:
            return
        b_regs, c_regs = _tile_registers(products)
        shapes = {0: (TILE_ROWS, 32), **{r: (8, 64) for r in b_regs}}
        shapes.update({r: (TILE_ROWS, 64) for r in c_regs})
        config = [0] * 64
        config[0] = 1  # palette 1
        for reg, (rows, row_bytes) in shapes.items():
            config[16 + 2 * reg : 18 + 2 * reg] = row_bytes.to_bytes(2, "little")
            config[48 + reg] = rows
        at = k.stack(64)
        k.store(const(vec(I8, 64), config), at, 0, 64)
        k.call("llvm.x86.ldtilecfg", VOID, at)

    def tile_end(self, k: Kernel) -> None:
        if self.native:
            k.call("llvm.x86.tilerelease", VOID)

    def tile_products(
        self, k: Kernel, a: ir.Value, a_stride: ir.Value, bs: list[ir.Value], cs: list[ir.Value]
    ) -> None:
        """For each B ``bs[i]`` (rows 64 bytes apart), C = A x B stored at ``cs[i]`` (rows 64
        bytes apart)."""
        if self.native:
            b_regs, c_regs = _tile_registers(len(bs))
            reg = lambda r: ir.Constant(I8, r)  # noqa: E731
            k.call("llvm.x86.tileloadd64", VOID, reg(0), a, a_stride)
            for b_reg, c_reg, b, c in zip(b_regs, c_regs, bs, cs, strict=True):
                k.call("llvm.x86.tilezero", VOID, reg(c_reg))
                k.call("llvm.x86.tileloadd64", VOID, reg(b_reg), b, k.i64(64))
                k.call("llvm.x86.tdpbsud", VOID, reg(c_reg), reg(0), reg(b_reg))
                k.call("llvm.x86.tilestored64", VOID, reg(c_reg), c, k.i64(64))
            return
        acc_ty = vec(I32, 16)

        def row(m: ir.Value) -> None:
            a_row = k.at(a, k.mul(m, a_stride))
            for b, c in zip(bs, cs, strict=True):
                acc = ir.Constant(acc_ty, None)
                for r in range(8):
                    x4 = k.bitcast(k.splat(k.load(I32, a_row, 4 * r), 16), vec(I8, 64))
                    acc = _quad_sums(k, acc, k.load(vec(I8, 64), b, 64 * r), x4, u_signed=False)
                k.store(acc, c, k.mul(m, 64))

        k.loop(0, TILE_ROWS, 1, row)

    # -- warp-collective int8 tile products (NVPTX mma) -----------------------------------
    def mma_s8u8(self, k: Kernel, lane: ir.Value, fragment: Fragment, acc: Values) -> Values:
        """One warp's D = A x B + C, A 16 x 16 signed bytes (rows: activation rows), B
        16 x 8 unsigned bytes (columns: weight rows), C and D 16 x 8 int32, exactly: PTX's
        ``mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32``, whose fragments (PTX ISA,
        "Matrix Fragments for mma.m16n8k16 with integer type") are, for lane ``l``, group
        ``g = l >> 2`` and ``q = l & 3``: ``fragment(l) = (a0, a1, b)``, each an i32 of 4
        bytes (the first in the low byte), a0 = A[g][4q .. 4q+3], a1 = A[g+8][4q .. 4q+3],
        b = B[4q .. 4q+3][g]; ``acc`` and the result are the lane's C and D elements
        [g][2q], [g][2q+1], [g+8][2q], [g+8][2q+1].

        A warp-collective operation with its operands given as a function of the lane:
        ``fragment`` must compute lane ``l``'s registers from ``l`` and values that are the
        same on every lane of the warp (loads, no stores). The NVPTX backend calls it once
        (its own lane) and the warp exchanges the registers; this portable form, where a
        warp's lanes run one after another (the host twin), calls it for the 12 lanes
        whose registers hold this lane's rows and columns and sums their byte products."""
        g, q = k.lshr(lane, 2), k.and_(lane, 3)
        rows = [fragment(k.add(k.shl(g, 2), i)) for i in range(4)]  # A's rows g and g + 8
        cols = [
            [fragment(k.add(k.shl(k.add(k.shl(q, 1), c), 2), i)) for i in range(4)] for c in (0, 1)
        ]  # B's columns 2q and 2q + 1
        out = []
        for e, total in enumerate(acc):
            for i in range(4):  # k = 4i .. 4i + 3: held by lanes 4g + i and 4 * col + i
                a = k.bitcast(rows[i][e // 2], vec(I8, 4))
                b = k.bitcast(cols[e % 2][i][2], vec(I8, 4))
                products = k.b.mul(k.convert(a, I32), k.convert(b, I32, signed=False))
                total = k.b.add(total, k.reduce("add", products))
            out.append(total)
        return out


# ``lookup16``'s byte-table instructions by ISA and bytes per instruction
_LOOKUP = {
    "avx512": {64: "llvm.x86.avx512.pshuf.b.512", 32: "llvm.x86.avx2.pshuf.b",
               16: "llvm.x86.ssse3.pshuf.b.128"},
    "avx2": {32: "llvm.x86.avx2.pshuf.b", 16: "llvm.x86.ssse3.pshuf.b.128"},
    "neon": {16: "llvm.aarch64.neon.tbl1.v16i8"},
}  # fmt: skip
TILE_ROWS = 16  # activation rows of a tile product
WARP = 32  # threads of a warp (NVPTX)
MMA_ROWS = 16  # activation rows of a warp's mma tile (m16)


def _tile_registers(products: int) -> tuple[list[int], list[int]]:
    """Tile registers of the Bs and the Cs of ``products`` tile products (8 registers)."""
    if 1 + 2 * products <= 8:
        return list(range(1, 1 + products)), list(range(1 + products, 1 + 2 * products))
    return [1] * products, list(range(2, 2 + products))


def _sdot(k: Kernel, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value:
    """``sdot`` on each 128-bit quarter (4 int32 lanes, 16 bytes) of the operands."""
    parts = []
    for lo in range(0, acc.type.count, 4):
        parts.append(
            k.call(
                "llvm.aarch64.neon.sdot.v4i32.v16i8",
                vec(I32, 4),
                k.part(acc, lo, 4),
                k.part(a, 4 * lo, 16),
                k.part(s, 4 * lo, 16),
            )
        )
    return k.concat(parts)


def _quad_sums(k: Kernel, acc: ir.Value, u: ir.Value, s: ir.Value, *, u_signed: bool) -> ir.Value:
    """``acc`` plus, per int32 lane, the sum of its 4 byte products, in plain integer IR."""
    n = acc.type.count
    prod = k.b.mul(k.convert(u, I32, signed=u_signed), k.convert(s, I32))
    quads = [k.shuffle(prod, range(c, 4 * n, 4)) for c in range(4)]
    return k.b.add(acc, k.b.add(k.b.add(quads[0], quads[1]), k.b.add(quads[2], quads[3])))


_AVX512_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
AMX = Backend(
    "x86-amx",
    "amx",
    16,
    (*_AVX512_FEATURES, "amx-tile", "amx-int8"),
    "tdpbsud tiles for T >= 16, else vpdpbusd",
    accumulate="int32",
    vector_isa="avx512",
    tiles=True,
)
AVX512 = Backend(
    "x86-avx512",
    "avx512",
    16,
    _AVX512_FEATURES,
    "vpdpbusd",
    accumulate="int32",
    vector_isa="avx512",
)
# 3 activation rows x 3 row groups of 8: each activation broadcast serves 24 weight rows,
# each unpacked weight chunk 3 rows. Zen 3 runs two vpmaddubsw and four integer adds a
# cycle; the 4x8 tile spent more than half its vector ops on broadcasts, offset sums,
# widening and scaling. Measured at T = 512, K = 2048, 1 thread (GMAC/s over the 4x8):
# Q4_0 1.2x, Q4_K 1.05x, Q6_K 1.05x, Q8_0 1.0x (4x2 groups: Q4_0 1.12x; 2x3: 1.2x;
# 3x4: 1.23x but Q4_K 1.02x).
AVX2 = Backend(
    "x86-avx2",
    "avx2",
    8,
    ("avx2", "fma", "f16c"),
    "vpmaddubsw + vpmaddwd",
    vector_isa="avx2",
    wide=(3, 3),
    host_off="-avx512f,-avxvnni",
)
NEON_DOTPROD = Backend(
    "aarch64-neon-dotprod",
    "neon-dotprod",
    8,
    ("neon", "dotprod"),
    "sdot",
    accumulate="int32",
    vector_isa="neon-dotprod",
    signed_dot=True,
    machine="aarch64",
    cross_cpu="neoverse-n1",
    cross_features="+neon,+dotprod",
)
NEON = Backend(
    "aarch64-neon",
    "neon",
    8,
    ("neon",),
    "smull/umull + saddlp (widened integer IR)",
    machine="aarch64",
    cross_cpu="cortex-a72",
    cross_features="+neon,-dotprod",
)
GENERIC = Backend("generic", "generic", 8)
BACKENDS = (AMX, AVX512, AVX2, NEON_DOTPROD, NEON, GENERIC)  # best first
BY_ISA = {b.isa: b for b in BACKENDS}


Request = tuple[Backend, Program, Spec]  # a kernel someone is about to run: lower(program, spec)


def lower_all(requests: Iterable[Request]) -> list[Executable]:
    """``backend.lower(program, spec)`` for each request, the ones not lowered yet compiled
    concurrently (``jit.compile_modules``): what a model step is about to call, lowered
    in one go before it runs (kernels still compile when first needed, and no compile
    thread outlives this call)."""
    requests = list(requests)
    built: dict[tuple, tuple[Backend, Module]] = {}
    for backend, program, spec in requests:
        key = (program.name, tuple(sorted(spec.items())))
        if key not in backend._lowered and (id(backend), key) not in built:
            built[id(backend), key] = (backend, backend.module(program, spec))
    compiled = jit.compile_modules([(m.text(), m.names, b.host_off) for b, m in built.values()])
    for ((_, key), (backend, module)), (addresses, seconds) in zip(
        built.items(), compiled, strict=True
    ):
        backend._done(key, module.ir.name, addresses, seconds)
    return [backend.lower(program, spec) for backend, program, spec in requests]


class BackendUnavailable(RuntimeError):
    pass


def by_name(isa: str) -> Backend:
    """The backend ``isa`` names ("amx", "avx512", "avx2", "neon-dotprod", "neon",
    "generic"), checked against the host."""
    if isa not in BY_ISA:
        raise BackendUnavailable(f"unknown kernel ISA {isa!r} (choose from {', '.join(BY_ISA)})")
    backend = BY_ISA[isa]
    missing = backend.missing()
    if missing:
        raise BackendUnavailable(f"kernel ISA {isa} cannot run here: lacks {', '.join(missing)}")
    return backend


@cache
def host_best() -> Backend:
    """The widest backend this host runs natively."""
    return next(b for b in BACKENDS if not b.missing())


def select() -> Backend:
    """The backend kernels are built for: ``$DYNALM_ISA`` if set, else the host's best."""
    isa = os.environ.get("DYNALM_ISA", "").strip()
    return by_name(isa) if isa else host_best()


def coverage() -> str:
    """Which backends run natively here and which only through their twins, and why."""
    native = [b.name for b in BACKENDS if not b.missing()]
    twins = [f"{b.name} (lacks {', '.join(b.missing())})" for b in BACKENDS if b.missing()]
    text = f"native: {', '.join(native)}"
    return text + (f"; twin only: {'; '.join(twins)}" if twins else "")
