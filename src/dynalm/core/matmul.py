"""Quantised matmul ``y[T, N] = x[T, K] @ W[N, K]^T``: a weight repacked once into its
kernels' layout, bound to the JIT kernels of ``kernel.matmul_programs`` and run over the native
thread pool.

The kernels themselves (exact fp32 and int8 ``auto``, one pattern per mode over the
per-format unpacks) are DynaKernel programs lowered by the backend ``kernel.backends``
selects for this host (or ``$DYNALM_ISA``); this module keeps what is the device's: the
repacked weights, the activations' int8 scratch, argument blocks and the split of weight
rows over threads.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as _T

from dynalm.core import memory, pool, quant
from dynalm.kernel import backends, layouts, repack_cache
from dynalm.kernel import matmul_programs as programs
from dynalm.kernel.formats import QK, UNPACKS, Unpack
from dynalm.kernel.matmul_programs import (
    A_LDY,
    A_NB,
    A_T,
    A_W,
    A_X,
    A_XD,
    A_XK,
    A_XS,
    A_Y,
    KEY_SUMS,
    N_ARGS,
)

# Formats whose ``auto`` (int8) kernels met the model-level budget of
# tests/models/test_auto_mode.py (mean KL(exact || auto) <= 0.005, top-1 agreement with exact
# >= 98 % on the SmolLM2 test prompts and >= 96 % over its 2,048-token corpus);
# ``CpuDevice`` runs the others' ``exact`` kernels in auto. Measured with the lane kernels on
# SmolLM2 requantised per format (top-1 / KL): the test model (Q4_1 layers, Q8_0 head)
# 98.7 % / 0.0026 on the prompts, 96.9 % / 0.0021 on the corpus; its Q4_0 requantisation
# 96.5 % / 0.0025 on the corpus (on the prompts 96.8 %: 5 flips in 158 positions);
# llama.cpp's Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0) 98.7 % / 0.0025; all-Q5_0 99.4 % / 0.0030;
# all-Q8_0 100 % / 0.0023 (97.1 % / 0.0021 on the corpus). Not admitted: Q5_1 (97.5 % /
# 0.0040 on the prompts, 96.2 % / 0.0025 on the corpus: too near the bar). Q3_K and Q5_K
# have no model to measure on yet. IQ4_NL and IQ4_XS, the test model requantised by
# llama.cpp's quantiser (``llama_cpp.llama_model_quantize``, allow_requantize, ftype
# IQ4_NL: 207 IQ4_NL tensors, 3 Q5_K, the Q8_0 head; ftype IQ4_XS: 27 ffn_down in IQ4_XS,
# 180 IQ4_NL where 576 columns are no multiple of 256, 3 Q5_K): IQ4_NL 96.8 % / 0.0027
# on the prompts, 96.3 % / 0.0023 on the corpus; IQ4_XS 96.2 % / 0.0028 and 96.7 % /
# 0.0022 -- Q4_0's level (admitted on its corpus figures, the prompts' 98 % missed by a few
# flips). Not admitted: MXFP4 (gguf-py's quantiser on the Q4_1 layers: 95.6 % / 0.0051 on
# the prompts, over the KL budget; 96.4 % / 0.0027 on the corpus). Every backend's auto
# kernel computes bitwise the same products (``kernel.matmul_programs``), so the figures
# hold for each.
AUTO_VALIDATED = frozenset(
    {_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q6_K, _T.IQ4_NL, _T.IQ4_XS}
)


# Row counts up to this have argument blocks of their own in each matmul, so that compiled
# step programs of several small step shapes (decode, speculative verification) stay valid
# side by side and a change of step shape costs no rebinding (``Executor``); larger counts
# share one block, rebound per shape.
CACHED_ROWS = 64


# --- threads ---------------------------------------------------------------------------

# Split matmuls with more weight bytes than this over the native pool (a split costs a few
# microseconds; a 192x576 Q4_1 GEMV takes ~7 us on one thread).
_PARALLEL_MIN_BYTES = 32 * 1024


def default_threads() -> int:
    """Threads for matmuls: ``$DYNALM_THREADS`` or the CPUs this process may run on."""
    env = os.environ.get("DYNALM_THREADS")
    return max(1, int(env)) if env else len(os.sched_getaffinity(0))


# --- the public API --------------------------------------------------------------------

# Where a matmul's argument block takes its activations: exact's fp32 rows, or auto's
# quantised ones (quants, block scales, block sums, key sums: ``ActivationScratch.views``).
_X_SLOTS = (A_X, A_XD, A_XS, A_XK)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class ActivationScratch:
    """The int8 activations of ``auto`` matmuls (quants, block scales, block sums, integer
    key sums), one
    buffer shared by every matmul that is given it: matmuls of one executor run one at a
    time, so one buffer for the largest ``[T, K]`` serves them all (a buffer per matmul
    cost 75 MB at T = 512 on SmolLM2). Grown, never shrunk; ``generation`` counts the
    regrowths, which move the buffer (matmuls bound to the old one rebind)."""

    def __init__(self) -> None:
        self.generation = 0
        self._buffer = np.empty(0, np.uint8)

    @staticmethod
    def sizes(t_rows: int, n_cols: int) -> tuple[int, int, int, int]:
        align = lambda n: -(-n // 64) * 64  # noqa: E731 - each part cache-line aligned
        nb, rows = n_cols // QK, t_rows + programs.ROW_OVERREAD  # tiles read past T
        return (
            align(rows * n_cols),
            align(rows * nb * 8),
            align(rows * nb * 4),
            align(rows * nb * 4 * KEY_SUMS),
        )

    def reserve(self, t_rows: int, n_cols: int) -> None:
        need = sum(self.sizes(t_rows, n_cols)) + 64
        if need > self._buffer.size:
            self._buffer = np.empty(need, np.uint8)
            self.generation += 1

    def views(self, t_rows: int, n_cols: int) -> tuple[np.ndarray, ...]:
        """int8 ``[T, K]`` quants, fp32 ``[T, K/32, 2]`` scales, fp32 ``[T, K/32]`` sums,
        int32 ``[T, K/32, KEY_SUMS]`` key sums."""
        self.reserve(t_rows, n_cols)
        nb, (q, d, s, _) = n_cols // QK, self.sizes(t_rows, n_cols)
        start = -_address(self._buffer) % 64
        base = self._buffer[start:]
        k_at, n_keys = q + d + s, t_rows * nb * KEY_SUMS
        return (
            base[: t_rows * n_cols].view(np.int8).reshape(t_rows, n_cols),
            base[q : q + t_rows * nb * 8].view(np.float32).reshape(t_rows, nb, 2),
            base[q + d : q + d + t_rows * nb * 4].view(np.float32).reshape(t_rows, nb),
            base[k_at : k_at + 4 * n_keys].view(np.int32).reshape(t_rows, nb, KEY_SUMS),
        )


class QuantMatmul:
    """y[T, N] = x[T, K] @ W[N, K]^T for a GGUF weight, repacked once into kernel planes.

    Calls are cheapest when the same ``x`` and ``out`` arrays are passed each time (their
    addresses are remembered); one instance must not be called from two threads at once.
    """

    def __init__(
        self,
        raw: np.ndarray | Callable[[], np.ndarray],
        ggml_type: int,
        n_cols: int,
        *,
        mode: str = "exact",
        threads: int | None = None,
        backend: backends.Backend | None = None,
        scratch: ActivationScratch | None = None,
        release_rows: Callable[[int, int], None] | None = None,
        source: tuple[str, str] | None = None,
        n_rows: int | None = None,
    ) -> None:
        """``raw``: the GGUF rows, uint8 ``[N, row bytes]``, or a function that reads them
        (then ``n_rows`` is N), called only if the weight must be repacked;
        ``threads``: default ``default_threads()``; ``backend``: the kernels' backend
        (default ``backends.select()``: the host's best or ``$DYNALM_ISA``); ``scratch``:
        where ``auto`` quantises the activations (default: a buffer of its own);
        ``release_rows(lo, hi)``: called once rows ``lo:hi`` of ``raw`` are repacked, e.g.
        to drop their mapped pages; ``source``: where ``raw``'s bytes come from and that
        file's identity (``kernel.repack_cache``): given, the repacked weight is mapped
        from the repack cache when it holds it, and stored there when not (``repacked``
        says which)."""
        if not self.supported(ggml_type, mode):
            raise ValueError(f"no {mode} matmul kernel for GGUF type {ggml_type}")
        u = UNPACKS[ggml_type]
        if n_cols % QK:
            raise ValueError(f"{u.name}: K={n_cols} is not a multiple of {QK}")
        if not callable(raw):
            self.check_rows(u, raw, n_cols, None)
            n_rows = raw.shape[0]
        elif n_rows is None:
            raise ValueError("n_rows is needed when raw is a function")
        self.ggml_type, self.n_rows, self.n_cols = ggml_type, n_rows, n_cols
        self.mode = programs.effective_mode(ggml_type, mode)
        self._nb = n_cols // QK
        self.backend = backend or backends.select()
        self._kernels = programs.MatmulKernels(ggml_type, self.mode, self.backend, n_cols)
        layout = self._kernels.layout

        def repack() -> np.ndarray:  # (the repack cache holds checked weights)
            rows = raw() if callable(raw) else raw
            return self.checked_repack(ggml_type, rows, n_cols, n_rows, layout, release_rows)

        into = memory.weight_buffer if memory.huge_pages() else None
        if source is None:
            self._weights, self.repacked = repack_cache.placed(repack(), into), True
        else:
            nbytes = -(-n_rows // layout.rows) * layout.rows * u.packed_bytes(n_cols)
            what = f"{u.name} [{n_rows}, {n_cols}] {layout!r}"
            cache = repack_cache.shared()
            self._weights, self.repacked = cache.load_or_build(source, what, nbytes, repack, into)
        self.threads = threads or default_threads()  # (core.grouped_matmul's too)
        self._threads = self.threads if self.parallel(n_rows * u.row_bytes(n_cols)) else 1
        self._chunk = grab_chunk(self._kernels, self.n_rows, self._threads)
        # Argument blocks per row count (see CACHED_ROWS): the product's, and the
        # quantiser's own (x -> (xq, xd, xs); its y slot is the fp32 source).
        self._arg_blocks: dict[int, tuple[ctypes.Array, ctypes.Array]] = {}
        self._use_blocks(0)
        self._x: np.ndarray | None = None
        self._out: np.ndarray | None = None
        self._calls: list[tuple[int, int, int, int, int]] = []
        self._scratch = scratch or ActivationScratch()
        self._generation = -1  # the scratch's generation the bound addresses belong to

    @staticmethod
    def parallel(weight_bytes: int) -> bool:
        """Whether a product over this many bytes of weights is split over the pool."""
        return weight_bytes >= _PARALLEL_MIN_BYTES and pool.available()

    @property
    def kernels(self) -> programs.MatmulKernels:
        return self._kernels

    @property
    def weights(self) -> np.ndarray:
        """The repacked weights, in the kernels' layout."""
        return self._weights

    @staticmethod
    def checked_repack(
        ggml_type: int,
        rows: np.ndarray,
        n_cols: int,
        n_rows: int | None,
        layout: layouts.Layout,
        release_rows: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """A matmul weight's GGUF rows, checked (their shape; every block scale finite:
        `quant.check_scales`) and repacked into ``layout``: how every device prepares one,
        the CPU's kernels and the CUDA device's alike."""
        QuantMatmul.check_rows(UNPACKS[ggml_type], rows, n_cols, n_rows)
        quant.check_scales(rows, ggml_type)
        return layouts.repack(UNPACKS[ggml_type], rows, n_cols, layout, release_rows)

    @staticmethod
    def check_rows(u: Unpack, raw: np.ndarray, n_cols: int, n_rows: int | None) -> None:
        rows = raw.shape[0] if n_rows is None else n_rows
        if raw.dtype != np.uint8 or raw.shape != (rows, u.row_bytes(n_cols)):
            raise ValueError(
                f"{u.name}: expected uint8 [{n_rows or 'N'}, {u.row_bytes(n_cols)}], "
                f"got {raw.dtype} {raw.shape}"
            )

    @staticmethod
    def supported(ggml_type: int, mode: str) -> bool:
        """Whether a kernel exists for this GGUF type in ``mode`` ("exact" or "auto")."""
        return programs.supported(ggml_type, mode)

    def _use_blocks(self, t_rows: int) -> None:
        """Make the argument blocks of ``t_rows`` rows the bound ones: the quantiser's, one
        per tile of ``MatmulKernels.cover``, and the pair's (both tiles as one call)."""
        key = t_rows if t_rows <= CACHED_ROWS else 0
        if key not in self._arg_blocks:
            qargs, *tiles = [(ctypes.c_int64 * N_ARGS)() for _ in range(3)]
            qargs[A_NB] = self._nb
            for args in tiles:
                args[A_W] = _address(self._weights)
                args[A_NB], args[A_LDY] = self._nb, self.n_rows
            self._arg_blocks[key] = (qargs, *tiles, (ctypes.c_int64 * 4)())
        self._qargs, *self._tiles, self._pair = self._arg_blocks[key]
        self._qargs_at, *self._tiles_at, self._pair_at = map(
            ctypes.addressof, self._arg_blocks[key]
        )

    def _bind_x(self, x: np.ndarray) -> None:
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.n_cols:
            raise ValueError(f"x must be float32 [T, {self.n_cols}], got {x.dtype} {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError("x must be C-contiguous")
        t_rows = x.shape[0]
        self._x, self._out = x, None
        self._use_blocks(t_rows)
        self._cover = self._kernels.cover(t_rows)
        self._qargs[A_T] = t_rows
        if self.mode == "exact":  # each tile reads x from its first row on
            views = [(x[first:],) for _, first, _ in self._cover]
        else:  # x quantised into the scratch, each tile reading from its first row on
            quantised = self._scratch.views(t_rows, self.n_cols)
            self._generation = self._scratch.generation
            for slot, view in zip(_X_SLOTS, quantised, strict=True):
                self._qargs[slot] = _address(view)
            self._qargs[A_Y] = _address(x)
            views = [tuple(v[first:] for v in quantised) for _, first, _ in self._cover]
        for args, (_, _, rows), xs_of_tile in zip(self._tiles, self._cover, views, strict=False):
            args[A_T] = rows
            for slot, view in zip(_X_SLOTS, xs_of_tile, strict=False):
                args[slot] = _address(view)

    def _bind_out(self, out: np.ndarray) -> None:
        shape = (self._x.shape[0], self.n_rows)
        if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 {list(shape)}")
        self._out = out
        for args, (_, first, _) in zip(self._tiles, self._cover, strict=False):
            args[A_Y] = _address(out[first:])

    def pending(self, t_rows: int) -> list[backends.Request]:
        """The kernels a product of ``t_rows`` rows calls and nobody has lowered yet (see
        ``backends.lower_all``)."""
        kernels = self._kernels
        cover = kernels.cover(t_rows)
        which = [k for k, _, _ in cover] + ([kernels.pair] if len(cover) > 1 else [])
        which += [kernels.quantize] if self.mode == "auto" else []
        return [r for k in which for r in kernels.pending(k)]

    def records(self, x: np.ndarray, out: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """``self(x, out)`` as native calls: ``pool.Program`` records (kind, fn, args,
        total, chunk), valid while ``x`` and ``out`` stay this object's bound arrays."""
        address = self._kernels.address
        return [(kind, address(k), *rest) for kind, k, *rest in self._plan(x, out)]

    def kernel_calls(self, x: np.ndarray, out: np.ndarray) -> list[tuple[int, int, int]]:
        """``self(x, out)``'s kernels one by one, for running them elsewhere (a GPU's grid):
        (kernel, argument block, rows of the call): the quantiser in auto, then each tile
        of the cover (which the CPU runs as one ``pair`` call when there are two)."""
        self._plan(x, out)
        tiles = zip(self._cover, self._tiles_at, strict=False)
        calls = [(which, at, self.n_rows) for (which, _, _), at in tiles]
        if self.mode == "auto":
            calls.insert(0, (self._kernels.quantize, self._qargs_at, x.shape[0]))
        return calls

    def _plan(self, x: np.ndarray, out: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """Bind ``x``/``out``; the calls of one product: (kind, kernel, args, total, chunk)."""
        moved = self.mode == "auto" and self._generation != self._scratch.generation
        if x is self._x and out is self._out and not moved:
            return self._calls
        if x is not self._x or moved:
            self._bind_x(x)
        self._bind_out(out)
        t_rows, threads = x.shape[0], self._threads
        kernels = self._kernels
        if len(self._cover) == 1:
            calls = [(self._cover[0][0], self._tiles_at[0], self.n_rows, self._chunk)]
        else:  # a ragged batch: its two tiles as one call over the weight rows
            for i, (which, _, _) in enumerate(self._cover):
                self._pair[2 * i], self._pair[2 * i + 1] = kernels.address(which), self._tiles_at[i]
            calls = [(kernels.pair, self._pair_at, self.n_rows, self._chunk)]
        if self.mode == "auto":  # quantise the activations first
            calls.insert(0, (kernels.quantize, self._qargs_at, t_rows, -(-t_rows // threads)))
        self._calls = [kind_of(threads, *call) for call in calls]
        return self._calls

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y = x @ W^T; ``x`` C-contiguous float32 [T, K], ``out`` float32 [T, N] or None."""
        if out is None:
            out = np.empty((x.shape[0], self.n_rows), np.float32)
        run_calls(self._kernels, self._threads, self._plan(x, out))
        return out


def grab_chunk(kernels: programs.MatmulKernels, rows: int, threads: int) -> int:
    """The pool's smallest grab of a job over ``rows`` weight rows (its first grabs are
    larger, see core.pool): small enough to even out uneven threads at the end of a job,
    and whole row groups and tiles (a grab that ends inside a tile computes all of its
    rows)."""
    whole = kernels.row_multiple
    return whole * max(1, -(-rows // (16 * threads * whole)))


def kind_of(
    threads: int, which: int, args: int, total: int, chunk: int
) -> tuple[int, int, int, int, int]:
    """A call (kernel, args, total, chunk) as a record: split over the pool where it pays."""
    return (pool.SPLIT if threads > 1 and total > chunk else pool.RANGE, which, args, total, chunk)


def run_calls(
    kernels: programs.MatmulKernels, threads: int, calls: list[tuple[int, int, int, int, int]]
) -> None:
    """Run records (kind, kernel index, args, total, chunk) of ``kernels`` from Python."""
    for kind, which, args, total, chunk in calls:
        if kind == pool.SPLIT:
            # the pool (its code compiled, its threads started) when first needed
            pool.pool(threads).run(kernels.address(which), args, total, chunk)
        else:
            kernels.call(which)(args, 0, total)
