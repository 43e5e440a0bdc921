"""The NVPTX backend (preview): kernel programs lowered to PTX for NVIDIA GPUs.

The same programs the CPU backends lower (``kernel.matmul_programs``' MATMUL for every
format of the table in ``exact`` and ``auto``, ``kernel.attention_program``'s paged
attention, ``kernel.elementwise_programs``' kernels, ``kernel.sampling_program``'s row
reductions and greedy argmax) are built for the ``nvptx64-nvidia-cuda`` triple at the
generic backend's width (8 fp32 lanes, so the weight layouts and every program's float
order are those of the CPU's 8-lane backends) and compiled by LLVM's NVPTX target to PTX
text, which ``core.cuda_driver`` loads.

The grid: each function a program exports with the row-range signature
``void f(i64 *args, i64 lo, i64 hi)`` gets an entry kernel ``f_grid(i64 *args, i64 rows)``
(``ptx_kernel`` calling convention: a PTX ``.entry``) in which global thread
``g = ctaid.x * ntid.x + tid.x`` runs rows ``[g * chunk, min((g + 1) * chunk, rows))``
through the program's body, inlined. ``chunk`` is the rows one call must start on: the
auto matmul's lane groups (8 weight rows), the exact matmul's row groups (4), else 1
(the element-wise programs: a row or an element each). The attention program's
``write_rows`` (a (token, kv head) row of the step's keys and values per thread),
``items``, ``parts`` (split-K: a thread per item and chunk) and ``merge`` are row ranges;
its ``write``/``write_recent``/``run`` (not row ranges) get single-thread entries
(``Entry.chunk == 0``): correct, serial. The CUDA device launches ``write_rows`` rather
than ``write``, and ``write_recent`` (q8_0 pages only) still on one thread per layer: two
tokens of a step may share a recent-buffer row, the later must win.

ISA primitives: ``dot_u8s8`` is ``dp4a`` (``llvm.nvvm.idp4a.u.s``: 4 u8 x s8 products
into an int32, sm_61 and later) per lane; the others are the portable integer IR. The
programs' ``llvm.prefetch`` is dropped by the NVPTX target (it has no lowering for it),
stack arrays become local memory. The native pool program (futex syscalls, x86 pause,
cycle counter) is CPU-only and has no entry here; the GPU's parallel-for is the grid.

Tensor cores: the ``auto`` matmul's prefill tile (batches of ``MMA_ROWS`` = 16 rows and
more; ``MatmulKernels.tile_for`` is the choice, dp4a below) is warp-cooperative: its body
``f(args, lo, hi, lane)`` is run by the 32 threads of a warp together on one row group of
8 weight rows (``Entry.width`` = 32: the grid counts warps, blocks are whole warps), and
``mma_s8u8`` is ``mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32`` (sm_80,
``llvm.nvvm.mma.m16n8k16.row.col.s8.u8``) after a ``bar.warp.sync``. Why m16n8k16 s8 x u8
and not m16n8k32 s8 x s8: the weights are stored unsigned (``q - offset``, the dp4a
kernel's bytes) so B is u8 and A the signed activations, with no sign moving; and a
block's integer sums are kept per (sub-block, activation scale group) key of 4 chunks of
4 bytes (2 with two sub-blocks a block): one k16 mma per key has no zero padding for
one-sub-block formats, where k32 would be half zeros (Q3_K/Q6_K: half with k16, three
quarters with k32).
The host twin runs a warp's lanes one after another: its ``mma_s8u8`` rebuilds a lane's
D from the fragments of the 12 lanes that hold its rows and columns (``fragment`` is a
function of the lane, see ``Backend.mma_s8u8``), so the emulator computes the GPU's sums.

Numerics (what holds, from the arithmetic, not yet measured on a GPU): ``llvm.fmuladd``
is lowered to ``fma.rn.f32`` here as on an FMA CPU, division and square root are the
IEEE ``div.rn``/``sqrt.rn`` (LLVM's NVPTX defaults; no ``.ftz``), ``nearbyint`` is
``cvt.rni``. ``auto`` matmuls sum integers exactly and then use only fma/mul/convert in
a fixed order, and the activation quantiser only max/div/round/integer sums: their
outputs equal the CPU generic backend's bitwise. ``exact`` matmuls, RMSNorm, attention and
the sampling sums end in ``llvm.vector.reduce.fadd`` with ``reassoc`` (or ``contract``
pairs in attention), which each target may order differently: within the rounding of an
fp32 sum (the tests' ``sum_bound``), not bitwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import llvmlite.binding as llvm
import llvmlite.ir as ir

from dynalm.kernel.backends import WARP, Backend, Program, Spec
from dynalm.kernel.lang import I32, I64, PTR, VOID, Fragment, Kernel, Module, Values, vec

TRIPLE = "nvptx64-nvidia-cuda"
SM = "sm_80"  # Ampere and later: dp4a (sm_61+), bf16 cvt, what the preview is written for
PTX_FEATURES = "+ptx75"  # PTX ISA 7.5 (CUDA 11.5 drivers and later)
LANES = 8
THREADS = 128  # threads per block a launch uses by default

CPU_ONLY = {
    "pool": "the native thread pool (futex syscalls, CPU pause/cycle counter)",
    "mm_pair": "two matmul tiles called through host function pointers (a pool job)",
}


def chunk_of(program: Program, spec: Spec) -> int:
    """The rows one thread runs: a call's ``lo`` must be a multiple of it."""
    if program.name == "mm" and spec.get("mr"):
        return LANES if spec.get("mode") == "auto" else 4
    return 1


