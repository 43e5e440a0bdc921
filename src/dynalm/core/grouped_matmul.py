"""Several matmuls of one format and shape ``[N, K]``, each over rows of its own, as one job
of the pool: a mixture's selected experts (``core.experts``).

Group g multiplies ``counts[g]`` consecutive rows of ``x`` (from ``x_first[g]``) by its
weight into consecutive rows of ``y`` (from ``y_first[g]``). Each group runs the tiles its
own ``QuantMatmul`` would run for that many rows (``MatmulKernels.cover``), so its
products are bitwise that matmul's; the ``grouped`` program (``kernel.matmul_programs``)
hands every piece of the job's virtual rows to its group's tile, so one barrier serves all
the groups. ``auto`` quantises ``x`` once for all of them, or takes rows quantised already:
``gather`` quantises a mixture's source rows once (a token's row, read by each of its
top-k experts, once instead of top-k times) and copies the quantised rows into expert order
(a quarter to a half of the fp32 rows' bytes). The groups' argument blocks are rows of
preallocated arrays, written by vectorised numpy per call (no Python per group).
"""

from __future__ import annotations

import numpy as np

from dynalm.core import elementwise
from dynalm.core.matmul import (
    _X_SLOTS,
    ActivationScratch,
    QuantMatmul,
    grab_chunk,
    kind_of,
    run_calls,
)
from dynalm.kernel.matmul_programs import (
    A_LDY,
    A_NB,
    A_T,
    A_W,
    A_Y,
    KEY_SUMS,
    N_ARGS,
    ROW_OVERREAD,
)

_WORD = 8  # bytes of an argument block's word


