"""Paged attention bound to a layer's buffers: the page tables of a step, checks, threads.

The kernel is the DynaKernel program ``kernel.attention_program`` (blockwise online softmax over
keys read through page tables, in f32, f16 or q8_0 storage, with q8_0's recent f16
window), lowered by the backend ``kernel.backends`` selects (or one passed in) and
specialised per (kv dtype, heads, kv heads, head dim, page size, recent window).
Everything a layer's kernel needs is bound once: its argument block holds the layer's
buffers (q, k and v may be column ranges of a wider merged buffer: each has a row stride)
and points at one :class:`StepLayout` block that the executor fills once per step (token
count, page tables, sequences, positions, slots). A decode step's attention is then one
ctypes call per layer, with no per-call Python work beyond choosing threads. Work items
are independent, so the native pool splits them across threads, or, in a step of too few
items (a decode), each item's split-K chunks (``parts``, then ``merge``: the same bits as
one thread's); the numpy ``cpu_ops.attention`` is the reference.
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING

import numpy as np

from dynalm.core import pool
from dynalm.core.buffers import check, require
from dynalm.kernel import backends
from dynalm.kernel.attention_program import (
    A_K,
    A_K_NEW,
    A_K_STRIDE,
    A_KR,
    A_KS,
    A_OUT,
    A_Q,
    A_Q_STRIDE,
    A_SCALE,
    A_SINKS,
    A_SLICES,
    A_STEP,
    A_TILED,
    A_V,
    A_V_NEW,
    A_V_STRIDE,
    A_VR,
    A_VS,
    A_WINDOW,
    ATTENTION,
    CHUNK,
    FUNCTIONS,
    N_ARGS,
    N_STEP,
    S_END,
    S_PARTS,
    TILE,
    parts_bytes,
    supported,
    work_items,
)

if TYPE_CHECKING:
    from dynalm.core.kv_storage import AttentionBatch, HostKVStorage


def _request(backend: backends.Backend, dtype: str, *geometry: float) -> backends.Request:
    """The program's ``items``, ``write``, ``write_recent`` and ``run`` for ``backend``."""
    names = ("n_heads", "n_kv_heads", "head_dim", "page", "recent", "softcap")
    return backend, ATTENTION, {"dtype": dtype, **dict(zip(names, geometry, strict=True))}


def _addr(a: np.ndarray) -> int:
    """The address of an array's data; through ctypes it costs ~0.4 us instead of the
    ~2-3 us of ``__array_interface__``, which is left for read-only and empty arrays."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.__array_interface__["data"][0]


def row_stride(what: str, x: np.ndarray, rows: int, width: int) -> int:
    """Floats between the rows of ``x``: f32 ``[rows, width]`` with contiguous rows."""
    return check(what, x, np.float32, (rows, width), strided_rows=True).strides[0] // 4


def check_layout(batch: AttentionBatch, n: int) -> None:
    """The kernels index the pages with the step's page tables and slots, walk each token's
    keys up to its sequence's length through its table, and read recent buffers from their
    first rows: all must lie in the pool."""
    kv, (pages, seq_of, _, recent_rows, _), slots = batch.kv, batch.kernel_tables, batch.slots
    require(len(seq_of) == n, f"{len(seq_of)} tokens in the page tables, {n} slots")
    g = kv.geometry
    if not (n and g.n_layers):
        return
    require(slots.min() >= 0 and slots.max() < g.slot_shape[0], "a KV slot outside the pool")
    require(pages.min() >= 0 and pages.max() < g.n_pages, "a page id outside the pool")
    widths = np.array([len(p) for p in batch.page_tables]) * kv.page_size
    require(bool((batch.seq_lens <= widths).all()), "a sequence longer than its pages")
    if kv.recent:
        end = recent_rows.max() + kv.recent
        require(recent_rows.min() >= 0 and end <= g.recent_shape[0], "a recent buffer outside")


def work_order(
    query_start: np.ndarray, seq_of: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """The step's tokens in work order: those that run alone, then tiles of ``TILE``
    consecutive tokens of a sequence at consecutive positions within one ``CHUNK`` of keys
    (so, without a window, each query of a tile has as many split-K chunks); and the
    counts of both. Each run of such tokens makes as many whole tiles as it holds. A step
    of no sequence with a tile's tokens (a decode) costs a few microseconds."""
    n = len(seq_of)
    if n < TILE or np.diff(query_start).max() < TILE:
        return np.arange(n, dtype=np.int64), n, 0
    p = positions[:n]
    breaks = np.ones(n, bool)
    breaks[1:] = (seq_of[1:] != seq_of[:-1]) | (p[1:] != p[:-1] + 1) | (p[1:] % CHUNK == 0)
    starts = np.flatnonzero(breaks)
    run = np.cumsum(breaks) - 1
    lengths = np.diff(starts, append=n)
    tiled = np.arange(n) - starts[run] < (lengths - lengths % TILE)[run]
    order = np.concatenate([np.flatnonzero(~tiled), np.flatnonzero(tiled)])
    n_tiled = int(np.count_nonzero(tiled))
    return order, n - n_tiled, n_tiled // TILE


