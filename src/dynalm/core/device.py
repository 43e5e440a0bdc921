"""Devices: where weights, activations and KV pages live, and the kernels that run there.

A ``Device`` prepares each weight for itself, owns the step's buffers and the KV pages'
bytes, and runs its kernels; it never sees a graph node (``ir.lower`` binds a graph's ops to
a device's kernels). ``CpuDevice`` is the first implementation.

Which device runs a model is ``select_device``'s choice: the CPU, or per GPU kind
(``GPU_KINDS``) an entry with a probe (available, or why not), a capacity check against the
model's memory plan and its device class. CUDA is a preview (``core.cuda_device``); Metal and
Vulkan have no device class yet, so their entries say why.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from dynalm.core import quant
from dynalm.core.matmul import AUTO_VALIDATED, ActivationScratch, QuantMatmul
from dynalm.errors import DeviceUnavailable, InvalidRequest
from dynalm.kernel import backends

if TYPE_CHECKING:
    from dynalm.core.kv_storage import KVGeometry, KVStorage

log = logging.getLogger(__name__)

MODES = ("auto", "exact", "safe")
BACKENDS = ("auto", "cpu", "gpu")

MatmulFn = Callable[[np.ndarray, np.ndarray], None]  # (x [T, K], out [T, N])

# Dequantise this many bytes of fp32 weights at a time in the tiled matmul, so a
# tile stays in the L2 cache while BLAS multiplies it.
_TILE_BYTES = 512 * 1024


def physical_cores() -> int:
    """Cores without SMT siblings (the right default thread count for kernels)."""
    try:
        siblings = set()
        for cpu in os.listdir("/sys/devices/system/cpu"):
            path = f"/sys/devices/system/cpu/{cpu}/topology/thread_siblings_list"
            if cpu.startswith("cpu") and os.path.exists(path):
                with open(path) as f:
                    siblings.add(f.read().strip())
        return max(1, len(siblings)) if siblings else (os.cpu_count() or 1)
    except OSError:
        return os.cpu_count() or 1


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask): the most threads worth running."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Device(ABC):
    """Where a graph runs: weights prepared for it, buffers, KV pages and kernels.

    A new backend is one device class (this interface), its binder (``ir.lower``: an op
    table covering ``ir/ops.py``'s ``OPS``) and one ``GPU_KINDS`` entry; the kernels it runs
    come from its own kernel-language lowering module.
    """

    name: ClassVar[str]
    mode: str  # auto | exact | safe (what the memory plan sizes the weights for)
    threads: int
    repack_seconds = 0.0  # spent preparing weights (--verbose, bench)
    repacked = mapped = 0  # weights prepared anew / mapped from a cache of prepared ones

    @abstractmethod
    def describe(self) -> str:
        """One line for --verbose: the device and how it runs kernels."""

    # -- weights: each prepared once, for this device
    @abstractmethod
    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> object:
        """A small weight (norm scale, bias)."""

    @abstractmethod
    def matmul(self, raw: object, ggml_type: int, shape: tuple[int, int], **how: object) -> object:
        """A matmul weight ``[N, K]`` prepared as ``out = x @ W.T``."""

    @abstractmethod
    def embedding(
        self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], **how: object
    ) -> object:
        """A row lookup table."""

    def holds_copy(self, prepared: object) -> bool:
        """Whether a prepared matmul weight keeps its own copy (the file's bytes may go)."""
        return False

    # -- buffers
    @abstractmethod
    def buffer(self, rows: int, width: int, dtype: type = np.float32) -> np.ndarray:
        """A planned activation or input buffer ``[rows, width]`` in this device's memory
        (sliced by rows for each step's token count)."""

    @abstractmethod
    def kv_storage(self, geometry: KVGeometry) -> KVStorage:
        """The KV pages' bytes, in the layout this device's attention reads (the runtime's
        ``PagePool`` keeps the accounting: ids, refcounts, recent buffers)."""


class CpuDevice(Device):
    """Runs DynaIR ops with numpy and quantised-weight matmuls.

    ``safe``: every weight dequantised to fp32 at load, plain numpy (the oracle).
    ``exact``: weights stay quantised; fp32 activations; the JIT kernels of
    ``core.matmul`` dequantise weights in registers (formats without a kernel yet
    dequantise cache-sized row tiles and multiply them with BLAS).
    ``auto``: the fastest validated path: the int8 kernels for formats in
    ``matmul.AUTO_VALIDATED``, ``exact`` kernels for the rest.
    """

    name = "cpu"

    def __init__(self, mode: str = "auto", threads: int | None = None):
        if mode not in MODES:
            raise InvalidRequest(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
        if threads is not None and not 1 <= threads <= available_cpus():
            raise InvalidRequest(
                f"--threads {threads}: choose from 1 to {available_cpus()}, the CPUs this "
                "process may run on"
            )
        self.mode = mode
        self.threads = threads or physical_cores()
        try:  # the kernels' backend: the host's best, or $DYNALM_ISA's
            self.backend = backends.select() if mode != "safe" else None
        except backends.BackendUnavailable as e:
            raise InvalidRequest(f"$DYNALM_ISA: {e}") from None
        self.repack_seconds = 0.0  # spent repacking weights for the JIT kernels (--verbose)
        self.repacked = self.mapped = 0  # JIT weights repacked / mapped from the repack cache

    def describe(self) -> str:
        kernels = f", kernels {self.backend.name}" if self.backend else ""
        return f"cpu ({self.threads} threads, mode {self.mode}{kernels})"

    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        """A small weight (norm scale, bias) as fp32."""
        return quant.dequantize(raw, ggml_type, shape[-1]).reshape(shape)

    def matmul_kernel(self, ggml_type: int) -> str:
        """Which matmul serves a weight type in this mode (see ``matmul_kernel_for``)."""
        return self.matmul_kernel_for(self.mode, ggml_type)

    @staticmethod
    def matmul_kernel_for(mode: str, ggml_type: int) -> str:
        """Which matmul serves a weight type in ``mode``: "numpy" (fp32 weights),
        "jit-exact" / "jit-auto" (``QuantMatmul``) or "tiled" (dequantised row tiles + BLAS)."""
        if mode == "safe" or ggml_type == GGMLQuantizationType.F32:
            return "numpy"
        # auto takes the int8 kernels only where tests/models/test_auto_mode.py validated them.
        if mode == "auto" and ggml_type in AUTO_VALIDATED:
            return "jit-auto"
        return "jit-exact" if QuantMatmul.supported(ggml_type, "exact") else "tiled"

    def matmul(
        self,
        raw: np.ndarray | Callable[[], np.ndarray],
        ggml_type: int,
        shape: tuple[int, int],
        *,
        scratch: ActivationScratch | None = None,
        release_rows: Callable[[int, int], None] | None = None,
        source: tuple[str, str] | None = None,
    ) -> MatmulFn:
        """``out = x @ W.T`` for a weight ``W`` of ``shape`` ``[N, K]`` stored in ``raw``
        (or read by calling it, only when needed). A JIT kernel repacks ``raw`` into memory
        of its own, calling ``release_rows(lo, hi)`` as it goes, or with ``source`` (where
        the bytes lie, see ``kernel.repack_cache``) maps the repack cache's copy; it
        quantises activations in ``scratch`` (see ``QuantMatmul``)."""
        n_rows, n_cols = shape
        kernel = self.matmul_kernel(ggml_type)
        if not kernel.startswith("jit-") or n_cols % 32:
            raw = raw() if callable(raw) else raw
        if kernel == "numpy":
            dense = quant.dequantize(raw, ggml_type, n_cols)
            return lambda x, out: np.matmul(x, dense.T, out=out)
        if kernel.startswith("jit-") and n_cols % 32 == 0:
            t0 = time.perf_counter()
            mm = QuantMatmul(
                raw,
                ggml_type,
                n_cols,
                mode=kernel.removeprefix("jit-"),
                threads=self.threads,
                backend=self.backend,
                scratch=scratch,
                release_rows=release_rows,
                source=source,
                n_rows=n_rows,
            )
            if mm.repacked:
                self.repacked += 1
                self.repack_seconds += time.perf_counter() - t0
            else:
                self.mapped += 1
            return mm
        # Formats without a JIT kernel yet: dequantise L2-sized row tiles, multiply with BLAS.
        tile_rows = max(1, _TILE_BYTES // (4 * n_cols))
        tiles = [(r, min(n_rows, r + tile_rows)) for r in range(0, n_rows, tile_rows)]

        def tiled(x: np.ndarray, out: np.ndarray) -> None:
            for r0, r1 in tiles:
                w = quant.dequantize(raw[r0:r1], ggml_type, n_cols)
                np.matmul(x, w.T, out=out[:, r0:r1])

        return tiled

    def embedding(
        self,
        raw: np.ndarray,
        ggml_type: int,
        shape: tuple[int, int],
        *,
        read_rows: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Row lookup: ``out[i] = table[ids[i]]``, dequantising only the rows asked for, read
        by ``read_rows(ids)`` when given (default: from ``raw``)."""
        n_cols = shape[1]
        if self.mode == "safe":
            dense = quant.dequantize(raw, ggml_type, n_cols)
            return lambda ids, out: np.take(dense, ids, axis=0, out=out)
        rows = read_rows or raw.__getitem__

        def lookup(ids: np.ndarray, out: np.ndarray) -> None:
            out[...] = quant.dequantize(rows(ids), ggml_type, n_cols)

        return lookup

    def holds_copy(self, prepared: object) -> bool:
        return isinstance(prepared, QuantMatmul)  # repacked into memory of its own

    def buffer(self, rows: int, width: int, dtype: type = np.float32) -> np.ndarray:
        return np.empty((rows, width), dtype)

    def kv_storage(self, geometry: KVGeometry) -> KVStorage:
        from dynalm.core.kv_storage import HostKVStorage

        return HostKVStorage(geometry)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class DeviceKind:
    """One kind of GPU device ``--backend auto|gpu`` may choose: whether this machine can
    run it (``probe``: None, or why not in one line), how much memory it has, and its device
    class (``create(mode, threads)``; None until that class is built)."""

    name: str
    label: str
    probe: Callable[[], str | None]
    memory: Callable[[], int] | None = None  # bytes of device memory, asked once usable
    create: Callable[[str, int | None], Device] | None = None

    def unavailable(self) -> str | None:
        """None when this kind can run a model here, else why not."""
        reason = self.probe()
        if reason is None and self.create is None:
            reason = f"no {self.label} device class is built into this DynaLM yet"
        return reason

    def too_small(self, need: int) -> str | None:
        """Why a model needing ``need`` bytes of device memory does not fit, or None."""
        have = self.memory() if self.memory is not None else None
        if have is not None and need > have:
            return (
                f"the model needs {_mib(need)} of device memory (weights, KV pool, "
                f"activations of the memory plan), the {self.label} device has {_mib(have)}"
            )
        return None


def _cuda_probe() -> str | None:
    """None when a CUDA device is usable (the driver binding's probe), else why not."""
    from dynalm.core import cuda_driver

    return cuda_driver.probe()


def _cuda_device(mode: str, threads: int | None) -> Device:
    from dynalm.core.cuda_device import CudaDevice

    device = CudaDevice(mode, threads)
    device.self_check()
    return device


def _cuda_memory() -> int:
    from dynalm.core import cuda_driver

    return max(d.total_memory for d in cuda_driver.devices(cuda_driver.load()))


# The GPU kinds in the order ``--backend auto`` tries them. A new GPU backend is one entry
# here (probe, memory, its Device class as ``create``).
GPU_KINDS: list[DeviceKind] = [
    DeviceKind("cuda", "CUDA (preview)", _cuda_probe, _cuda_memory, _cuda_device),
    DeviceKind(
        "vulkan", "Vulkan", lambda: "no Vulkan device support built yet (SPIR-V preview only)"
    ),
    DeviceKind("metal", "Metal", lambda: "no Metal device support built yet"),
]


def select_device(
    backend: str = "auto",
    mode: str = "auto",
    threads: int | None = None,
    need: Callable[[str], int] | None = None,
) -> Device:
    """The device for ``--backend``: ``cpu``; ``gpu``: the first GPU kind available here that
    holds the model (``need(mode)``: the bytes of device memory the memory plan asks for),
    else ``DeviceUnavailable`` with the reasons; ``auto``: that GPU, else the CPU (the
    reasons logged, shown with --verbose)."""
    if backend not in BACKENDS:
        raise InvalidRequest(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if backend == "cpu":
        return CpuDevice(mode, threads)
    reasons = []
    for kind in GPU_KINDS:
        reason = kind.unavailable()
        if reason is None and mode == "safe":
            reason = "--mode safe is the CPU's fp32 numpy reference"
        if reason is None and need is not None:
            reason = kind.too_small(need(mode))
        if reason is None:
            assert kind.create is not None  # unavailable() says so otherwise
            try:
                device = kind.create(mode, threads)
            except DeviceUnavailable as e:  # it failed to start or its self-check
                reasons.append(f"{kind.name}: {e}")
                continue
            log.info("backend %s: using %s", backend, kind.label)
            return device
        reasons.append(f"{kind.name}: {reason}")
    why = "; ".join(reasons)
    if backend == "gpu":
        raise DeviceUnavailable(f"--gpu: no usable GPU ({why}); use --cpu")
    log.info("backend auto: using the CPU (%s)", why)
    return CpuDevice(mode, threads)


def describe_devices() -> list[str]:
    """``dynalm show --system``'s devices: the CPU with its kernel backend, and each GPU
    kind with whether it is available here or why not."""
    try:
        kernels = backends.select().name
    except backends.BackendUnavailable as e:
        kernels = f"none ({e})"
    lines = [f"  {'cpu':<8}available: kernels {kernels} ({physical_cores()} cores)"]
    for kind in GPU_KINDS:
        reason = kind.unavailable()
        lines.append(
            f"  {kind.name:<8}{'available' if reason is None else 'unavailable: ' + reason}"
        )
    return lines
