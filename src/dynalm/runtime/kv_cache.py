"""Paged KV cache: one shared pool of fixed-size pages, reference counted.

A page holds ``page_size`` tokens of keys and values for every layer. Sequences
hold lists of page ids (page tables), never contiguous buffers, so pages can be
shared between sequences (prefix sharing) and returned individually.

Storage dtypes: ``f32``, ``f16``, and ``q8_0`` (int8 values with one f16 scale per
32 values of a slot's kv head, like GGUF Q8_0: 34 bytes per 32 values, ~53 % of f16).
Values are quantised on write and dequantised on read, one gather per sequence.

q8_0 keys are stored rotated, ``k @ H`` per 32-value block (``H`` the 32x32 Walsh-Hadamard
matrix, QuaRot-style): a few outlier channels would otherwise set every block's scale and
crush the other values to a few levels; rotated, each block's energy is spread evenly.
Attention rotates the query the same way (``q @ H . k @ H = 32 q . k``), so scores need no
inverse; ``read`` returns the keys un-rotated. This halves the logit error of q8_0 KV on
SmolLM2; rotating the values too gained ~3 % more, not worth an inverse per output.

A q8_0 pool also keeps each running sequence's last ``RECENT`` tokens in f16, in a *recent
buffer* of its own (KIVI's full-precision residual): attention reads a query's keys and
values within ``RECENT`` positions of it from there (or, for the step's own tokens, from the
step's f32 keys rounded to f16), older ones from the q8_0 pages. Nearby tokens carry most of
the attention weight, so their quantisation error dominated. On SmolLM2 (exact mode, vs f16
KV, ``benchmarks/kv_fidelity.py``: 40 prompts x 64 tokens) the mean worst logit error per
token fell from 0.17 to 0.036, and free-running greedy text agreed on 98 % of tokens
instead of 69 %. The rule depends only on the query's and key's positions, so chunking and
batching do not change a result. A sequence's buffer holds the positions it computed itself
(from ``recent_from``, after a prefix-cache hit): keys from the cache are read as q8_0. A
buffer costs ``RECENT`` tokens of f16 per running sequence (a default pool of 16 x 4096
tokens: 0.539 of f16's bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynalm.errors import InvalidRequest, show

KV_DTYPES = ("f32", "f16", "q8_0")
Q8_BLOCK = 32  # values per q8_0 scale
RECENT = 32  # tokens of each running sequence a q8_0 pool also keeps in f16


def hadamard(x: np.ndarray) -> np.ndarray:
    """``x @ H`` for each 32 values of ``x`` (f32, last axis a multiple of 32), ``H`` the
    unnormalised Walsh-Hadamard matrix (entries +-1, ``H @ H = 32 I``): five butterfly
    stages of f32 adds in the JIT kernel's order, so both give the same bits."""
    y = x
    for h in (1, 2, 4, 8, 16):  # element i pairs with i + h where bit h of i is clear
        pairs = y.reshape(-1, 2, h)
        y = np.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), axis=1)
    return y.reshape(x.shape)


class OutOfPages(Exception):
    """The pool has no free page left (the scheduler evicts, preempts or waits)."""


def check_dtype(dtype: str) -> str:
    if dtype not in KV_DTYPES:
        raise InvalidRequest(
            f"unknown KV cache dtype {show(dtype)} (choose from {', '.join(KV_DTYPES)})"
        )
    return dtype


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of keys + values one token takes in a pool of ``dtype``."""
    check_dtype(dtype)
    per_value = {"f32": 4.0, "f16": 2.0, "q8_0": 1.0 + 2.0 / Q8_BLOCK}[dtype]
    return int(2 * n_layers * n_kv_heads * head_dim * per_value)


def recent_bytes_per_seq(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one running sequence's recent buffer (only q8_0 pools have them)."""
    if dtype != "q8_0":
        return 0
    return RECENT * kv_bytes_per_token(n_layers, n_kv_heads, head_dim, "f16")


