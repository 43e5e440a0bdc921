"""KV page storage: the bytes of the paged KV cache, as every device holds them, and a
step's view of them.

The runtime's ``PagePool`` keeps the page accounting (ids, refcounts, free lists, the radix
tree above it); the device keeps the bytes (``Device.kv_storage``), shaped by ``KVGeometry``
in a format of the table ``kv_formats.KV_FORMATS`` (f32, f16, q8_0 with Hadamard-rotated
keys and f16 recent buffers). ``KVStorage`` is what the runtime asks of any device's storage;
``HostKVStorage`` is the CPU's (numpy arrays the numpy attention op ``cpu_ops.attention``
and the JIT attention kernels ``core.attention`` read). ``AttentionBatch`` is a step's
layout: which sequence each token belongs to and where its keys go.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from dynalm.core.kv_formats import KV_FORMATS, KVFormat
from dynalm.kernel.attention_program import F16_MAX


def hadamard(x: np.ndarray) -> np.ndarray:
    """``x @ H`` for each 32 values of ``x`` (f32, last axis a multiple of 32), ``H`` the
    unnormalised Walsh-Hadamard matrix (entries +-1, ``H @ H = 32 I``): five butterfly
    stages of f32 adds in the JIT kernel's order, so both give the same bits."""
    y = x
    for h in (1, 2, 4, 8, 16):  # element i pairs with i + h where bit h of i is clear
        pairs = y.reshape(-1, 2, h)
        y = np.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), axis=1)
    return y.reshape(x.shape)


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a paged KV cache, as every device stores it: per layer, ``n_pages *
    page_size`` slots of ``n_kv_heads x head_dim`` values in the format ``dtype`` (q8_0:
    int8, with an f16 scale per 32 values), and where the format keeps recent rows (q8_0),
    ``n_seqs`` recent buffers of that many f16 rows each."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_pages: int
    page_size: int
    dtype: str
    n_seqs: int = 1

    @property
    def slot_shape(self) -> tuple[int, int, int]:
        """A layer's page memory: ``[slots, n_kv_heads, head_dim]``."""
        return (self.n_pages * self.page_size, self.n_kv_heads, self.head_dim)

    @property
    def format(self) -> KVFormat:
        return KV_FORMATS[self.dtype]

    @property
    def store(self) -> np.dtype:
        return np.dtype(self.format.store)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return (*self.slot_shape[:2], self.head_dim // (self.format.scale_block or 1))

    @property
    def recent(self) -> int:
        """Tokens per recent buffer (0: none)."""
        return self.format.recent

    @property
    def recent_shape(self) -> tuple[int, int, int]:
        return (self.n_seqs * self.recent, self.n_kv_heads, self.head_dim)

    def arrays(self) -> dict[str, tuple[int, tuple[int, ...], type]]:
        """Each per-layer array a storage holds: name -> (layers, shape, dtype)."""
        scaled = self.n_layers if self.format.scale_block else 0
        recent = self.n_layers if self.recent else 0
        return {
            "k": (self.n_layers, self.slot_shape, self.store),
            "v": (self.n_layers, self.slot_shape, self.store),
            "k_scale": (scaled, self.scale_shape, np.float16),
            "v_scale": (scaled, self.scale_shape, np.float16),
            "k_recent": (recent, self.recent_shape, np.float16),
            "v_recent": (recent, self.recent_shape, np.float16),
        }


PAGE_ARRAYS = ("k", "v", "k_scale", "v_scale")  # copied with their page (copy-on-write)


def saturated_f16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to f16 as the attention kernels store it: saturating at +-65504 (not
    overflowing to inf; see ``attention_program.F16_MAX``), NaN staying NaN."""
    return np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)


class KVStorage(Protocol):
    """The KV pages' bytes, owned by a device (``Device.kv_storage``: ``HostKVStorage`` on
    the CPU, ``cuda_device.CudaKVStorage`` on CUDA): what the runtime asks of them. The page
    accounting (ids, refcounts, free lists, the radix tree above it) is the runtime's
    ``PagePool``; the attention kernels read and write the bytes themselves."""

    geometry: KVGeometry
    page_size: int
    dtype: str  # a row of kv_formats.KV_FORMATS
    recent: int  # tokens per recent buffer (q8_0: keys/values near a query, in f16); 0: none
    nbytes: int  # pages and recent buffers
    page_nbytes: int

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: page ``dst`` gets ``src``'s keys and values in every layer."""

    def save_recent(self, rows: np.ndarray) -> list[np.ndarray]:
        """Copies of recent-buffer ``rows`` of every layer (``restore_recent`` puts them back)."""

    def restore_recent(self, rows: np.ndarray, saved: list[np.ndarray]) -> None: ...


