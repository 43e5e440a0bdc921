"""Kernels for another machine's CPU, run on this one: cross-compiled objects in a C harness
under user-mode emulation.

A backend whose ``machine`` is not the host's (``aarch64-neon-dotprod`` and
``aarch64-neon`` on x86) cannot be JIT-loaded here. ``CrossModule`` lowers a program for
it to an ELF object with an llvmlite TargetMachine for its triple, CPU and features (the
same optimisation pipeline as ``kernel.jit``; objects cached under ``$DYNALM_CACHE/jit/
cross``). A :class:`Harness` links the objects of many kernels with a small C driver
(``aarch64-linux-gnu-gcc``) and runs them all in one ``qemu-aarch64`` process over an
:class:`Arena`: one memory image holding every buffer and argument block, pointers in it
written as offsets that the driver relocates after mapping the image. The driver makes
the calls in order (functions by index, up to three int64 arguments), starts threads
running a function forever (the pool's workers) and writes the image back, which the
caller reads its outputs from. Debian packages: ``qemu-user`` and
``gcc-aarch64-linux-gnu`` (``make test`` installs them where it can).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numpy as np

from dynalm.kernel import jit
from dynalm.kernel.backends import Backend, Program

PACKAGES = ("qemu-user", "gcc-aarch64-linux-gnu")
_GCC, _QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # the target's libc, for the dynamic loader under qemu


def missing_tools() -> list[str]:
    """The cross tools this host lacks (empty when the harness can run)."""
    missing = [tool for tool in (_GCC, _QEMU) if shutil.which(tool) is None]
    if not Path(SYSROOT, "lib").is_dir():
        missing.append(f"{SYSROOT}/lib")
    return missing


def coverage() -> str:
    """How this host tests the AArch64 backends: natively, under emulation, or not."""
    if jit.host_machine() == "aarch64":
        return "native (an AArch64 host)"
    missing = missing_tools()
    if missing:
        return (
            f"SKIPPED: no emulation here, lacks {', '.join(missing)} "
            f"(as root: apt-get install {' '.join(PACKAGES)})"
        )
    return "under emulation (cross-compiled, run by qemu-aarch64: tests/kernels/test_neon.py)"


@cache
def _target_machine(triple: str, cpu: str, features: str, thread: int = 0) -> llvm.TargetMachine:
    """A TargetMachine for a foreign machine, one per compiling thread (see ``kernel.jit``)."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    target = llvm.Target.from_triple(triple)
    # position-independent: linked into the driver, a PIE executable
    return target.create_target_machine(cpu=cpu, features=features, opt=3, reloc="pic")


@dataclass(frozen=True)
class CrossModule:
    """A program built for a backend of another machine, not compiled yet."""

    text: str  # LLVM IR
    names: dict[str, str]  # a function's name without the module prefix -> its symbol
    machine: tuple[str, str, str]  # triple, CPU, features

    @classmethod
    def build(cls, backend: Backend, program: Program, spec: Mapping[str, object]) -> CrossModule:
        module = backend.module(program, spec)
        prefix = module.ir.name
        names = {n.removeprefix(prefix + "_") if n != prefix else "": n for n in module.names}
        machine = (backend.triple(), backend.cross_cpu, backend.cross_features)
        return cls(module.text(), names, machine)

    def compile(self, thread: int = 0) -> tuple[bytes, float]:
        """Object code (from the cache under ``$DYNALM_CACHE/jit/cross`` if there) and the
        seconds LLVM took (0 when cached)."""
        key = "\0".join([self.text, *self.machine, llvmlite.__version__])
        path = jit.cache_dir() / "cross" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.o"
        try:
            return path.read_bytes(), 0.0
        except OSError:
            pass
        obj, seconds = jit._emit_object(self.text, _target_machine(*self.machine, thread))
        jit.store_object(path, obj, self.text)
        return obj, seconds


def compile_objects(modules: Sequence[CrossModule]) -> list[tuple[bytes, float]]:
    """``module.compile()`` for each, on a thread per CPU (LLVM runs without the GIL)."""
    threads = list(range(max(1, min(len(modules), jit._cpus()))))
    return jit._each(lambda m, thread: m.compile(thread), list(modules), threads)


@dataclass(frozen=True)
class Ptr:
    """An address inside the arena (its offset), relocated by the driver."""

    offset: int


