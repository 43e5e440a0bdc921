"""The LLVM JIT: host detection, compile-and-cache of generated IR, callable function pointers.

Kernel programs (``kernel.lang``) are lowered by a backend to LLVM IR text, compiled for
the host CPU (its name and feature flags; LLVM's -O1 pipeline, code generation at -O3)
and loaded into one process-wide MCJIT engine. ``compile_modules`` compiles several
modules at once, one per CPU, on threads that end before it returns (each module in an
LLVM context of its own, each thread with its own TargetMachine, around llvmlite's
process-wide lock); object code is added to the engine under one lock. Compiled object
code is kept on disk under ``$DYNALM_CACHE/jit`` (default ``~/.cache/dynalm/jit``),
keyed by the IR text, the CPU name, its features and the llvmlite version, so a second
process skips LLVM entirely; the IR text is stored beside each object for debugging. A
module may turn host features off (``features``, e.g. "-avx512f": the x86-avx2 backend
builds on an AVX-512 host the code an AVX2-only CPU runs, 16 registers and no EVEX).

This module, the kernel bindings and ``core`` are the only places that deal in raw addresses.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
from llvmlite.binding import ffi

# Feature flags worth reporting: the ones our kernels choose between.
_REPORTED = (
    "sse4.2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512vnni",
    "avxvnni",
    "amx-tile",
    "amx-int8",
    "neon",
    "dotprod",
)


_OPT_LEVEL = 1  # LLVM's optimisation pipeline for kernel modules (see _emit_object)


@cache
def _target_machine() -> llvm.TargetMachine:
    return _new_target_machine()


def _machine_features(features: str) -> str:
    """The host's LLVM feature string with ``features`` ("-avx512f,...") applied after it
    (LLVM turns off what depends on a feature turned off)."""
    return ",".join(filter(None, [llvm.get_host_cpu_features().flatten(), features]))


def _new_target_machine(features: str = "") -> llvm.TargetMachine:
    """A TargetMachine for the host (~1 ms), ``features`` changed as ``_machine_features``
    says. LLVM's code generation may change a TargetMachine's options per function, so
    threads that compile at once each use their own."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    return target.create_target_machine(
        cpu=llvm.get_host_cpu_name(),
        features=_machine_features(features),
        opt=3,
        codemodel="jitdefault",
    )


@cache
def host_flags() -> dict[str, bool]:
    """The host's LLVM feature flags ("avx2": True, ...)."""
    _target_machine()
    return dict(llvm.get_host_cpu_features())


@cache
def amx_permission() -> str | None:
    """None once Linux lets this process use AMX tile data (asked once: ``arch_prctl
    ARCH_REQ_XCOMP_PERM``; without it the first tile instruction raises SIGILL), else
    why not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "AMX tile permission is requested on Linux x86-64 only"
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    args = (ctypes.c_long(v) for v in (sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata))
    if libc.syscall(*args) != 0:
        return f"Linux refused AMX tile permission ({os.strerror(ctypes.get_errno())})"
    return None


def assembly(ir: str, features: str) -> str:
    """The assembly LLVM makes of ``ir`` for the host CPU with ``features`` added (e.g.
    "+amx-tile,+amx-int8"): shows a backend's lowering on a host that cannot run it."""
    _target_machine()
    target = llvm.Target.from_triple(triple())
    machine = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(),
        features=_machine_features(features),
        opt=2,
    )
    return machine.emit_assembly(llvm.parse_assembly(ir))


def triple() -> str:
    return llvm.get_process_triple()


def host_machine() -> str:
    """The host's CPU architecture as LLVM names it: "x86_64", "aarch64", ..."""
    return triple().split("-")[0]


@cache
def host_features() -> dict[str, object]:
    """The host as the JIT sees it: CPU name, triple and the features kernels choose by."""
    flags = host_flags()
    return {
        "cpu": llvm.get_host_cpu_name(),
        "triple": triple(),
        "features": sorted(f for f in _REPORTED if flags.get(f, False)),
        "llvmlite": llvmlite.__version__,
    }


def cache_dir() -> Path:
    root = os.environ.get("DYNALM_CACHE")
    return Path(root) / "jit" if root else Path.home() / ".cache" / "dynalm" / "jit"


