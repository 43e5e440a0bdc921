"""The LLVM JIT: host detection, compile-and-cache of generated IR, callable function pointers.

Kernel programs (``kernel.lang``) are lowered by a backend to LLVM IR text, compiled for
the host CPU (its name and feature flags, opt level 3) and loaded into one process-wide
MCJIT engine. Compiled object code is kept on disk under ``$DYNALM_CACHE/jit`` (default
``~/.cache/dynalm/jit``), keyed by the IR text, the CPU name, its features and the
llvmlite version, so a second process skips LLVM entirely; the IR text is stored beside
each object for debugging.

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
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

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


_OPT_LEVEL = 1  # LLVM's optimisation pipeline for kernel modules (see _object_code)


@cache
def _target_machine() -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    return target.create_target_machine(
        cpu=llvm.get_host_cpu_name(),
        features=llvm.get_host_cpu_features().flatten(),
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
        features=",".join(filter(None, [llvm.get_host_cpu_features().flatten(), features])),
        opt=2,
    )
    return machine.emit_assembly(llvm.parse_assembly(ir))


def triple() -> str:
    return llvm.get_process_triple()


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


class _Engine:
    """One MCJIT engine for the process; modules are added as object code."""

    def __init__(self) -> None:
        self._tm = _target_machine()
        self._ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self._tm)
        self._lock = threading.Lock()
        self._loaded: dict[str, dict[str, int]] = {}

    def _key(self, ir: str) -> str:
        host = host_features()
        text = "\0".join(
            [
                ir,
                str(host["cpu"]),
                llvm.get_host_cpu_features().flatten(),
                llvmlite.__version__,
                f"O{_OPT_LEVEL}",
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _object_code(self, ir: str, key: str) -> tuple[bytes, bool]:
        """The module's object code, and whether it had to be compiled (not cached)."""
        path = cache_dir() / f"{key}.o"
        try:
            return path.read_bytes(), False
        except OSError:
            pass
        mod = llvm.parse_assembly(ir)
        mod.verify()
        # Kernel programs are vectorised and unrolled by hand, so LLVM's -O1 pipeline
        # without its vectorisers makes the same code as -O3 (kernel_bench: equal times on
        # every SmolLM2 matmul shape) and a cold start's compiles take ~35 % less time.
        pto = llvm.create_pipeline_tuning_options(speed_level=_OPT_LEVEL)
        pto.loop_vectorization = False
        pto.slp_vectorization = False
        pb = llvm.create_pass_builder(self._tm, pto)
        pb.getModulePassManager().run(mod, pb)
        obj = self._tm.emit_object(mod)
        self._store(path, obj, ir)
        return obj, True

    @staticmethod
    def _store(path: Path, obj: bytes, ir: str) -> None:
        # Write-then-rename so concurrent processes never read a half-written object.
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for data, final in ((ir.encode(), path.with_suffix(".ll")), (obj, path)):
                fd, tmp = tempfile.mkstemp(dir=path.parent)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, final)
        except OSError:
            pass  # a read-only cache only costs compile time

    def compile(self, ir: str, names: Sequence[str]) -> tuple[dict[str, int], float]:
        key = self._key(ir)
        seconds = 0.0
        with self._lock:
            if key not in self._loaded:
                t0 = time.perf_counter()
                obj, compiled = self._object_code(ir, key)
                if compiled:
                    seconds = time.perf_counter() - t0
                self._ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
                self._ee.finalize_object()
                self._loaded[key] = {}
            addrs = self._loaded[key]
            for name in names:
                if name not in addrs:
                    addrs[name] = self._ee.get_function_address(name)
                    if not addrs[name]:
                        raise LookupError(f"JIT module has no function {name!r}")
            return {name: addrs[name] for name in names}, seconds


@cache
def _engine() -> _Engine:
    return _Engine()


def compile_module(ir: str, names: Sequence[str]) -> tuple[dict[str, int], float]:
    """Compile (or load from the disk cache) an IR module: its functions' addresses, and
    the seconds LLVM took (0.0 when the object code came from the cache or was loaded).

    Function names must be unique across all modules of the process (include a hash of the
    generating parameters in them).
    """
    return _engine().compile(ir, names)


def add_symbol(name: str, address: int) -> None:
    """Let compiled code call the function at ``address`` as the external ``name``."""
    llvm.add_symbol(name, address)


def cfunc(address: int, restype: type | None, *argtypes: type) -> ctypes._CFuncPtr:
    """Wrap a compiled function's address for calling from Python (the GIL is released)."""
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)
