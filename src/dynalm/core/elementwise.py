"""Element-wise kernels (RMSNorm, RoPE, SwiGLU / GeGLU, add, mul, scale, SiLU / GELU, bias,
column copies and gathers; the encoder's LayerNorm, GELU (erf), attention, pooling and L2
norm), bound to their arrays.

The kernels are DynaKernel programs (``kernel.elementwise_programs``), specialised on their
constant shapes and lowered by the backend ``kernel.backends`` selects for this host (or
``$DYNALM_ISA``, or one passed in), so their vectors are the backend's width.

A kernel is *bound* once to its arrays: the addresses and the row count go into an
int64 argument block, and the returned :class:`BoundKernel` is a zero-argument
callable costing one ctypes call (~1-2 us) per run, lowered when first run (binding
compiles nothing: the executor lowers a step's kernels together). Every binder takes an optional
``block`` (``MAX_WORDS`` int64s), so a caller can keep the blocks of many kernels as rows
of one array and rewrite all their counts with one numpy assignment. The executor binds each step
shape once and then only calls.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import numpy as np

from dynalm.core import pool
from dynalm.core.buffers import check, require
from dynalm.kernel import backends
from dynalm.kernel import elementwise_programs as programs


@functools.cache
def _lowered(backend: backends.Backend, kind: str, **params: object) -> Callable[[int], None]:
    done = backend.lower(programs.PROGRAMS[kind], params)
    return done.cfunc(kind, ctypes.c_void_p)


class BoundKernel:
    """A kernel bound to its arrays: ``kernel()`` runs it (one ctypes call). It is
    lowered when first run or recorded; until then ``pending()`` names it, so that the
    kernels of a step can be lowered together (``backends.lower_all``).

    ``block[0]`` is the count it runs over (rows, or elements for ``add``, ``mul``,
    ``scale``, ``act``, ``gated`` and ``gelu``); lowering it runs the kernel over a prefix of the
    bound rows, never beyond them.
    """

    def __init__(
        self,
        backend: backends.Backend,
        kind: str,
        params: dict[str, object],
        block: np.ndarray,
        arrays: tuple[np.ndarray, ...],
    ) -> None:
        self.block = block  # int64 [1 + n_arrays]: the count, then the arrays' addresses
        self.arrays = arrays  # kept alive while the kernel may run
        self._at = block.__array_interface__["data"][0]
        self._backend, self._kind, self._params = backend, kind, params
        self._fn: Callable[[int], None] | None = None

    def _lower(self) -> Callable[[int], None]:
        self._fn = _lowered(self._backend, self._kind, **self._params)
        return self._fn

    @property
    def request(self) -> backends.Request:
        """(backend, program, spec): what lowers this kernel."""
        return self._backend, programs.PROGRAMS[self._kind], self._params

    def pending(self) -> list[backends.Request]:
        return [] if self._fn else [self.request]

    def __call__(self) -> None:
        (self._fn or self._lower())(self._at)

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """This call as a ``pool.Program`` record."""
        address = ctypes.cast(self._fn or self._lower(), ctypes.c_void_p).value
        return [(pool.PLAIN, address, self._at, 0, 0)]


# The bytes a thread must have to read and write for a split to pay for its hand-off (a
# pool job costs a few microseconds; a thread streams ~64 KB in that time)
SPLIT_BYTES = 1 << 16


class RowsKernel(BoundKernel):
    """A kernel of rows ``fn(block, lo, hi)``, its rows ``[0, block[0])`` split over
    ``threads`` of the native pool when each gets two rows and ``SPLIT_BYTES`` at least
    (``unit_bytes``: what a row of the count reads and writes); else run by the caller."""

    def __init__(self, *args: object, threads: int, unit_bytes: int) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.threads = threads if pool.available() else 1
        self._least = max(2, -(-SPLIT_BYTES // max(1, unit_bytes)))  # rows a thread
        self._address = 0

    def _lower(self) -> Callable[..., None]:
        done = self._backend.lower(programs.PROGRAMS[self._kind], self._params)
        self._address = done.addresses[self._kind]
        self._fn = done.cfunc(self._kind, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
        return self._fn

    def _split(self) -> tuple[int, int] | None:
        """(rows, chunk) when the rows are split over the pool, else None."""
        rows = int(self.block[0])
        if self.threads > 1 and rows >= self._least * self.threads:
            return rows, max(1, rows // (8 * self.threads))
        return None

    def __call__(self) -> None:
        fn = self._fn or self._lower()
        split = self._split()
        if split is None:
            fn(self._at, 0, int(self.block[0]))
        else:
            pool.pool(self.threads).run(self._address, self._at, *split)

    def records(self) -> list[tuple[int, int, int, int, int]]:
        if not self._fn:
            self._lower()
        split = self._split()
        if split is None:
            return [(pool.RANGE, self._address, self._at, int(self.block[0]), 0)]
        return [(pool.SPLIT, self._address, self._at, *split)]


MAX_WORDS = 1 + max(programs.ARRAYS.values())  # the largest argument block (rope's)


def _address(a: np.ndarray | ctypes._CFuncPtr) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return ctypes.cast(a, ctypes.c_void_p).value


def _bind(
    kind: str,
    backend: backends.Backend | None,
    params: dict[str, object],
    count: int,
    arrays: tuple[np.ndarray | ctypes._CFuncPtr, ...],
    block: np.ndarray | None,
    threads: int = 1,
    unit_bytes: int = SPLIT_BYTES,
) -> BoundKernel:
    """The kernel ``kind`` over ``count`` bound to ``arrays`` (its words written into
    ``block``; a ctypes function: its address): a ``RowsKernel`` whose count is split over
    ``threads`` (``unit_bytes`` a unit of the count's bytes; by default every split
    pays), or a ``BoundKernel`` for the ``programs.SERIAL`` ones."""
    words = [count, *(_address(a) for a in arrays)]
    if block is None:
        block = np.empty(len(words), np.int64)
    check("argument block", block, np.int64, (None,))
    require(block.size >= len(words), f"argument block of {block.size} words, need {len(words)}")
    block[: len(words)] = words
    backend = backend or backends.select()
    if kind in programs.SERIAL:
        return BoundKernel(backend, kind, params, block, arrays)
    return RowsKernel(backend, kind, params, block, arrays, threads=threads, unit_bytes=unit_bytes)


def _same(names: str, *arrays: np.ndarray) -> tuple[int, ...]:
    """Dense float32 arrays of one shape (the first one's), which is returned."""
    shape = arrays[0].shape
    for name, a in zip(names.split(), arrays, strict=True):
        check(name, a, np.float32, shape)
    return shape


def add(
    out: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = x + y`` (same shapes; ``out`` may be ``x`` or ``y``). Every binder runs its
    kernel as ``backend`` (default ``backends.select()``) lowers it."""
    _same("out x y", out, x, y)
    return _bind("add", backend, {}, out.size, (out, x, y), block, threads, 12)


def mul(
    out: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = x * y`` (same shapes)."""
    _same("out x y", out, x, y)
    return _bind("mul", backend, {}, out.size, (out, x, y), block, threads, 12)


def scale(
    out: np.ndarray,
    x: np.ndarray,
    factor: float,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = x * factor``, the factor rounded to fp32 (numpy's ``x * np.float32(factor)``)."""
    _same("out x", out, x)
    require(math.isfinite(factor), f"scale factor {factor} is not finite")
    params = {"factor": float(np.float32(factor))}
    return _bind("scale", backend, params, out.size, (out, x), block, threads, 8)


def activation(
    out: np.ndarray,
    x: np.ndarray,
    kind: str,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = act(x)``, ``kind`` "silu" or "gelu_tanh" (the gated kernels' activation), or
    "tanh" (a reranker's classification head)."""
    _same("out x", out, x)
    require(kind in ("silu", "gelu_tanh", "tanh"), f"unknown activation {kind!r}")
    return _bind("act", backend, {"activation": kind}, out.size, (out, x), block, threads, 8)


def bias(
    out: np.ndarray,
    x: np.ndarray,
    b: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = x + b`` per row of ``x [rows, width]``, ``b [width]`` (``out`` may be ``x``)."""
    rows, width = _same("out x", out, x)
    check("bias", b, np.float32, (width,))
    return _bind("bias", backend, {"width": width}, rows, (out, x, b), block, threads, 8 * width)


def _route_top_k(route: np.ndarray, n_rows: int | None = None) -> int:
    """A route's slots: it must be float32 ``[T, 2 top_k]`` (ids, then weights)."""
    width = check("route", route, np.float32, (n_rows, None)).shape[1]
    require(width > 0 and width % 2 == 0, f"route of {width} columns: not ids then weights")
    return width // 2


def combine(
    out: np.ndarray,
    y: np.ndarray,
    route: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """A mixture's ``moe_combine``: ``out [T, N]`` = the slots of ``y [T, top_k * N]``
    weighted by ``route [T, 2 top_k]``'s weights, added in slot order."""
    n_rows, width = check("out", out, np.float32, (None, None)).shape
    top_k = _route_top_k(route, n_rows)
    check("y", y, np.float32, (n_rows, top_k * width))
    params, unit = {"width": width, "top_k": top_k}, 4 * width * (top_k + 1)
    return _bind("combine", backend, params, n_rows, (out, y, route), block, threads, unit)


def moe_route(
    out: np.ndarray,
    logits: np.ndarray,
    top_k: int,
    gating: int,
    normalize: bool,
    scale: float,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """A mixture's router: ``out [T, 2 top_k]`` = each row of ``logits [T, E]``'s chosen
    experts, then their weights (``cpu_ops.moe_route``, the reference: the same choices
    and weights within the exponential's rounding)."""
    n_rows, n_experts = check("logits", logits, np.float32, (None, None)).shape
    check("out", out, np.float32, (n_rows, 2 * top_k))
    require(
        0 < top_k <= n_experts and gating in (1, 2), f"top {top_k} of {n_experts}, gating {gating}"
    )
    params = {
        "n_experts": n_experts,
        "top_k": top_k,
        "gating": gating,
        "normalize": bool(normalize),
        "scale": float(np.float32(scale)),
    }
    unit = 4 * n_experts * (top_k + 3)  # (the top-k scans: a pass over the logits each)
    return _bind("moe_route", backend, params, n_rows, (out, logits), block, threads, unit)


# ``select_experts``' miss: an expert's weights' address, that expert prepared first
MISS = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)


def select_experts(
    weights: np.ndarray,
    route: np.ndarray,
    table: np.ndarray,
    counter: np.ndarray,
    miss: ctypes._CFuncPtr,
    *,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """A small step's experts' weights into ``weights`` (an int64 column, a row per (token,
    slot) pair of ``route [T, 2 top_k]``: a grouped matmul's argument blocks) from
    ``table`` (int64 [E]: each expert's weights' address, 0 where ``miss(e)`` (a ``MISS``,
    kept alive by the caller) gives it); ``counter`` (int64 [2]) += (T top_k, 1)."""
    n_rows, top_k = len(route), _route_top_k(route)
    pairs = n_rows * top_k
    column = weights.dtype == np.int64 and weights.shape == (pairs,) and weights.strides[0] >= 8
    require(column, f"weights: an int64 column of {pairs}, got {weights.dtype} {weights.shape}")
    check("table", table, np.int64, (None,))
    check("counter", counter, np.int64, (2,))
    params = {"n_experts": len(table), "top_k": top_k, "stride": weights.strides[0] // 8}
    arrays = (weights, route, table, counter, miss)
    return _bind("select_experts", backend, params, n_rows, arrays, None)


def expert_bias(
    out: np.ndarray,
    bias: np.ndarray,
    route: np.ndarray,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """A small step's expert matmul's biases: ``out [T top_k, N]`` row f += ``bias [E, N]``
    row e, e the expert of (token, slot) pair f in ``route [T, 2 top_k]``."""
    n_rows, top_k = len(route), _route_top_k(route)
    n_experts, width = check("bias", bias, np.float32, (None, None)).shape
    check("out", out, np.float32, (n_rows * top_k, width))
    params = {"width": width, "n_experts": n_experts, "top_k": top_k}
    unit = 12 * width * top_k
    return _bind("expert_bias", backend, params, n_rows, (out, bias, route), None, threads, unit)


def columns(
    out: np.ndarray,
    x: np.ndarray,
    start: int = 0,
    index: np.ndarray | None = None,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = x[:, start:start + width]`` (a split's copy), or with ``index`` (int32, one per
    column of ``out``, each below ``x``'s width: a permutation) ``x[:, index]``. The rows
    of ``x`` and ``out`` may be strided (views of some columns of wider buffers)."""
    rows, width = check("out", out, np.float32, (None, None), strided_rows=True).shape
    check("x", x, np.float32, (rows, None), strided_rows=True)
    if index is None:
        fits = start >= 0 and start + width <= x.shape[1]
        require(fits, f"columns {start}+{width} of {x.shape}")
        source = x[:, start:]
        arrays = (out, source, source)  # the index word unread: any device address
    else:
        check("index", index, np.int32, (width,))
        source, arrays = x, (out, x, index)
    params = {
        "width": width,
        "src_stride": source.strides[0] // 4,
        "dst_stride": out.strides[0] // 4,
        "gather": index is not None,
    }
    return _bind("columns", backend, params, rows, arrays, block, threads, 8 * width)


def rows(
    out: np.ndarray,
    x: np.ndarray,
    index: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out[r] = x[index[r]]`` for each row of ``out`` (``index`` int64, one per row of
    ``out``): the embedding lookup from a dense table and ``select_rows``. The rows of
    ``x`` and ``out`` may be strided; an index outside ``x``'s rows reads its last row
    (the kernel's guard; callers check ids first)."""
    n, width = check("out", out, np.float32, (None, None), strided_rows=True).shape
    check("x", x, np.float32, (None, width), strided_rows=True)
    check("index", index, np.int64, (n,))
    require(len(x) > 0, "a row gather from an empty table")
    params = {
        "width": width,
        "src_stride": x.strides[0] // 4,
        "dst_stride": out.strides[0] // 4,
        "n_src": len(x),
    }
    return _bind("rows", backend, params, n, (out, x, index), block, threads, 8 * width)


def gated(
    out: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    activation: str,
    block: np.ndarray | None = None,
    *,
    alpha: float = 1.0,
    limit: float = 0.0,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = act(gate) * up`` with ``activation`` "silu" (SwiGLU) or "gelu_tanh" (GeGLU),
    or gpt-oss's "swiglu_oai" of ``alpha`` and ``limit`` (``cpu_ops.swiglu_oai``)."""
    _same("out gate up", out, gate, up)
    known = ("silu", "gelu_tanh", "swiglu_oai")
    require(activation in known, f"unknown gate activation {activation!r}")
    params: dict[str, object] = {"activation": activation}
    if activation == "swiglu_oai":
        finite = math.isfinite(alpha) and math.isfinite(limit) and limit >= 0
        require(finite, f"swiglu_oai alpha {alpha}, limit {limit}: finite, the limit >= 0")
        params |= {"alpha": float(np.float32(alpha)), "limit": float(np.float32(limit))}
    return _bind("gated", backend, params, out.size, (out, gate, up), block, threads, 12)


def rms_norm(
    out: np.ndarray,
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """RMSNorm of each row of ``x [rows, width]`` scaled by ``weight [width]``."""
    rows, width = check("x", x, np.float32, (None, None)).shape
    check("out", out, np.float32, (rows, width))
    check("weight", weight, np.float32, (width,))
    require(math.isfinite(eps) and eps > 0, f"rms_norm epsilon {eps} is not a positive number")
    params = {"width": width, "eps": float(np.float32(eps))}
    return _bind("rms_norm", backend, params, rows, (out, x, weight), block, threads, 12 * width)


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
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
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
    params = {
        "n_heads": width // head_dim,
        "head_dim": head_dim,
        "rope_dim": rope_dim,
        "neox": neox,
        "stride": x.strides[0] // 4,
    }
    arrays = (out, x, positions, cos, sin)
    return _bind("rope", backend, params, rows, arrays, block, threads, 12 * width)


def layer_norm(
    out: np.ndarray,
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    eps: float,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """LayerNorm of each row of ``x [rows, width]``, scaled by ``weight`` plus ``bias``; the
    rows split over ``threads`` (each row alone: bitwise the same however split)."""
    rows, width = check("x", x, np.float32, (None, None)).shape
    check("out", out, np.float32, (rows, width))
    check("weight", weight, np.float32, (width,))
    check("bias", bias, np.float32, (width,))
    require(math.isfinite(eps) and eps > 0, f"layer_norm epsilon {eps} is not a positive number")
    params = {"width": width, "eps": float(np.float32(eps))}
    arrays = (out, x, weight, bias)
    return _bind("layer_norm", backend, params, rows, arrays, block, threads, 12 * width)


def gelu(
    out: np.ndarray,
    x: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """``out = gelu(x)``, the erf form (same shapes; ``out`` may be ``x``), the elements
    split over ``threads`` (each lane on its own: bitwise the same however split)."""
    _same("out x", out, x)
    return _bind("gelu", backend, {}, out.size, (out, x), block, threads, 8)


def l2_norm(
    out: np.ndarray,
    x: np.ndarray,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """Each row of ``x`` divided by its Euclidean norm (at least 1e-12)."""
    rows, width = _same("out x", out, x)
    return _bind("l2_norm", backend, {"width": width}, rows, (out, x), block, threads, 12 * width)


def pool_rows(
    out: np.ndarray,
    x: np.ndarray,
    last: np.ndarray,
    mode: int,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """One row of ``out`` per sequence of ``x [T, width]``: the mean of its rows, its first
    or its last (``mode``: ``programs.POOL_*``); sequence ``s`` ends at row ``last[s]``
    (int64, increasing) and starts after the one before. The count is the sequences; the
    caller keeps ``last`` within ``x``'s rows (the kernel cannot see it)."""
    seqs, width = check("out", out, np.float32, (None, None)).shape
    check("x", x, np.float32, (None, width))
    check("last", last, np.int64, (None,))
    require(len(last) >= seqs, f"{len(last)} sequence ends for {seqs} rows")
    modes = (programs.POOL_MEAN, programs.POOL_CLS, programs.POOL_LAST)
    require(mode in modes, f"pooling mode {mode} is not one of {modes}")
    params = {"width": width, "mode": mode}
    return _bind("pool", backend, params, seqs, (out, x, last), block, threads)


def encoder_attention(
    out: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    last: np.ndarray,
    head_dim: int,
    scale: float,
    block: np.ndarray | None = None,
    *,
    threads: int = 1,
    backend: backends.Backend | None = None,
) -> BoundKernel:
    """Bidirectional attention of the sequences packed in ``q``/``k``/``v`` ``[T,
    heads * head_dim]`` (dense), sequence ``s`` ending at row ``last[s]`` (see ``pool``):
    every query attends to every key of its own sequence. The count is the query rows
    (all of ``out``'s, or fewer: the step's); the caller keeps ``last`` increasing and
    ending at the count's last row (the kernel cannot see it). The rows are split over
    ``threads``."""
    rows, width = _same("out q k v", out, q, k, v)
    require(head_dim >= 1 and width % head_dim == 0, f"rows of {width} are not heads of {head_dim}")
    check("last", last, np.int64, (None,))
    require(len(last) >= 1, "no sequence ends")
    require(math.isfinite(scale), f"attention scale {scale} is not finite")
    params = {"n_heads": width // head_dim, "head_dim": head_dim,
              "scale": float(np.float32(scale)), "max_keys": rows}  # fmt: skip
    arrays = (out, q, k, v, last)
    return _bind("encoder_attention", backend, params, rows, arrays, block, threads)