def _unlocked(name: str) -> Callable:
    """llvmlite's raw ctypes function ``name``: llvmlite wraps every call into LLVM in one
    process-wide lock, so two threads never compile at once through its API. The
    functions called this way touch only objects of the calling thread (a module in its
    own LLVM context, a pass builder, a TargetMachine no other thread uses), as LLVM's
    concurrent compilers do; without the private attribute the locked call is used."""
    wrapper = getattr(ffi.lib, name)  # also declares the argument types
    return getattr(wrapper, "_cfn", wrapper)


def _emit_object(ir: str, tm: llvm.TargetMachine) -> tuple[bytes, float]:
    """``ir`` optimised and compiled to object code with ``tm``, and the seconds it took.
    Safe to run on several threads at once, each with its own ``tm``."""
    t0 = time.perf_counter()
    context = llvm.create_context()  # an LLVM context is used by one thread at a time
    mod = llvm.parse_assembly(ir, context=context)
    mod.verify()
    # Kernel programs are vectorised and unrolled by hand, so LLVM's -O1 pipeline
    # without its vectorisers makes the same code as -O3 (kernel_bench: equal times on
    # every SmolLM2 matmul shape) and a cold start's compiles take ~35 % less time.
    pto = llvm.create_pipeline_tuning_options(speed_level=_OPT_LEVEL)
    pto.loop_vectorization = False
    pto.slp_vectorization = False
    pb = llvm.create_pass_builder(tm, pto)
    _unlocked("LLVMPY_RunNewModulePassManager")(pb.getModulePassManager(), mod, pb)
    with ffi.OutputString() as error:
        buffer = _unlocked("LLVMPY_TargetMachineEmitToMemory")(tm, mod, 1, error)
        if not buffer:
            raise RuntimeError(f"LLVM could not emit a kernel module: {error}")
    try:
        obj = ctypes.string_at(
            ffi.lib.LLVMPY_GetBufferStart(buffer), ffi.lib.LLVMPY_GetBufferSize(buffer)
        )
    finally:
        ffi.lib.LLVMPY_DisposeMemoryBuffer(buffer)
    mod.close()  # before its context
    context.close()
    return obj, time.perf_counter() - t0


def _each(fn: Callable, items: Sequence, tools: Sequence) -> list:
    """``fn(item, tool)`` for every item, on the calling thread and ``len(tools) - 1``
    helper threads, each thread with a tool of its own, taking the next item when done.
    The helpers are joined before this returns (or raises): no thread outlives the call,
    so none is alive at a later fork()."""
    results: list = [None] * len(items)
    todo = iter(range(len(items)))
    take, failed = threading.Lock(), []

    def work(tool: object) -> None:
        while not failed:
            with take:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i], tool)
            except BaseException as e:  # re-raised on the calling thread
                failed.append(e)

    helpers = [
        threading.Thread(target=work, args=(tool,), name=f"dynalm-compile-{n}")
        for n, tool in enumerate(tools[1:], 1)
    ]
    for t in helpers:
        t.start()
    try:
        work(tools[0])
    except BaseException as e:  # e.g. KeyboardInterrupt: stop the helpers too
        failed.append(e)
    finally:
        for t in helpers:
            t.join()
    if failed:
        raise failed[0]
    return results


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# A module to compile: its IR text, the functions to export, the host features turned off.
Source = tuple[str, Sequence[str], str]


