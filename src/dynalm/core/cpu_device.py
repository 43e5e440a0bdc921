"""The CPU device: weights prepared per mode, the JIT kernels' backend, its threads.

``safe`` runs the numpy references on fp32 weights (the oracle); ``exact`` and ``auto`` run
the JIT kernels of ``core.matmul``, ``core.elementwise`` and ``core.attention`` over the
native worker pool (``core.pool``) on weights kept quantised.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dynalm.core import memory, pool, quant
from dynalm.core.device import MODES, Device, MatmulKernel
from dynalm.core.matmul import AUTO_VALIDATED, ActivationScratch, QuantMatmul
from dynalm.errors import InvalidRequest
from dynalm.kernel import backends, jit, probes
from dynalm.kernel.formats import QK, UNPACKS

if TYPE_CHECKING:
    from dynalm.core.kv_storage import KVGeometry, KVStorage

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


def streaming_read_gbs(threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The host's streaming-read bandwidth now, GB/s: ``probes.STREAM`` summing a buffer
    of ``nbytes`` (far past any cache) on ``threads`` of the pool, best of ``repeats``. The
    roof of a decode step, which reads every weight it uses once; measured when asked, as a
    shared machine's bandwidth moves with its neighbours."""
    buf = np.ones(nbytes, np.uint8)
    pages = buf.size // probes.PAGE
    sums = np.zeros(pages, np.int32)
    args = np.array([buf.ctypes.data, sums.ctypes.data], np.int64)
    fn = backends.select().lower(probes.STREAM, {}).addresses[""]
    at = args.__array_interface__["data"][0]
    threads = threads if pool.available() else 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if threads > 1:
            pool.pool(threads).run(fn, at, pages, -(-pages // threads))
        else:
            jit.cfunc(fn, None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(at, 0, pages)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


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
        pages = "on 2 MiB huge pages" if memory.huge_pages() else "mapped"
        return f"cpu ({self.threads} threads, mode {self.mode}{kernels}, weights {pages})"

    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        """A small weight (norm scale, bias) as fp32."""
        return quant.dequantize(raw, ggml_type, shape[-1]).reshape(shape)

    def matmul_kernel(self, ggml_type: int, shape: tuple[int, int]) -> MatmulKernel:
        """ "numpy" (fp32 weights, dequantised at load: ``safe``, or F32 rows the kernels
        cannot take), "jit-exact" / "jit-auto" (``QuantMatmul``: repacked into its planes,
        ``Unpack.packed_bytes`` per row) or "tiled" (the file's blocks, dequantised per row
        tile for BLAS: formats without a JIT kernel yet, or rows not a multiple of 32
        values). F32 weights take the JIT kernel too: BLAS's own threads spin for a while
        after each call, on the cores the pool's next kernel needs (an F32 MiniLM's
        attention ran at half speed after every BLAS matmul)."""
        n_rows, n_cols = shape
        n = n_rows * n_cols
        if self.mode == "safe":
            return MatmulKernel("numpy", 4 * n)
        if n_cols % QK == 0:
            # auto takes the int8 kernels only where tests/models/test_auto_mode.py validated
            if self.mode == "auto" and ggml_type in AUTO_VALIDATED:
                return MatmulKernel("jit-auto", n_rows * UNPACKS[ggml_type].packed_bytes(n_cols))
            if QuantMatmul.supported(ggml_type, "exact"):
                return MatmulKernel("jit-exact", n_rows * UNPACKS[ggml_type].packed_bytes(n_cols))
        if ggml_type == GGMLQuantizationType.F32:
            return MatmulKernel("numpy", 4 * n)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        return MatmulKernel("tiled", n // block * size)  # resident once read

    def prepared_bytes(self, ggml_type: int, shape: tuple[int, ...], use: str) -> int:
        n = int(np.prod(shape))
        if use == "matmul":
            return self.matmul_kernel(ggml_type, shape).nbytes  # type: ignore[arg-type]
        if use == "experts":  # [E, N, K]: an expert's matmul once routed to (at most all)
            return shape[0] * self.matmul_kernel(ggml_type, shape[1:]).nbytes  # type: ignore[arg-type]
        if use == "embedding":  # rows read from the file per step (safe: dequantised)
            return 4 * n if self.mode == "safe" else 0
        return 4 * n  # a vector in fp32, an index in int32

    def supports(
        self,
        op: str,
        weights: tuple[tuple[int, tuple[int, ...]], ...],
        attrs: Mapping[str, object] = MappingProxyType({}),
    ) -> bool:
        return True  # every op has a kernel or its numpy reference, every format its matmul

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
        kernel = self.matmul_kernel(ggml_type, shape).kind
        if not kernel.startswith("jit-"):
            raw = raw() if callable(raw) else raw
        if kernel == "numpy":
            dense = quant.dequantize(raw, ggml_type, n_cols)
            return lambda x, out: np.matmul(x, dense.T, out=out)
        if kernel.startswith("jit-"):
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