class PagePool:
    """KV memory for all sequences, indexed by slot (``page * page_size + offset``).

    ``k[layer]``/``v[layer]`` are ``[n_pages * page_size, n_kv_heads, head_dim]`` arrays
    (int8 for q8_0, with ``k_scale``/``v_scale`` ``[..., head_dim / 32]`` in f16). A q8_0
    pool also has ``n_seqs`` recent buffers: ``k_recent``/``v_recent`` per layer, f16
    ``[n_seqs * RECENT, n_kv_heads, head_dim]``, position ``p`` of buffer ``b`` at row
    ``b * RECENT + p % RECENT``. With ``n_layers=0`` the pool only does the page
    bookkeeping (unit tests, simulation).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int = 16,
        dtype: str = "f16",
        n_seqs: int = 1,
    ):
        check_dtype(dtype)
        if dtype == "q8_0" and head_dim % Q8_BLOCK:
            raise InvalidRequest(f"q8_0 KV needs head_dim divisible by 32, got {head_dim}")
        if n_pages < 1:
            raise InvalidRequest("the KV cache must hold at least one page")
        self.page_size = page_size
        self.n_pages = n_pages
        self.dtype = dtype
        shape = (n_pages * page_size, n_kv_heads, head_dim)
        store = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[dtype]
        self.k = [np.zeros(shape, store) for _ in range(n_layers)]
        self.v = [np.zeros(shape, store) for _ in range(n_layers)]
        scale_shape = (*shape[:2], head_dim // Q8_BLOCK)
        n_scaled = n_layers if dtype == "q8_0" else 0
        self.k_scale = [np.zeros(scale_shape, np.float16) for _ in range(n_scaled)]
        self.v_scale = [np.zeros(scale_shape, np.float16) for _ in range(n_scaled)]
        self.refcount = np.zeros(n_pages, np.int32)
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first
        self.recent = RECENT if dtype == "q8_0" else 0
        recent_shape = (n_seqs * self.recent, n_kv_heads, head_dim)
        n_recent = n_layers if self.recent else 0
        self.k_recent = [np.zeros(recent_shape, np.float16) for _ in range(n_recent)]
        self.v_recent = [np.zeros(recent_shape, np.float16) for _ in range(n_recent)]
        self._free_recent = list(range(n_seqs - 1, -1, -1)) if self.recent else []

    @property
    def nbytes(self) -> int:
        """Bytes of KV memory: pages (values and scales) and recent buffers."""
        return self.page_nbytes + sum(a.nbytes for a in (*self.k_recent, *self.v_recent))

    @property
    def page_nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    @property
    def n_free(self) -> int:
        return len(self._free)

    # -- page bookkeeping ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        for page in pages:  # one at a time: a page may appear twice
            self.refcount[page] += 1

    def release(self, pages: Sequence[int]) -> int:
        """Drop one reference to each page; returns how many became free."""
        freed = 0
        for page in pages:
            self.refcount[page] -= 1
            if self.refcount[page] < 0:
                raise RuntimeError(f"page {page} released twice")
            if self.refcount[page] == 0:
                self._free.append(page)
                freed += 1
        return freed

    @property
    def n_free_recent(self) -> int:
        return len(self._free_recent)

    def open_recent(self) -> int:
        """A recent buffer for a sequence entering the running batch (q8_0 pools)."""
        if not self._free_recent:
            raise OutOfPages("every recent buffer is in use (one per running sequence)")
        return self._free_recent.pop()

    def close_recent(self, buffer: int) -> None:
        self._free_recent.append(buffer)

    def slots(self, pages: Sequence[int], start: int, stop: int) -> np.ndarray:
        """KV slots of token positions ``start..stop-1`` of a sequence with ``pages``."""
        pos = np.arange(start, stop)
        table = np.asarray(pages, np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: page ``dst`` gets ``src``'s keys and values in every layer."""
        a, b = src * self.page_size, dst * self.page_size
        for arr in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            arr[b : b + self.page_size] = arr[a : a + self.page_size]

    # -- what the attention op calls ----------------------------------------------
    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``/``v`` ``[T, n_kv_heads, head_dim]`` (fp32) at ``slots``."""
        if self.dtype != "q8_0":
            self.k[layer][slots] = k
            self.v[layer][slots] = v
            return
        for x, store, scales in ((hadamard(k), self.k, self.k_scale), (v, self.v, self.v_scale)):
            blocks = x.reshape(*x.shape[:2], x.shape[2] // Q8_BLOCK, Q8_BLOCK)
            d = np.abs(blocks).max(axis=-1) / 127.0
            inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
            store[layer][slots] = np.rint(blocks * inv[..., None]).reshape(x.shape)
            scales[layer][slots] = d

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values at ``slots`` as fp32 ``[L, n_kv_heads, head_dim]``."""
        if self.dtype != "q8_0":
            k, v = self.k[layer][slots], self.v[layer][slots]
            return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
        out = []
        for store, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = store[layer][slots].astype(np.float32)
            blocks = q.reshape(*q.shape[:2], q.shape[2] // Q8_BLOCK, Q8_BLOCK)
            blocks *= scales[layer][slots].astype(np.float32)[..., None]
            out.append(q)
        return hadamard(out[0]) / np.float32(Q8_BLOCK), out[1]  # H @ H / 32 = I

    def write_recent(self, layer: int, rows: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store f32 ``k``/``v`` ``[T, n_kv_heads, head_dim]`` at recent-buffer ``rows``
        (distinct), rounded to f16."""
        self.k_recent[layer][rows] = k
        self.v_recent[layer][rows] = v

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
