"""``GroupedMatmul``: several experts' matmuls as one pool job, each group's rows bitwise its
own ``QuantMatmul``'s product of the same rows (ragged groups, a group of no rows, groups
of one row read and written in place, rows gathered by ``gather``), in exact and auto, on
one thread and split over two (the experts' weights above the pool's split threshold)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_matmul import activations, weights

from dynalm.core.grouped_matmul import QUANTISED_GATHER_ROWS, GroupedMatmul
from dynalm.core.matmul import ActivationScratch, QuantMatmul

# N not a multiple of a row group (each group's virtual rows are padded to whole ones);
# 136 rows of Q8_0 at K = 256 are 37 KB: split over the pool with 2 threads
E, N, K = 6, 136, 256


def experts(ggml_type: T, mode: str, threads: int) -> tuple[list[QuantMatmul], np.ndarray]:
    raw = weights(ggml_type, E * N, K).reshape(E, N, -1)
    return [QuantMatmul(raw[e], ggml_type, K, mode=mode, threads=threads) for e in range(E)], raw


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_groups_are_bitwise_their_own_matmuls(ggml_type: T, mode: str, threads: int) -> None:
    mms, _ = experts(ggml_type, mode, threads)
    grouped = GroupedMatmul(mms[0], E, ActivationScratch(), ActivationScratch())
    at = np.array([address(mm.weights) for mm in mms], np.int64)
    # ragged counts (1, 5, 64 rows; tiles with a GEMV or a smaller tile beside them), a
    # group of no rows, the groups in any expert order
    for counts, order in (([1], [3]), ([5, 0, 64, 2], [1, 4, 0, 5]), ([7, 1, 9], [2, 0, 5])):
        counts, order = np.array(counts), np.array(order)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        x = activations(int(counts.sum()), K)
        y = np.full((len(x), N), np.nan, np.float32)
        grouped(at[order], x, first, counts, y, first)
        for e, a, c in zip(order, first, counts, strict=True):
            alone = mms[e](np.ascontiguousarray(x[a : a + c]))
            assert np.array_equal(alone, y[a : a + c]), (counts.tolist(), e)


@pytest.mark.parametrize("n", [40, QUANTISED_GATHER_ROWS + 32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_gathered_rows_are_the_copied_rows(mode: str, threads: int, n: int) -> None:
    """``gather``: a mixture's source rows in expert order, each read by several groups (a
    token's row by each of its experts); in auto, from ``QUANTISED_GATHER_ROWS`` rows,
    quantised once and the int8 rows copied, else the fp32 rows copied. The products are
    bitwise those of the fp32 rows copied first, and quantised rows (scales, sums and
    quants) bitwise the quantiser's of the copied rows."""
    mms, _ = experts(T.Q4_K, mode, threads)
    grouped = GroupedMatmul(mms[0], E, ActivationScratch(), ActivationScratch())
    at = np.array([address(mm.weights) for mm in mms], np.int64)
    x = activations(9, K)
    rows = np.random.default_rng(3).integers(0, len(x), n)
    counts, order = np.array([11, 3, 0, n - 14]), np.array([4, 0, 2, 5])
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    copied = np.ascontiguousarray(x[rows])
    out = np.empty_like(copied)
    gathered = grouped.gather(x, rows, out)
    y = np.full((len(rows), N), np.nan, np.float32)
    grouped(at[order], gathered, first, counts, y, first)
    scratch = ActivationScratch()  # another job quantises the copied fp32 rows
    other = GroupedMatmul(mms[0], E, scratch, ActivationScratch())
    expected = np.full_like(y, np.nan)
    other(at[order], copied, first, counts, expected, first)
    assert np.array_equal(y, expected)
    if grouped.copies_fp32(n):
        assert gathered is out and np.array_equal(out, copied)
    else:
        for mine, theirs in zip(gathered, scratch.views(len(rows), K), strict=True):
            assert np.array_equal(mine, theirs)


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_one_row_each_read_and_written_in_place(mode: str) -> None:
    """A decode step's call (``counts`` None): group g reads x's row ``x_first[g]`` and
    writes y's row ``y_first[g]``, wherever they lie; rows no group names stay untouched."""
    mms, _ = experts(T.Q8_0, mode, 2)
    grouped = GroupedMatmul(mms[0], E, ActivationScratch(), ActivationScratch())
    at = np.array([address(mm.weights) for mm in mms], np.int64)
    x = activations(3, K)
    y = np.full((7, N), np.nan, np.float32)
    order, x_first, y_first = np.array([5, 2, 0, 4]), np.array([2, 0, 2, 1]), np.array([6, 0, 3, 4])
    grouped(at[order], x, x_first, None, y, y_first)
    for e, a, b in zip(order, x_first, y_first, strict=True):
        assert np.array_equal(mms[e](x[a : a + 1]), y[b : b + 1]), e
    assert np.isnan(y[[1, 2, 5]]).all()


def test_refuses_what_it_cannot_run() -> None:
    mms, _ = experts(T.Q8_0, "exact", 1)
    grouped = GroupedMatmul(mms[0], 2, ActivationScratch(), ActivationScratch())
    at = np.array([address(mm.weights) for mm in mms[:3]], np.int64)
    one = np.zeros(3, np.int64)
    y = np.empty((3, N), np.float32)
    with pytest.raises(ValueError, match="3 groups, made for at most 2"):
        grouped(at, activations(3, K), one, None, y, one)
    with pytest.raises(ValueError, match=r"C-contiguous float32 \[., 256\]"):
        grouped(at[:2], activations(3, 2 * K)[:, ::2], one[:2], None, y, one[:2])


def test_a_shared_quantisation_scratch_that_moves() -> None:
    """Two grouped matmuls quantise into one scratch: when the other's larger call moves it,
    a call of a row count seen before quantises into the new buffer, not the freed one."""
    mms, _ = experts(T.Q8_0, "auto", 1)
    scratch = ActivationScratch()
    sources = ActivationScratch()
    first, other = (GroupedMatmul(mms[0], E, scratch, sources) for _ in range(2))
    at = np.array([address(mm.weights) for mm in mms], np.int64)
    rows = np.arange(3)
    for grouped, x in ((first, activations(3, K)), (other, activations(64, K)), (first, None)):
        x = activations(5, K)[2:] if x is None else x
        y = np.empty((len(x), N), np.float32)
        grouped(at[:3], x, rows, None, y, rows)
        for e in range(3):
            assert np.array_equal(mms[e](x[e : e + 1]), y[e : e + 1]), e
    assert scratch.generation == 2
