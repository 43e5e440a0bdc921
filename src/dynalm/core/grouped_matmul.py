"""Several matmuls of one format and shape ``[N, K]``, each over rows of its own, as one job
of the pool: a mixture's selected experts (``core.experts``).

Group g multiplies ``counts[g]`` consecutive rows of ``x`` (from ``x_first[g]``) by its
weight into consecutive rows of ``y`` (from ``y_first[g]``). Each group runs the tiles its
own ``QuantMatmul`` would run for that many rows (``MatmulKernels.cover``), so its
products are bitwise that matmul's; the ``grouped`` program (``kernel.matmul_programs``)
hands every piece of the job's virtual rows to its group's tile, so one barrier serves all
the groups. ``auto`` quantises ``x`` once for all of them. The groups' argument blocks are
rows of preallocated arrays, written by vectorised numpy per call (no Python per group).
"""

from __future__ import annotations

import numpy as np

from dynalm.core.matmul import (
    _X_SLOTS,
    ActivationScratch,
    QuantMatmul,
    grab_chunk,
    kind_of,
    run_calls,
)
from dynalm.kernel.matmul_programs import A_LDY, A_NB, A_T, A_W, A_Y, KEY_SUMS, N_ARGS

_WORD = 8  # bytes of an argument block's word


def _at(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class GroupedMatmul:
    """Up to ``n_groups`` matmuls shaped like ``like`` (same format, shape, mode, backend
    and threads; their weights given per call by address) as one job."""

    def __init__(self, like: QuantMatmul, n_groups: int) -> None:
        self._kernels, self.mode = like.kernels, like.mode
        self.n_rows, self.n_cols, self.threads = like.n_rows, like.n_cols, like.threads
        self._weight_bytes = like.weights.nbytes
        whole = self._kernels.row_multiple
        self._stride = -(-self.n_rows // whole) * whole  # each group's virtual rows
        nb = self.n_cols // 32
        # where each group's x rows start, per activation slot: fp32 rows, or the int8
        # quantisation's (quants, block scales, block sums, key sums)
        row_bytes = [4 * self.n_cols] if self.mode == "exact" else [self.n_cols, 8 * nb, 4 * nb]
        self._row_bytes = np.array(row_bytes + [4 * nb * KEY_SUMS] * (self.mode == "auto"))
        self._slots = list(_X_SLOTS[: len(self._row_bytes)])
        # group g's first tile's block is row g, a ragged cover's second tile row n + g
        self._args = np.zeros((2 * n_groups, N_ARGS), np.int64)
        self._args[:, A_NB], self._args[:, A_LDY] = nb, self.n_rows
        self._pairs = np.zeros((n_groups, 4), np.int64)  # a ragged cover's pair blocks
        self._table = np.zeros(2 + 2 * n_groups, np.int64)  # the grouped program's block
        self._table[:2] = self.n_rows, self._stride
        self._qargs = np.zeros(N_ARGS, np.int64)  # the quantiser's
        self._qargs[A_NB] = nb
        # x's quantisation: a buffer of its own (its rows, a row per (token, slot), can
        # outnumber the step's tokens that the shared scratch is reserved for)
        self._quantised = ActivationScratch()
        self._n = n_groups
        # per row count: the cover's first tile (address, rows) and second (address,
        # first row, rows; address 0: none), grown as larger groups come (0 rows: none)
        self._cover = np.zeros((1, 5), np.int64)

    def _covers(self, counts: np.ndarray) -> np.ndarray:
        """The covers of these row counts, as rows of ``_cover``."""
        most = int(counts.max())
        if most >= len(self._cover):
            kernels, grown = self._kernels, []
            for rows in range(len(self._cover), most + 1):
                cover = kernels.cover(rows)
                (a, _, ra), (b, fb, rb) = (cover * 2)[:2]
                second = (kernels.address(b), fb, rb) if len(cover) > 1 else (0, 0, 0)
                grown.append((kernels.address(a), ra, *second))
            self._cover = np.array([*self._cover.tolist(), *grown], np.int64)
        return self._cover[counts]

    def __call__(
        self,
        weights: np.ndarray,
        x: np.ndarray,
        x_first: np.ndarray,
        counts: np.ndarray,
        y: np.ndarray,
        y_first: np.ndarray,
    ) -> None:
        """Group g: ``y[y_first[g] + i] = x[x_first[g] + i] @ W_g^T`` for i < counts[g];
        ``weights``: the groups' repacked weights' addresses (``QuantMatmul.weights``),
        ``x`` C-contiguous float32 [R, K] (every row is some group's), ``y`` [., N]."""
        n, k_in = len(weights), self.n_cols
        for a, width in ((x, k_in), (y, self.n_rows)):
            if a.dtype != np.float32 or a.shape[1:] != (width,) or not a.flags.c_contiguous:
                raise ValueError(f"expected C-contiguous float32 [., {width}], got {a.shape}")
        if n > self._n:
            raise ValueError(f"{n} groups, made for at most {self._n}")
        threads = self.threads if QuantMatmul.parallel(n * self._weight_bytes) else 1
        calls = []
        if self.mode == "exact":
            bases = [_at(x)]
        else:  # x's rows quantised once, for every group
            bases = [_at(v) for v in self._quantised.views(len(x), k_in)]
            q = self._qargs
            q[self._slots], q[A_Y], q[A_T] = bases, _at(x), len(x)
            chunk = -(-len(x) // threads)
            calls.append(kind_of(threads, self._kernels.quantize, _at(q), len(x), chunk))
        cover = self._covers(counts)
        args = first = self._args[:n]
        args[:, A_W] = weights
        args[:, self._slots] = np.multiply.outer(x_first, self._row_bytes) + bases
        args[:, A_Y] = y_first * (4 * self.n_rows) + _at(y)
        args[:, A_T] = cover[:, 1]
        table = self._table[2 : 2 + 2 * n].reshape(n, 2)
        table[:, 0] = cover[:, 0]
        table[:, 1] = np.arange(n) * (N_ARGS * _WORD) + _at(first)
        ragged = np.flatnonzero(cover[:, 2])
        if len(ragged):  # the second tile from its first row on; both tiles as one pair
            second = self._args[self._n + ragged]
            at, rows = cover[ragged, 3], cover[ragged, 4]
            second[:] = first[ragged]
            second[:, self._slots] += np.multiply.outer(at, self._row_bytes)
            second[:, A_Y] += at * (4 * self.n_rows)
            second[:, A_T] = rows
            self._args[self._n + ragged] = second
            pairs = self._pairs[ragged]
            pairs[:, 0], pairs[:, 1] = cover[ragged, 0], table[ragged, 1]
            pairs[:, 2] = cover[ragged, 2]
            pairs[:, 3] = (self._n + ragged) * (N_ARGS * _WORD) + _at(self._args)
            self._pairs[ragged] = pairs
            table[ragged, 0] = self._kernels.address(self._kernels.pair)
            table[ragged, 1] = ragged * (4 * _WORD) + _at(self._pairs)
        total = n * self._stride
        chunk = grab_chunk(self._kernels, total, threads)
        calls.append(kind_of(threads, self._kernels.grouped, _at(self._table), total, chunk))
        run_calls(self._kernels, threads, calls)