@dataclass(frozen=True)
class Entry:
    name: str  # the PTX .entry symbol
    chunk: int  # rows per thread (per warp); 0: the whole call on one thread (launch 1 x 1)
    width: int = 1  # threads that run one chunk together: WARP for a warp-cooperative body

    def grid(self, rows: int, threads: int = THREADS) -> tuple[int, int]:
        """(blocks, threads per block) covering ``rows``; whole warps where ``width`` is
        a warp."""
        if self.chunk == 0:
            return 1, 1
        need = max(1, -(-rows // self.chunk)) * self.width
        threads = min(threads, need)
        threads = max(self.width, threads - threads % self.width)
        return -(-need // threads), threads


@dataclass(frozen=True)
class PtxModule:
    """A lowered program: its PTX text and entries by short name ("" for a program's
    one function, else the suffix after the module's name)."""

    ptx: str
    entries: dict[str, Entry]
    compile_seconds: float


@dataclass(frozen=True)
class NvptxBackend(Backend):
    sm: str = SM
    ptx_features: str = PTX_FEATURES

    def capabilities(self) -> dict[str, object]:
        return {**super().capabilities(), "target": f"{TRIPLE} {self.sm} {self.ptx_features}"}

    def missing(self) -> list[str]:
        """Its code runs on a CUDA device, never on the host's CPU (whether this machine has
        one is the device layer's probe: ``core.devices``)."""
        return ["a CUDA device (PTX runs on the GPU, not the host)"]

    def twin(self) -> Backend:
        """The CPU program at the same width and int32 sums (``dp4a``'s exact sums), with
        the same warp-cooperative prefill tile (``mma_s8u8`` as plain integer IR)."""
        return Backend(
            f"{self.name}-twin",
            self.isa,
            self.lanes,
            accumulate="int32",
            native=False,
            warps=self.warps,
        )

    def mma_s8u8(self, k: Kernel, lane: ir.Value, fragment: Fragment, acc: Values) -> Values:
        """``mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32`` (sm_80) on this lane's
        ``fragment(lane)``; a ``bar.warp.sync`` first, so the warp is converged after any
        per-lane branch (the instruction is ``.aligned``)."""
        a0, a1, b = fragment(lane)
        k.call("llvm.nvvm.bar.warp.sync", VOID, ir.Constant(I32, -1))
        d = k.call(MMA_S8U8, ir.LiteralStructType([I32] * 4), a0, a1, b, *acc)
        return [k.b.extract_value(d, i) for i in range(4)]

    def dot_u8s8(self, k: Kernel, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value:
        n = acc.type.count
        words = [k.bitcast(x, vec(I32, n)) for x in (u, s)]
        out = acc
        for lane in range(n):
            i = ir.Constant(I32, lane)
            a, b, c = (k.b.extract_element(v, i) for v in (*words, acc))
            out = k.b.insert_element(out, k.call("llvm.nvvm.idp4a.u.s", I32, a, b, c), i)
        return out

    def module(self, program: Program, spec: Spec) -> Module:
        if program.name in CPU_ONLY:
            why = CPU_ONLY[program.name]
            raise ValueError(f"kernel program {program.name!r} is CPU-only: {why}")
        module = Module(module_name(self.name, program, spec), self, TRIPLE)
        module.ir.data_layout = str(_machine(self.sm, self.ptx_features).target_data)
        program.build(module, **spec)
        add_entries(module, program, spec)
        return module

    def lower(self, program: Program, spec: Spec) -> PtxModule:  # type: ignore[override]
        key = (program.name, tuple(sorted(spec.items())))
        done = self._lowered.get(key)
        if done is None:
            t0 = time.perf_counter()
            module = self.module(program, spec)
            ptx = emit_ptx(module.text(), self.sm, self.ptx_features)
            entries = {short: entry for short, _, entry in module.entries}
            done = self._lowered[key] = PtxModule(ptx, entries, time.perf_counter() - t0)
        return done

    def source_of(self, ptx: str) -> tuple[str, Spec] | None:
        """The (program name, spec) this backend lowered to ``ptx``, if it did."""
        for (name, items), done in self._lowered.items():
            if done.ptx == ptx:
                return name, dict(items)
        return None


NVPTX = NvptxBackend(
    "nvptx-sm80",
    "nvptx",
    LANES,
    int8_dot="dp4a (llvm.nvvm.idp4a.u.s); mma m16n8k16 s8.u8 for batches of >= 16 rows",
    accumulate="int32",
    warps=True,  # the int8 m16n8k16 mma is sm_80's, the preview's target
)
MMA_S8U8 = "llvm.nvvm.mma.m16n8k16.row.col.s8.u8"  # {i32 x 4} (a0, a1, b, c0..c3)


def module_name(target: str, program: Program, spec: Spec) -> str:
    """A module's (and its symbols') name, unique per target, program and spec."""
    key = repr((target, program.name, tuple(sorted(spec.items()))))
    return f"dynalm_{program.name}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _thread(k: Kernel) -> ir.Value:
    """This thread's global index along x, as i64."""
    ids = [
        k.convert(k.call(f"llvm.nvvm.read.ptx.sreg.{r}.x", I32), I64, signed=False)
        for r in ("ctaid", "ntid", "tid")
    ]
    return k.add(k.mul(ids[0], ids[1]), ids[2])


def add_entries(
    module: Module,
    program: Program,
    spec: Spec,
    cc: str = "ptx_kernel",
    thread: Callable[[Kernel], ir.Value] | None = None,
) -> None:
    """An entry kernel per exported function (see the module's docstring), in calling
    convention ``cc``, ``thread(k)`` its global thread index (default: the PTX special
    registers; ``HOST_LOOP``: the entry takes a third parameter, a thread count, and runs
    threads ``0 .. count - 1`` in turn); the functions become private and always inlined.
    ``module.entries``: (short name, symbol, ``Entry``)."""
    prefix = module.ir.name
    entries = []
    for name in list(module.names):
        entry = _entry(module, program, spec, module.function(name), cc, thread or _thread)
        entries.append((name.removeprefix(prefix).removeprefix("_"), name, entry))
    module.names = [f"{full}_grid" for _, full, _ in entries]
    module.entries = entries  # type: ignore[attr-defined]


def _entry(
    module: Module,
    program: Program,
    spec: Spec,
    body: ir.Function,
    cc: str,
    thread: Callable[[Kernel], ir.Value],
) -> Entry:
    """``body``'s entry kernel ``NAME_grid(args, rows)`` (chunk 0: one thread runs the
    call). A body ``f(args, lo, hi, lane)`` is *warp-cooperative*: the ``WARP`` threads of
    a warp run it together on the same rows ``[lo, hi)``, ``lane`` each one's index in its
    warp (``tid.x % 32``: blocks are whole warps), so its control flow is the same on
    every lane up to its warp-collective primitives (``Backend.mma_s8u8``); the host twin
    runs the lanes one after another like any threads."""
    body.linkage = "private"
    body.attributes.add("alwaysinline")
    params = [str(a.type) for a in body.args]
    loop = thread is HOST_LOOP
    k = module.kernel(f"{body.name}_grid", (PTR, I64, I64) if loop else (PTR, I64))
    k.fn.calling_convention = cc
    args, rows = k.args[:2]
    if loop:  # the host twin: every thread of the launch, one after another
        threads = k.args[2]
        thread = lambda k: index.get()  # noqa: E731 - the loop's
        index = k.var(0)
        head, tail = k.b.append_basic_block("thread"), k.b.append_basic_block("done")
        k.b.cbranch(k.lt(k.i64(0), threads), head, tail)
        k.b.position_at_end(head)
    warp = params == ["ptr", "i64", "i64", "i64"]
    width = WARP if warp else 1
    if params == ["ptr", "i64", "i64"] or warp:
        chunk = chunk_of(program, spec)
        me = thread(k)
        lo = k.mul(k.udiv(me, width) if warp else me, chunk)

        def run() -> None:
            hi = k.smin(k.add(lo, chunk), rows)
            if warp:
                k.b.call(body, [args, lo, hi, k.and_(me, WARP - 1)])
                return
            k.b.call(body, [args, lo, hi])

        k.branch(k.lt(lo, rows), run)
    elif params == ["ptr"]:
        chunk = 0
        first = k.b.icmp_signed("==", thread(k), k.i64(0))
        k.branch(first, lambda: k.b.call(body, [args]))
    else:
        raise ValueError(f"{body.name}: no grid mapping for parameters ({', '.join(params)})")
    if loop:
        nxt = k.add(index.get(), 1)
        index.set(nxt)
        k.b.cbranch(k.lt(nxt, threads), head, tail)
        k.b.position_at_end(tail)
    k.ret()
    return Entry(f"{body.name}_grid", chunk, width)


def _host_loop(k: Kernel) -> ir.Value:
    raise AssertionError("a marker: add_entries loops over the threads itself")


HOST_LOOP = _host_loop


@dataclass(frozen=True)
class HostEntry:
    """An entry kernel of the host twin: ``fn(args, rows, threads)`` runs the threads of a
    launch in turn; ``entry`` is its GPU entry (chunk, grid)."""

    fn: Callable[[int, int, int], None]
    entry: Entry

    def launch(self, args: int, rows: int, grid: tuple[int, int]) -> None:
        self.fn(args, rows, grid[0] * grid[1])


def host_twin(program: Program, spec: Spec) -> dict[str, HostEntry]:
    """``program``'s NVPTX entry kernels built for this CPU: the NVPTX backend's portable
    twin (``NVPTX.twin()``: same width, the same integer sums, the same float order except
    where the docstring says), with the same grid mapping, each thread's index the host
    loop's. What runs a CUDA device's launches where no GPU is (tests, ``gpu_check``)."""
    from dynalm.kernel import jit  # the host JIT; the PTX path never needs it

    key = (program.name, tuple(sorted(spec.items())))
    done = _HOST_TWINS.get(key)
    if done is None:
        module = Module(module_name("host-twin", program, spec), NVPTX.twin(), jit.triple())
        program.build(module, **spec)
        add_entries(module, program, spec, cc="", thread=HOST_LOOP)
        addresses, _ = jit.compile_module(module.text(), module.names)
        done = _HOST_TWINS[key] = {}
        for short, full, entry in module.entries:
            fn = jit.cfunc(addresses[f"{full}_grid"], None, *_HOST_SIGNATURE)
            done[short] = HostEntry(fn, entry)
    return done


_HOST_SIGNATURE = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_HOST_TWINS: dict[tuple, dict[str, HostEntry]] = {}


_MACHINES: dict[tuple[str, str], llvm.TargetMachine] = {}


def _machine(sm: str, features: str) -> llvm.TargetMachine:
    tm = _MACHINES.get((sm, features))
    if tm is None:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        target = llvm.Target.from_triple(TRIPLE)
        tm = _MACHINES[sm, features] = target.create_target_machine(
            cpu=sm, features=features, opt=3
        )
    return tm


def optimized(ir_text: str, sm: str = SM, features: str = PTX_FEATURES) -> llvm.ModuleRef:
    """``ir_text`` parsed, verified and optimised for the NVPTX target (the bodies
    inlined into their entries)."""
    tm = _machine(sm, features)
    mod = llvm.parse_assembly(ir_text)
    mod.verify()
    # the programs vectorise by hand; NVPTX splits vectors into its registers anyway
    pto = llvm.create_pipeline_tuning_options(speed_level=2)
    pto.loop_vectorization = False
    pto.slp_vectorization = False
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    mod.verify()
    return mod


def emit_ptx(ir_text: str, sm: str = SM, features: str = PTX_FEATURES) -> str:
    """PTX text for an NVPTX module's IR."""
    return _machine(sm, features).emit_assembly(optimized(ir_text, sm, features))


def device_kernels(k_blocks: int = 48) -> list[tuple[Program, dict[str, object]]]:
    """Every (program, spec) a model step on the GPU needs, at SmolLM2-like shapes: the
    matmuls of every format of the table in both modes (each batch bucket's tile and the
    activations' quantiser; K = 32 * ``k_blocks``, a multiple of the K-quants' 256), paged
    attention per KV storage, the element-wise kernels, the sampling reductions and the
    greedy argmax."""
    from dynalm.kernel import (
        attention_program,
        elementwise_programs,
        matmul_programs,
        sampling_program,
    )

    out: list[tuple[Program, dict[str, object]]] = []
    matmul = matmul_programs
    for ggml_type in matmul.UNPACKS:
        for mode in ("exact", "auto"):
            if matmul.effective_mode(ggml_type, mode) != mode:
                continue  # auto falls back to the exact kernels: nothing new to lower
            for shape in matmul.buckets(mode, NVPTX, ggml_type):
                spec = {"k_blocks": k_blocks, "ggml_type": int(ggml_type), "mode": mode}
                out.append((matmul.MATMUL, {**spec, "mr": shape.mr}))
    out.append((matmul.MATMUL, {"k_blocks": k_blocks}))
    geometry = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "page": 16}
    for dtype, recent, softcap in (
        ("f32", 0, 0.0),
        ("f16", 0, 0.0),
        ("q8_0", 0, 0.0),
        ("q8_0", 32, 0.0),
        ("f16", 0, 50.0),
    ):  # (a score cap: Gemma 2's)
        spec = {"dtype": dtype, **geometry, "recent": recent, "softcap": softcap}
        out.append((attention_program.ATTENTION, spec))
    ew = elementwise_programs.PROGRAMS
    out += [
        (ew["add"], {}),
        (ew["mul"], {}),
        (ew["scale"], {"factor": 24.0}),
        (ew["act"], {"activation": "silu"}),
        (ew["act"], {"activation": "gelu_tanh"}),
        (ew["act"], {"activation": "tanh"}),  # a reranker's head
        (ew["gated"], {"activation": "silu"}),
        (ew["gated"], {"activation": "gelu_tanh"}),
        (ew["bias"], {"width": 576}),
        (ew["columns"], {"width": 64, "src_stride": 960, "dst_stride": 64, "gather": False}),
        (ew["columns"], {"width": 576, "src_stride": 576, "dst_stride": 576, "gather": True}),
        (ew["rows"], {"width": 576, "src_stride": 576, "dst_stride": 576, "n_src": 49152}),
        (ew["rms_norm"], {"width": 576, "eps": 1e-5}),
        (ew["rope"], {"n_heads": 9, "head_dim": 64, "rope_dim": 64, "neox": False, "stride": 576}),
        (ew["rope"], {"n_heads": 4, "head_dim": 64, "rope_dim": 32, "neox": True, "stride": 320}),
        (sampling_program.ROW_REDUCE, {"vocab": 49152}),
        (sampling_program.ARGMAX, {"vocab": 49152}),  # greedy tokens on the device
    ]
    return out