class _Engine:
    """One MCJIT engine for the process; modules are added as object code."""

    def __init__(self) -> None:
        self._tm = _target_machine()
        self._ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self._tm)
        self._lock = threading.Lock()
        self._loaded: dict[str, dict[str, int]] = {}
        # compile threads' TargetMachines, one per feature change a thread has compiled for
        self._spare_tms: list[dict[str, llvm.TargetMachine]] = []

    def _key(self, ir: str, features: str) -> str:
        host = host_features()
        text = "\0".join(
            [
                ir,
                str(host["cpu"]),
                _machine_features(features),
                llvmlite.__version__,
                f"O{_OPT_LEVEL}",
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _compile_objects(self, todo: dict[str, tuple[str, str]]) -> dict[str, tuple[bytes, float]]:
        """Object code for modules (key -> IR, features) that neither the engine nor the
        disk cache holds, compiled at once on up to one thread per CPU, largest first (so
        the last to start are short); each module's own compile seconds beside it."""
        keys = sorted(todo, key=lambda key: -len(todo[key][0]))
        n = min(len(keys), _cpus())
        tms = [self._spare_tms.pop() if self._spare_tms else {} for _ in range(n)]

        def emit(key: str, machines: dict[str, llvm.TargetMachine]) -> tuple[bytes, float]:
            ir, features = todo[key]
            if features not in machines:
                machines[features] = _new_target_machine(features)
            return _emit_object(ir, machines[features])

        try:
            done = _each(emit, keys, tms)
        finally:
            self._spare_tms += tms
        return dict(zip(keys, done, strict=True))

    def compile_all(self, modules: Sequence[Source]) -> list[tuple[dict[str, int], float]]:
        keys = [self._key(ir, features) for ir, _, features in modules]
        with self._lock:
            cached: dict[str, bytes] = {}
            todo: dict[str, tuple[str, str]] = {}
            for key, (ir, _, features) in zip(keys, modules, strict=True):
                if key in self._loaded or key in cached or key in todo:
                    continue
                try:
                    cached[key] = (cache_dir() / f"{key}.o").read_bytes()
                except OSError:
                    todo[key] = ir, features
            compiled = self._compile_objects(todo) if todo else {}
            for key, (obj, _) in compiled.items():
                ir, features = todo[key]
                note = f"; compiled with host features changed: {features}\n" if features else ""
                store_object(cache_dir() / f"{key}.o", obj, note + ir)
            objects = {**cached, **{key: obj for key, (obj, _) in compiled.items()}}
            for key, obj in objects.items():
                self._ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
                self._loaded[key] = {}
            if objects:
                self._ee.finalize_object()
            out = []
            for key, (_, names, _) in zip(keys, modules, strict=True):
                seconds = compiled.pop(key, (b"", 0.0))[1]  # a module given twice: once
                out.append((self._addresses(key, names), seconds))
            return out

    def _addresses(self, key: str, names: Sequence[str]) -> dict[str, int]:
        addrs = self._loaded[key]
        for name in names:
            if name not in addrs:
                addrs[name] = self._ee.get_function_address(name)
                if not addrs[name]:
                    raise LookupError(f"JIT module has no function {name!r}")
        return {name: addrs[name] for name in names}

    def compile(
        self, ir: str, names: Sequence[str], features: str = ""
    ) -> tuple[dict[str, int], float]:
        return self.compile_all([(ir, names, features)])[0]


def store_object(path: Path, obj: bytes, ir: str) -> None:
    """Object code and its IR into the disk cache (write-then-rename, so concurrent
    processes never read a half-written object)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for data, final in ((ir.encode(), path.with_suffix(".ll")), (obj, path)):
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
    except OSError:
        pass  # a read-only cache only costs compile time


@cache
def _engine() -> _Engine:
    return _Engine()


def compile_module(
    ir: str, names: Sequence[str], features: str = ""
) -> tuple[dict[str, int], float]:
    """Compile (or load from the disk cache) an IR module for the host, ``features``
    ("-avx512f,...") turned off: its functions' addresses, and the seconds LLVM took (0.0
    when the object code came from the cache or was loaded).

    Function names must be unique across all modules of the process (include a hash of the
    generating parameters in them).
    """
    return _engine().compile(ir, names, features)


def compile_modules(modules: Sequence[Source]) -> list[tuple[dict[str, int], float]]:
    """``compile_module`` for each ``(ir, names, features)``, the modules not loaded nor cached
    compiled concurrently: on the calling thread and a helper per further CPU, all
    joined before this returns (LLVM runs without the GIL). Each module's seconds are
    its own compile time; together they may exceed the wall time this call took."""
    return _engine().compile_all(modules)


def add_symbol(name: str, address: int) -> None:
    """Let compiled code call the function at ``address`` as the external ``name``."""
    llvm.add_symbol(name, address)


def cfunc(address: int, restype: type | None, *argtypes: type) -> ctypes._CFuncPtr:
    """Wrap a compiled function's address for calling from Python (the GIL is released)."""
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)