@dataclass
class AttentionBatch:
    """Where the step's tokens belong: a flat ragged batch of sequences.

    Sequence ``s`` owns tokens ``query_start[s]:query_start[s+1]`` of the step; after
    the step it holds ``seq_lens[s]`` tokens of context, stored in the pages listed
    by ``page_tables[s]``; token ``t`` of the step is written to KV slot
    ``slots[t]`` (page * page_size + offset). With a recent window (``kv.recent``), it also
    has recent buffer ``recent[s]``, which holds its positions from ``recent_from[s]`` on.
    """

    kv: KVStorage
    query_start: np.ndarray  # int64 [S + 1]
    seq_lens: np.ndarray  # int64 [S]
    page_tables: list[np.ndarray]  # S arrays of page ids
    slots: np.ndarray  # int64 [T]
    recent: np.ndarray | None = None  # int64 [S], when kv.recent
    recent_from: np.ndarray | None = None  # int64 [S], when kv.recent

    def __post_init__(self) -> None:
        if self.kv.recent and (self.recent is None or self.recent_from is None):
            raise ValueError("a KV pool with recent buffers needs each sequence's buffer")

    @cached_property
    def kernel_tables(self) -> tuple[np.ndarray, ...]:
        """The layout as attention kernels read it, built once per step: the page tables
        as one int64 ``[S, max_pages]`` array, each token's sequence index ``[T]``, and per
        sequence its first row in the step, its recent buffer's first row and its
        ``recent_from`` (``[S]`` each; zeros without recent buffers)."""
        n_seqs = len(self.seq_lens)
        widest = max((len(p) for p in self.page_tables), default=0)
        pages = np.zeros((n_seqs, max(widest, 1)), np.int64)
        for s, table in enumerate(self.page_tables):
            pages[s, : len(table)] = table
        seq_of = np.repeat(np.arange(n_seqs, dtype=np.int64), np.diff(self.query_start))
        first_row = np.ascontiguousarray(self.query_start[:-1], np.int64)
        recent_row, recent_from = np.zeros(n_seqs, np.int64), np.zeros(n_seqs, np.int64)
        if self.kv.recent:
            recent_row[:] = np.asarray(self.recent) * self.kv.recent
            recent_from[:] = self.recent_from
        return pages, seq_of, first_row, recent_row, recent_from


class HostKVStorage:
    """KV memory indexed by slot (``page * page_size + offset``) in host memory.

    ``k[layer]``/``v[layer]`` are ``[n_pages * page_size, n_kv_heads, head_dim]`` arrays
    (int8 for q8_0, with ``k_scale``/``v_scale`` ``[..., head_dim / 32]`` in f16). A q8_0
    storage also has ``n_seqs`` recent buffers of ``R = recent`` rows: ``k_recent`` /
    ``v_recent`` per layer, f16 ``[n_seqs * R, n_kv_heads, head_dim]``, position ``p`` of
    buffer ``b`` at row ``b * R + p % R``. With ``n_layers=0`` it holds nothing.
    """

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry
        self.page_size, self.dtype = geometry.page_size, geometry.dtype
        self.recent = geometry.recent
        self._block = geometry.format.scale_block  # values per scale (0: stored as they are)
        for name, (layers, shape, dtype) in geometry.arrays().items():
            setattr(self, name, [np.zeros(shape, dtype) for _ in range(layers)])

    @property
    def nbytes(self) -> int:
        """Bytes of KV memory: pages (values and scales) and recent buffers."""
        return self.page_nbytes + sum(a.nbytes for a in (*self.k_recent, *self.v_recent))

    @property
    def page_nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: page ``dst`` gets ``src``'s keys and values in every layer."""
        a, b = src * self.page_size, dst * self.page_size
        for name in PAGE_ARRAYS:
            for arr in getattr(self, name):
                arr[b : b + self.page_size] = arr[a : a + self.page_size]

    # -- what the attention ops call --------------------------------------------
    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``/``v`` ``[T, n_kv_heads, head_dim]`` (fp32) at ``slots``."""
        n = self._block
        if not n:
            rounded = saturated_f16 if self.geometry.store == np.float16 else np.asarray
            self.k[layer][slots] = rounded(k)
            self.v[layer][slots] = rounded(v)
            return
        for x, store, scales in ((hadamard(k), self.k, self.k_scale), (v, self.v, self.v_scale)):
            blocks = x.reshape(*x.shape[:2], x.shape[2] // n, n)
            d = np.abs(blocks).max(axis=-1) / 127.0
            inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
            store[layer][slots] = np.rint(blocks * inv[..., None]).reshape(x.shape)
            scales[layer][slots] = saturated_f16(d)

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values at ``slots`` as fp32 ``[L, n_kv_heads, head_dim]``."""
        n = self._block
        if not n:
            k, v = self.k[layer][slots], self.v[layer][slots]
            return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
        out = []
        for store, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = store[layer][slots].astype(np.float32)
            blocks = q.reshape(*q.shape[:2], q.shape[2] // n, n)
            blocks *= scales[layer][slots].astype(np.float32)[..., None]
            out.append(q)
        return hadamard(out[0]) / np.float32(n), out[1]  # H @ H / 32 = I

    def write_recent(self, layer: int, rows: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store f32 ``k``/``v`` ``[T, n_kv_heads, head_dim]`` at recent-buffer ``rows``
        (distinct), rounded to f16."""
        self.k_recent[layer][rows] = saturated_f16(k)
        self.v_recent[layer][rows] = saturated_f16(v)

    def save_recent(self, rows: np.ndarray) -> list[np.ndarray]:
        """Copies of recent-buffer ``rows`` ``[layers, 2, len(rows), ...]``, keys and values
        of every layer (``restore_recent`` puts them back)."""
        pairs = zip(self.k_recent, self.v_recent, strict=True)
        return [np.stack([k[rows], v[rows]]) for k, v in pairs]

    def restore_recent(self, rows: np.ndarray, saved: list[np.ndarray]) -> None:
        """Put back what ``save_recent`` copied, ``saved[layer][:, i]`` to ``rows[i]``."""
        for k, v, (old_k, old_v) in zip(self.k_recent, self.v_recent, saved, strict=True):
            k[rows], v[rows] = old_k, old_v

    def read_recent(self, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.k_recent[layer][rows], self.v_recent[layer][rows]
        return k.astype(np.float32), v.astype(np.float32)