def _at(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _float_rows(a: np.ndarray) -> np.ndarray:
    """A quantised part's rows as float32 words (each row a multiple of 4 bytes), for the
    row copy kernel: its loads and stores move the bits unchanged."""
    return a.reshape(len(a), -1).view(np.float32)


class _Blocks:
    """One job's argument blocks: group g's first tile's block is ``args`` row g, a ragged
    cover's second tile's row n + g; the ragged covers' ``pair`` blocks; the grouped
    program's ``table``; the quantiser's block (auto)."""

    def __init__(self, n_rows: int, stride: int, n_groups: int, nb: int) -> None:
        self.n = n_groups
        self.args = np.zeros((2 * n_groups, N_ARGS), np.int64)
        self.pairs = np.zeros((n_groups, 4), np.int64)
        self.table = np.zeros(2 + 2 * n_groups, np.int64)
        self.table[:2] = n_rows, stride
        self.qargs = np.zeros(N_ARGS, np.int64)
        self.qargs[A_NB] = nb
        self.table_at = _at(self.table)
        self.arg_at = np.arange(2 * n_groups) * (N_ARGS * _WORD) + _at(self.args)
        self.pair_at = np.arange(n_groups) * (4 * _WORD) + _at(self.pairs)


# The quantised rows of ``x`` (``ActivationScratch.views``): what ``gather`` makes in auto.
Quantised = tuple[np.ndarray, ...]
# ``gather`` quantises first from this many rows: below, its own quantiser call and four row
# copies cost more than they save (OLMoE shape, Zen 4, batched decode of 8 sequences, 64
# rows: 0.9x the fp32 copy; 16 sequences, 128 rows: 1.08-1.16x; a 512-token prefill's 4096:
# 1.06x the step).
QUANTISED_GATHER_ROWS = 128


class GroupedMatmul:
    """Up to ``n_groups`` matmuls shaped like ``like`` (same format, shape, mode, backend
    and threads; their weights given per call by address) as one job; ``auto`` quantises
    x in ``quantised`` (its own: its rows, a row per (token, slot), can outnumber the
    step's tokens the matmuls' shared scratch is reserved for; shared by an executor's
    grouped matmuls, which run one at a time), and ``gather``'s source rows in
    ``sources``."""

    def __init__(
        self,
        like: QuantMatmul,
        n_groups: int,
        quantised: ActivationScratch,
        sources: ActivationScratch,
    ) -> None:
        self._kernels, self.mode = like.kernels, like.mode
        self.n_rows, self.n_cols, self.threads = like.n_rows, like.n_cols, like.threads
        self._weight_bytes = like.weights.nbytes
        whole = self._kernels.row_multiple
        self._stride = -(-self.n_rows // whole) * whole  # each group's virtual rows
        self._nb = nb = self.n_cols // 32
        # the activation slots: fp32 rows, or their int8 quantisation's (quants, block
        # scales, block sums, key sums)
        self._slots = list(_X_SLOTS[: 1 if self.mode == "exact" else 4])
        row_bytes = [4 * self.n_cols] if self.mode == "exact" else [self.n_cols, 8 * nb, 4 * nb]
        # a group's block = base + x_first * per_x + y_first * per_y, then its weights and
        # rows (base: x's and y's addresses, K's blocks, y's row length)
        self._base, self._per_x, self._per_y = np.zeros((3, N_ARGS), np.int64)
        self._per_x[self._slots] = row_bytes + [4 * nb * KEY_SUMS] * (self.mode == "auto")
        self._per_y[A_Y] = 4 * self.n_rows
        self._base[A_NB], self._base[A_LDY] = nb, self.n_rows
        self._blocks = _Blocks(self.n_rows, self._stride, n_groups, nb)
        # x's quantisation, its activation slots' addresses per row count (valid while
        # the scratch's buffer stays where it was: generation)
        self._quantised, self._bases, self._generation = quantised, {}, quantised.generation
        self._sources = sources
        # per row count: the cover's first tile (address, rows) and second (address,
        # first row, rows; address 0: none), grown as larger groups come
        self._cover = np.zeros((0, 5), np.int64)

    def _covers(self, most: int) -> np.ndarray:
        """The covers of 0 .. ``most`` rows, as rows (see ``_cover``)."""
        if most >= len(self._cover):
            kernels, grown = self._kernels, []
            for rows in range(len(self._cover), most + 1):
                cover = kernels.cover(rows)
                (a, _, ra), (b, fb, rb) = (cover * 2)[:2]
                second = (kernels.address(b), fb, rb) if len(cover) > 1 else (0, 0, 0)
                grown.append((kernels.address(a), ra, *second))
            self._cover = np.array([*self._cover.tolist(), *grown], np.int64)
        return self._cover

    def _x_bases(self, x: np.ndarray) -> np.ndarray | int:
        """Where the tiles read x's rows from, per activation slot: x itself in exact; in
        auto its quantisation in the shared scratch."""
        if self.mode == "exact":
            return _at(x)
        rows, scratch = len(x), self._quantised
        bases = self._bases.get(rows) if self._generation == scratch.generation else None
        if bases is None:
            views = scratch.views(rows, self.n_cols)
            if self._generation != scratch.generation:  # moved: the others are stale
                self._bases.clear()
                self._generation = scratch.generation
            bases = self._bases[rows] = np.array([_at(v) for v in views], np.int64)
        return bases

    def _quantise(
        self, q: np.ndarray, x: np.ndarray, bases: np.ndarray, threads: int
    ) -> tuple[int, int, int, int, int]:
        """The record quantising ``x``'s rows into the activation slots at ``bases``,
        its argument block ``q``."""
        rows = len(x)
        q[self._slots], q[A_Y], q[A_T] = bases, _at(x), rows
        return kind_of(threads, self._kernels.quantize, _at(q), rows, -(-rows // threads))

    def _threads(self, n_groups: int) -> int:
        return self.threads if QuantMatmul.parallel(n_groups * self._weight_bytes) else 1

    def copies_fp32(self, n: int) -> bool:
        """Whether ``gather`` copies ``n`` fp32 rows (into its ``out``), not int8 ones."""
        return self.mode == "exact" or n < QUANTISED_GATHER_ROWS

    def gather(self, x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray | Quantised:
        """``x``'s rows ``rows``, in that order, as a job's ``x``: copied into ``out``
        (float32 [len(rows), K]) where ``copies_fp32``; else ``x`` quantised once (into
        ``sources``) and its quantisation's rows copied: the bytes the job would make of
        the copied fp32 rows (the quantiser works row by row), without quantising a row
        once per copy. The quantised rows are valid until the next ``gather`` or call."""
        if self.copies_fp32(len(rows)):
            elementwise.rows(out, x, rows, threads=self.threads)()
            return out
        self._check("x", x, self.n_cols)
        source = self._sources.views(len(x), self.n_cols)
        bases = np.array([_at(v) for v in source], np.int64)
        threads = self._threads(1)
        run_calls(self._kernels, threads, [self._quantise(self._blocks.qargs, x, bases, threads)])
        n = len(rows)
        gathered = self._quantised.views(n + ROW_OVERREAD, self.n_cols)
        for into, of in zip(gathered, source, strict=True):  # as float32 rows: bit copies
            elementwise.rows(_float_rows(into[:n]), _float_rows(of), rows, threads=self.threads)()
        for a in gathered[1:]:  # the tiles' overread rows: zero scales, as the quantiser's
            a[n:] = 0
        return tuple(a[:n] for a in gathered)

    @staticmethod
    def _check(what: str, a: np.ndarray, width: int) -> None:
        if a.dtype != np.float32 or a.shape[1:] != (width,) or not a.flags.c_contiguous:
            raise ValueError(f"{what}: expected C-contiguous float32 [., {width}], got {a.shape}")

    def _plan(
        self,
        blocks: _Blocks,
        weights: np.ndarray | int,
        x: np.ndarray | Quantised,
        x_bases: np.ndarray | int,
        x_first: np.ndarray,
        counts: np.ndarray | None,
        y: np.ndarray,
        y_first: np.ndarray,
    ) -> list[tuple[int, int, int, int, int]]:
        """Fill ``blocks`` for the groups (one per ``x_first``) of ``weights``; the job's
        calls (kind, kernel index, args, total, chunk): auto's quantiser of ``x`` into
        ``x_bases`` (none for rows quantised already), then the grouped program."""
        if isinstance(x, tuple):
            if x[0].dtype != np.int8 or x[0].shape[1:] != (self.n_cols,):
                raise ValueError(f"x: expected the quantised rows of [., {self.n_cols}]")
        else:
            self._check("x", x, self.n_cols)
        self._check("y", y, self.n_rows)
        n = len(x_first)
        if n > blocks.n:
            raise ValueError(f"{n} groups, made for at most {blocks.n}")
        threads = self._threads(n)
        calls: list[tuple[int, int, int, int, int]] = []
        if self.mode == "auto" and not isinstance(x, tuple):
            calls.append(self._quantise(blocks.qargs, x, x_bases, threads))
        args, table = blocks.args[:n], blocks.table[2 : 2 + 2 * n].reshape(n, 2)
        base = self._base
        base[self._slots], base[A_Y] = x_bases, _at(y)
        np.multiply.outer(x_first, self._per_x, out=args)
        args += np.multiply.outer(y_first, self._per_y)
        args += base
        args[:, A_W] = weights
        table[:, 1] = blocks.arg_at[:n]
        if counts is None:  # the GEMV each
            args[:, A_T] = 1
            table[:, 0] = self._covers(1)[1, 0]
        else:
            cover = self._covers(int(counts.max()))[counts]
            args[:, A_T] = cover[:, 1]
            table[:, 0] = cover[:, 0]
            ragged = np.flatnonzero(cover[:, 2])
            if len(ragged):  # the second tile from its first row on; both as one pair
                self._pair(blocks, ragged, cover[ragged])
        total = n * self._stride
        chunk = grab_chunk(self._kernels, total, threads)
        calls.append(kind_of(threads, self._kernels.grouped, blocks.table_at, total, chunk))
        return calls

    def __call__(
        self,
        weights: np.ndarray,
        x: np.ndarray | Quantised,
        x_first: np.ndarray,
        counts: np.ndarray | None,
        y: np.ndarray,
        y_first: np.ndarray,
    ) -> None:
        """Group g: ``y[y_first[g] + i] = x[x_first[g] + i] @ W_g^T`` for i < counts[g]
        (``counts`` None: one row each); ``weights``: the groups' repacked weights'
        addresses (``QuantMatmul.weights``), ``x`` C-contiguous float32 [R, K] (every row
        some group's) or, in auto, rows quantised by ``gather``; ``y`` [., N]."""
        blocks = self._blocks
        if isinstance(x, tuple):
            bases = np.array([_at(v) for v in x], np.int64)
        else:
            bases = self._x_bases(x)
        calls = self._plan(blocks, weights, x, bases, x_first, counts, y, y_first)
        run_calls(self._kernels, self.threads, calls)

    def bind_gemv(
        self, x: np.ndarray, x_first: np.ndarray, y: np.ndarray, y_first: np.ndarray
    ) -> BoundGemv:
        """One row each from ``x``'s rows ``x_first`` into ``y``'s rows ``y_first``, bound
        once for a compiled step (blocks and, in auto, a quantisation of its own: nothing
        another call rewrites or moves); its weights set per step."""
        own = ActivationScratch()
        bases = (
            _at(x)
            if self.mode == "exact"
            else np.array([_at(v) for v in own.views(len(x), self.n_cols)], np.int64)
        )
        blocks = _Blocks(self.n_rows, self._stride, len(x_first), self._nb)
        calls = self._plan(blocks, 0, x, bases, x_first, None, y, y_first)
        address = self._kernels.address
        records = [(kind, address(k), *rest) for kind, k, *rest in calls]
        return BoundGemv(blocks, records, own)

    def _pair(self, blocks: _Blocks, ragged: np.ndarray, cover: np.ndarray) -> None:
        """Groups ``ragged`` run two tiles (their ``cover`` rows): the second's block from
        the first's, both as one ``pair`` call (``MatmulKernels.cover``)."""
        at, second = cover[:, 3], blocks.args[blocks.n + ragged]
        second[:] = blocks.args[ragged]
        second += np.multiply.outer(at, self._per_x + self._per_y)
        second[:, A_T] = cover[:, 4]
        blocks.args[blocks.n + ragged] = second
        blocks.pairs[ragged] = np.stack(
            [cover[:, 0], blocks.arg_at[ragged], cover[:, 2], blocks.arg_at[blocks.n + ragged]], 1
        )
        table = blocks.table[2:].reshape(-1, 2)
        pair = self._kernels.address(self._kernels.pair)
        table[ragged] = np.stack([np.full_like(at, pair), blocks.pair_at[ragged]], 1)


class BoundGemv:
    """A ``GroupedMatmul``'s one-row-each job bound to fixed rows (``bind_gemv``): its
    ``records`` (``pool.Program``'s) run whatever experts ``weights`` names, set per step."""

    def __init__(
        self, blocks: _Blocks, records: list[tuple[int, int, int, int, int]], own: object
    ) -> None:
        self.weights = blocks.args[: blocks.n, A_W]  # a view: the blocks the records read
        self.records, self._blocks, self._own = records, blocks, own  # (kept alive)