class StepLayout:
    """Where a step's tokens go, as every layer's kernel reads it: one block set per step."""

    def __init__(self) -> None:
        self._block = np.zeros(N_STEP, np.int64)
        self.address = _addr(self._block)
        self.kv: HostKVStorage | None = None
        self.tokens = 0
        self.order = np.zeros(0, np.int64)  # the tokens in work order (``work_order``)
        self._arrays: tuple[np.ndarray, ...] = ()
        self._parts = np.zeros(0, np.float32)

    def reserve(self, nbytes: int) -> None:
        """At least ``nbytes`` of split-K scratch (the partials of ``parts``, shared by the
        layers, which run one after another)."""
        if nbytes > self._parts.nbytes:
            self._parts = np.zeros(-(-nbytes // 4), np.float32)
            self._block[S_PARTS] = _addr(self._parts)

    def set(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        """The layout of ``batch``, whose tokens are at ``positions`` (int64, C order; may
        be longer than the step)."""
        pages, seq_of, *per_seq = batch.kernel_tables
        slots = np.ascontiguousarray(batch.slots, np.int64)
        n = len(slots)
        check("positions", positions, np.int64, (None,))
        require(len(positions) >= n, f"{len(positions)} positions for {n} tokens")
        check_layout(batch, n)
        self.order, singles, tiles = work_order(batch.query_start, seq_of, positions)
        arrays = (pages, seq_of, positions, slots, *per_seq, self.order)
        self._arrays = arrays  # alive while kernels run
        words = (n, _addr(pages), pages.shape[1], *map(_addr, arrays[1:]))
        self._block[:S_PARTS] = (*words, singles, tiles)
        self._block[S_END] = int(positions[:n].max()) + 1 if n else 0
        self.kv, self.tokens = batch.kv, n


class PagedAttention:
    """One layer's attention bound to its buffers: ``q``/``out`` ``[rows, heads *
    head_dim]`` and the step's ``k``/``v`` ``[rows, kv_heads * head_dim]`` (f32; the rows
    of q, k and v may be strided). A call stores this step's k/v in the layer's pages, then
    sets ``out[t]`` to the attention of ``q[t]`` over the keys at positions up to the
    token's own (within the window) of its sequence, for each token of ``step``; with
    ``softcap`` > 0 the scaled scores are capped (``softcap * tanh(s / softcap)``)."""

    def __init__(
        self,
        step: StepLayout,
        layer: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int,
        threads: int,
        out: np.ndarray,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        softcap: float = 0.0,
        sinks: np.ndarray | None = None,
        backend: backends.Backend | None = None,
    ):
        """``backend``: the one that lowers the kernel (default ``backends.select()``)."""
        require(
            n_kv_heads >= 1 and n_heads % n_kv_heads == 0 and supported(head_dim, "f32"),
            f"no attention kernel for {n_heads} heads, {n_kv_heads} kv heads of {head_dim}",
        )
        require(softcap >= 0, f"a score cap of {softcap}")
        self._step, self._layer, self._softcap = step, layer, float(softcap)
        self._window = window
        self._backend = backend or backends.select()
        self._geometry = (n_heads, n_kv_heads, head_dim)
        self._per_token, self._per_tile = (
            work_items(n_heads, n_kv_heads, tiled) for tiled in (False, True)
        )
        self._threads = threads if pool.available() else 1
        self._rows = len(out)
        check("out", out, np.float32, (self._rows, n_heads * head_dim))
        self._arrays = (out, q, k, v)  # alive while the kernel may run
        a = self._args = np.zeros(N_ARGS, np.int64)
        for name, x, at, stride, heads in (
            ("q", q, A_Q, A_Q_STRIDE, n_heads),
            ("k", k, A_K_NEW, A_K_STRIDE, n_kv_heads),
            ("v", v, A_V_NEW, A_V_STRIDE, n_kv_heads),
        ):
            a[at], a[stride] = _addr(x), row_stride(name, x, self._rows, heads * head_dim)
        a[A_OUT], a[A_WINDOW], a[A_STEP] = _addr(out), window, step.address
        a[A_SCALE] = struct.unpack("<q", struct.pack("<d", scale))[0]
        a[A_TILED] = 1  # the steps' tiles run (where its positions allow: ``_rows``)
        self._sinks = sinks
        if sinks is not None:
            check("sinks", sinks, np.float32, (n_heads,))
            a[A_SINKS] = _addr(sinks)
        self._ptr = _addr(a)
        self._kv: HostKVStorage | None = None

    def _request(self, kv: HostKVStorage) -> backends.Request:
        geometry = (*self._geometry, kv.page_size, kv.recent, self._softcap)
        backend, program, spec = _request(self._backend, kv.dtype, *geometry)
        # a program with sinks is its own; the spec of one without is as before
        return backend, program, {**spec, "sinks": True} if self._sinks is not None else spec

    def pending(self) -> list[backends.Request]:
        """The kernel this step's KV storage needs if it is not bound yet (see
        ``backends.lower_all``)."""
        kv = self._step.kv
        return [] if kv is None or kv is self._kv else [self._request(kv)]

    def _bind_kv(self, kv: HostKVStorage) -> None:
        """Kernels for ``kv``'s storage and the addresses of this layer's pages."""
        backend, program, spec = self._request(kv)
        done = backend.lower(program, spec)
        self._fns = {kind: done.addresses[kind] for kind in FUNCTIONS}
        self._calls = {
            done.addresses[f]: done.cfunc(f, ctypes.c_void_p, *extra)
            for f, extra in (
                ("write", ()),
                ("run", ()),
                ("write_recent", ()),
                ("merge", (ctypes.c_int64, ctypes.c_int64)),
            )
        }
        layer, (_, n_kv_heads, head_dim) = self._layer, self._geometry
        require(supported(head_dim, kv.dtype), f"no {kv.dtype} attention for heads of {head_dim}")
        require(0 <= layer < len(kv.k), f"layer {layer} of a KV pool of {len(kv.k)} layers")
        store, block = kv.geometry.store, kv.geometry.format.scale_block
        head = (n_kv_heads, head_dim)
        slots = len(kv.k[layer])
        stores = {A_K: ("k", kv.k, store, head), A_V: ("v", kv.v, store, head)}
        if block:
            scales = (n_kv_heads, head_dim // block)
            stores |= {A_KS: ("k_scale", kv.k_scale, np.float16, scales)}
            stores |= {A_VS: ("v_scale", kv.v_scale, np.float16, scales)}
        if kv.recent:
            stores |= {A_KR: ("k_recent", kv.k_recent, np.float16, head)}
            stores |= {A_VR: ("v_recent", kv.v_recent, np.float16, head)}
        for at, (name, arrays, dtype, inner) in stores.items():
            rows = None if name.endswith("recent") else slots
            array = check(f"KV {name}[{layer}]", arrays[layer], dtype, (rows, *inner))
            self._args[at] = _addr(array)
        self._kv = kv

    def _plan(self) -> list[tuple[int, int, int, int, int]]:
        """Bind the step's KV storage; this step's calls as ``pool.Program`` records (valid
        while the step's token count and KV storage stay the same). One thread: ``run``.
        With two items per thread or more, the items split over the pool: those of the tokens
        alone, then (where the layer has tiles) those of the tiles, each launch over as many
        rows as the step's tokens can make, the kernels doing the step's own (from its
        block: the records stay valid while the token count does). Fewer (a decode
        step: a T=1 decode of 3 items gains at most 1.5x from items alone): split-K,
        ``4 x threads`` slices an item (the pool's guided grabs even out a long item's
        chunks; a short context's items are one slice each), then ``merge``."""
        if self._step.kv is not self._kv:
            self._bind_kv(self._step.kv)
        require(self._step.tokens <= self._rows, f"{self._step.tokens} tokens in {self._rows} rows")
        step, threads, fns, ptr = self._step, self._threads, self._fns, self._ptr
        if threads == 1:
            return [(pool.PLAIN, fns["run"], ptr, 0, 0)]
        records = [(pool.PLAIN, fns["write"], ptr, 0, 0)]
        items = step.tokens * self._per_token
        if items >= 2 * threads:
            work = [("items", items), ("tiles", step.tokens // TILE * self._per_tile)]
            for kind, n in work:
                if n:
                    records.append((pool.SPLIT, fns[kind], ptr, n, max(1, n // (4 * threads))))
        else:
            slices = self._args[A_SLICES] = 4 * threads
            n_heads, n_kv_heads, head_dim = self._geometry
            capacity = self._kv.geometry.slot_shape[0]
            self._step.reserve(parts_bytes(items, capacity, n_heads, n_kv_heads, head_dim))
            records.append((pool.SPLIT, fns["parts"], ptr, items * slices, 1))
            records.append((pool.RANGE, fns["merge"], ptr, items, 1))
        if self._kv.recent:
            records.append((pool.PLAIN, fns["write_recent"], ptr, 0, 0))
        return records

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """This step's calls as ``pool.Program`` records (see ``_plan``)."""
        return self._plan()

    def __call__(self) -> None:
        for kind, fn, args, total, chunk in self._plan():
            if kind == pool.SPLIT:
                pool.pool(self._threads).run(fn, args, total, chunk)
            else:
                self._calls[fn](args, *((0, total) if kind == pool.RANGE else ()))
