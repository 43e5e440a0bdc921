"""The encoder's JIT kernels (``core.elementwise``: layer_norm, gelu, l2_norm, pool_rows,
encoder_attention) against the numpy references of ``core.cpu_ops``, on odd widths (vector
body + scalar tail) and packed sequences of different lengths, with this host's backend.

Budgets: LayerNorm and the L2 norm sum in 8 lanes (`tolerances.sum_bound` of the width, a
few roundings more); GELU's erf is Abramowitz-Stegun 7.1.26 (absolute error 1.5e-7 in erf,
so |x| 1e-7 in GELU); attention's softmax uses the language's exp (about 1 ulp) and sums of
head_dim products and of the sequence's weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.core import cpu_ops, elementwise
from tolerances import U, sum_bound

WIDTHS = [1, 7, 37, 384]


def rand(*shape: int, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("width", WIDTHS)
def test_layer_norm(width: int) -> None:
    x = rand(3, width, scale=3.0, seed=1) + 5.0  # a large mean: two passes, no cancellation
    w, b = rand(width, seed=2), rand(width, seed=3)
    out, expected = np.empty_like(x), np.empty_like(x)
    elementwise.layer_norm(out, x, w, b, 1e-12 if width > 1 else 1e-5)()
    cpu_ops.layer_norm(expected, x, w, b, 1e-12 if width > 1 else 1e-5)
    np.testing.assert_allclose(out, expected, rtol=0, atol=sum_bound(width, 8.0) + 64 * U)
    # the rows split over the pool's threads: each row alone, so bitwise one thread's
    tall = np.repeat(x, 5, axis=0)
    split, one = np.empty_like(tall), np.empty_like(tall)
    elementwise.layer_norm(one, tall, w, b, 1e-12 if width > 1 else 1e-5)()
    elementwise.layer_norm(split, tall, w, b, 1e-12 if width > 1 else 1e-5, threads=2)()
    np.testing.assert_array_equal(split, one)
    np.testing.assert_array_equal(one[::5], out)


@pytest.mark.parametrize("width", WIDTHS)
def test_gelu_erf(width: int) -> None:
    x = rand(2, width, scale=4.0, seed=4)
    x.flat[:4] = [0.0, -30.0, 30.0, -1e-20][: x.size]
    out, expected = np.empty_like(x), np.empty_like(x)
    elementwise.gelu(out, x)()
    cpu_ops.gelu(expected, x)
    np.testing.assert_allclose(out, expected, rtol=4 * U, atol=2e-7 * np.abs(x).max())
    # split over the pool's threads at any element (not whole vectors): each lane alone,
    # so bitwise the one thread's
    split = np.empty_like(x)
    elementwise.gelu(split, x, threads=2)()
    np.testing.assert_array_equal(split, out)


@pytest.mark.parametrize("width", WIDTHS)
def test_l2_norm(width: int) -> None:
    x = rand(3, width, seed=5)
    x[1] = 0.0  # a zero row stays zero (the 1e-12 floor), no NaN
    out, expected = np.empty_like(x), np.empty_like(x)
    elementwise.l2_norm(out, x)()
    cpu_ops.l2_norm(expected, x)
    np.testing.assert_allclose(out, expected, rtol=sum_bound(width, 1.0) + 8 * U, atol=1e-30)
    assert not out[1].any()


LENGTHS = [1, 5, 2, 9]  # packed one after another: last rows 0, 5, 7, 16


@pytest.mark.parametrize("mode", [1, 2, 3])
@pytest.mark.parametrize("width", [7, 37])
def test_pool(mode: int, width: int) -> None:
    x = rand(sum(LENGTHS), width, seed=6)
    last = np.cumsum(LENGTHS).astype(np.int64) - 1
    out, expected = (
        np.empty((len(LENGTHS), width), np.float32),
        np.empty((len(LENGTHS), width), np.float32),
    )
    elementwise.pool_rows(out, x, last, mode)()
    cpu_ops.pool(expected, x, last, mode)
    np.testing.assert_allclose(out, expected, rtol=0, atol=sum_bound(max(LENGTHS), 4.0))
    with pytest.raises(ValueError, match="pooling mode 0 is not one of"):
        elementwise.pool_rows(out, x, last, 0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [8, 13])
def test_encoder_attention_within_each_sequence(head_dim: int, threads: int) -> None:
    heads, t = 3, sum(LENGTHS)
    q, k, v = (rand(t, heads * head_dim, seed=s) for s in (7, 8, 9))
    last = np.cumsum(LENGTHS).astype(np.int64) - 1
    out, expected = np.empty_like(q), np.empty_like(q)
    scale = 1.0 / np.sqrt(head_dim)
    elementwise.encoder_attention(out, q, k, v, last, head_dim, scale, threads=threads)()
    cpu_ops.encoder_attention(expected, q, k, v, last, head_dim, scale)
    np.testing.assert_allclose(out, expected, rtol=0, atol=sum_bound(max(LENGTHS), 4.0) + 1e-6)
    # a sequence's rows do not depend on its neighbours
    alone = np.empty((LENGTHS[1], heads * head_dim), np.float32)
    rows = slice(1, 1 + LENGTHS[1])
    one = np.array([LENGTHS[1] - 1], np.int64)
    elementwise.encoder_attention(alone, q[rows], k[rows], v[rows], one, head_dim, scale)()
    np.testing.assert_array_equal(alone, out[rows])