class Arena:
    """The memory image a harness run works on: buffers and argument blocks at offsets,
    each 64-byte aligned."""

    def __init__(self) -> None:
        self._data = bytearray()
        self.relocations: list[int] = []  # offsets of the words that hold a Ptr
        self._mirrors: list[tuple[int, np.ndarray, Ptr]] = []  # (host address, array, copy)

    def alloc(self, nbytes: int, align: int = 64) -> Ptr:
        at = -(-len(self._data) // align) * align
        self._data.extend(bytes(at + max(nbytes, 1) - len(self._data)))
        return Ptr(at)

    def put(self, array: np.ndarray) -> Ptr:
        """A copy of ``array``'s bytes (C order)."""
        data = np.ascontiguousarray(array).tobytes()
        at = self.alloc(len(data))
        self._data[at.offset : at.offset + len(data)] = data
        return at

    def words(self, values: list[int | Ptr]) -> Ptr:
        """An int64 block; ``Ptr`` values become addresses."""
        at = self.alloc(8 * len(values))
        for i, v in enumerate(values):
            self.set_word(Ptr(at.offset + 8 * i), v)
        return at

    def set_word(self, at: Ptr, value: int | Ptr) -> None:
        if isinstance(value, Ptr):
            self.relocations.append(at.offset)
            value = value.offset
        self._data[at.offset : at.offset + 8] = int(value).to_bytes(8, "little", signed=True)

    def image(self) -> bytes:
        return bytes(self._data)

    def mirror(self, array: np.ndarray) -> Ptr:
        """A copy of the C-contiguous ``array`` whose host addresses ``translate`` maps to
        the copy's, and which ``copy_back`` refreshes after a run (for argument blocks the
        host's own code filled in)."""
        if not array.flags.c_contiguous:
            raise ValueError("only C-contiguous arrays can be mirrored")
        at = self.put(array)
        self._mirrors.append((array.__array_interface__["data"][0], array, at))
        return at

    def translate(self, address: int, what: str = "pointer") -> Ptr:
        """The arena address of the host ``address`` inside a mirrored array."""
        for start, array, at in self._mirrors:
            if start <= address < start + max(array.nbytes, 1):
                return Ptr(at.offset + address - start)
        raise ValueError(f"{what}: host address {address:#x} is in no mirrored array")

    def copy_back(self, image: bytes) -> None:
        """Each writable mirrored array set to its copy in ``image`` (a run's arena)."""
        for _, array, at in self._mirrors:
            if array.flags.writeable:
                array[...] = read(image, at, array.dtype, array.shape)


_DRIVER = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *dynalm_fns[];
typedef void (*fn3)(long, long, long);
static char *base;

/* libc's syscall() under the name the pool's code calls (see kernel.pool) */
long dynalm_syscall(long n, ...) {
    va_list ap;
    long a[5];
    va_start(ap, n);
    for (int i = 0; i < 5; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    return syscall(n, a[0], a[1], a[2], a[3], a[4]);
}

struct worker { long fn, arg; };
static void *forever(void *p) {
    struct worker *w = p;
    ((fn3)dynalm_fns[w->fn])(w->arg, 0, 0);
    return NULL;
}

static long value(FILE *f) {
    char kind;
    long v;
    if (fscanf(f, " %c%ld", &kind, &v) != 2) {
        fprintf(stderr, "bad argument\n");
        exit(3);
    }
    return kind == 'p' ? (long)(base + v) : v;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s IMAGE CALLS OUT\n", argv[0]); return 2; }
    FILE *img = fopen(argv[1], "rb"), *calls = fopen(argv[2], "r");
    if (!img || !calls) { perror("open"); return 2; }
    fseek(img, 0, SEEK_END);
    long size = ftell(img);
    rewind(img);
    base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || fread(base, 1, size, img) != (size_t)size) {
        perror("image");
        return 2;
    }
    char op;
    while (fscanf(calls, " %c", &op) == 1) {
        long fn, n, at;
        if (op == 'r') {            /* r OFFSET: the word there is an arena offset */
            if (fscanf(calls, "%ld", &at) != 1) return 3;
            *(long *)(base + at) += (long)base;
        } else if (op == 'f') {     /* f OFFSET FN: the word there is function FN's address */
            if (fscanf(calls, "%ld %ld", &at, &fn) != 2) return 3;
            *(void **)(base + at) = dynalm_fns[fn];
        } else if (op == 'c') {     /* c FN N ARG...: call FN with N (<= 3) arguments */
            long a[3] = {0, 0, 0};
            if (fscanf(calls, "%ld %ld", &fn, &n) != 2 || n > 3) return 3;
            for (long i = 0; i < n; i++) a[i] = value(calls);
            ((fn3)dynalm_fns[fn])(a[0], a[1], a[2]);
        } else if (op == 't') {     /* t FN N ARG: N threads running FN(ARG), never joined */
            if (fscanf(calls, "%ld %ld", &fn, &n) != 2) return 3;
            long arg = value(calls);
            for (long i = 0; i < n; i++) {
                struct worker *w = malloc(sizeof *w);
                pthread_t t;
                w->fn = fn, w->arg = arg;
                if (pthread_create(&t, NULL, forever, w)) { perror("thread"); return 2; }
            }
        } else { fprintf(stderr, "unknown op %c\n", op); return 3; }
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out || fwrite(base, 1, size, out) != (size_t)size || fclose(out)) {
        perror("out");
        return 2;
    }
    _exit(0); /* the workers never return */
}
"""


class Harness:
    """Kernels of one backend's machine, called in order over one :class:`Arena` in one
    emulated process (see the module doc)."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._modules: dict[str, CrossModule] = {}  # by IR text
        self._symbols: list[str] = []
        self._lines: list[str] = []
        self.compile_seconds = 0.0  # LLVM's, summed over the modules (0 when cached)

    def add(self, backend: Backend, program: Program, spec: Mapping[str, object]) -> dict[str, int]:
        """``program`` for ``backend`` (compiled by ``run``); its functions' indices by short
        name."""
        module = CrossModule.build(backend, program, spec)
        self._modules.setdefault(module.text, module)
        out = {}
        for short, symbol in module.names.items():
            if symbol not in self._symbols:
                self._symbols.append(symbol)
            out[short] = self._symbols.index(symbol)
        return out

    @property
    def kernels(self) -> int:
        """Programs lowered for this run."""
        return len(self._modules)

    @staticmethod
    def _arg(v: int | Ptr) -> str:
        return f"p{v.offset}" if isinstance(v, Ptr) else f"i{int(v)}"

    def call(self, fn: int, *args: int | Ptr) -> None:
        self._lines.append(f"c {fn} {len(args)} " + " ".join(map(self._arg, args)))

    def function_address(self, at: Ptr, fn: int) -> None:
        """Store function ``fn``'s address in the arena word at ``at`` (e.g. pool records)."""
        self._lines.append(f"f {at.offset} {fn}")

    def threads(self, fn: int, count: int, arg: int | Ptr) -> None:
        self._lines.append(f"t {fn} {count} {self._arg(arg)}")

    def run(self, qemu_cpu: str, timeout: float = 120.0) -> tuple[bytes, float]:
        """Link, run under ``qemu-aarch64 -cpu qemu_cpu``; the arena afterwards and the
        seconds the emulated run took."""
        missing = missing_tools()
        if missing:
            raise RuntimeError(
                f"cross harness needs {', '.join(missing)} (Debian: "
                f"apt-get install {' '.join(PACKAGES)})"
            )
        with tempfile.TemporaryDirectory(prefix="dynalm-cross-") as tmp:
            d = Path(tmp)
            objects = compile_objects(list(self._modules.values()))
            self.compile_seconds = sum(seconds for _, seconds in objects)
            for i, (obj, _) in enumerate(objects):
                (d / f"k{i}.o").write_bytes(obj)
            externs = "".join(f"extern void {s}(void);\n" for s in self._symbols)
            table = f"{externs}void *dynalm_fns[] = {{{', '.join(self._symbols) or '0'}}};\n"
            (d / "table.c").write_text(table)
            (d / "driver.c").write_text(_DRIVER)
            cmd = [_GCC, "-O1", "-o", str(d / "run"), str(d / "driver.c"), str(d / "table.c")]
            _check(
                subprocess.run(
                    [*cmd, *map(str, sorted(d.glob("*.o"))), "-lpthread"],
                    capture_output=True,
                    text=True,
                ),
                "link",
            )
            (d / "image").write_bytes(self.arena.image())
            relocs = "".join(f"r {at}\n" for at in self.arena.relocations)
            (d / "calls").write_text(relocs + "\n".join(self._lines) + "\n")
            qemu = [_QEMU, "-L", SYSROOT, "-cpu", qemu_cpu, str(d / "run")]
            t0 = time.perf_counter()
            result = subprocess.run(
                [*qemu, str(d / "image"), str(d / "calls"), str(d / "out")],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            seconds = time.perf_counter() - t0
            _check(result, f"qemu-aarch64 -cpu {qemu_cpu}")
            return (d / "out").read_bytes(), seconds


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"cross harness: {what} failed (exit {result.returncode}): " + " | ".join(tail)
        )


def read(image: bytes, at: Ptr, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array of the arena image a run returned."""
    count = int(np.prod(shape))
    return np.frombuffer(image, dtype, count, at.offset).reshape(shape).copy()
