"""The JIT element-wise kernels (core.elementwise) against the numpy references of
core.cpu_ops, on odd widths (vector body + scalar tail) and 1 and 3 rows; with every kernel
backend (its vector width: 16 lanes on x86-avx512, 8 elsewhere), natively where this CPU
runs it and through its portable twin.

Budgets: add and RoPE are exact (same fp32 operations); RMSNorm differs in the summation
order of the mean square (`tolerances.sum_bound` of the width, halved by the square root)
and in a few roundings of the scale; the gated activations take ~8 roundings each way
(exp to about an ulp, an add, a divide, multiplies), relative to the magnitudes met
on the way: the result and gate * up (measured: under 2 u).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_matmul import VECTOR_BACKENDS, runnable

from dynalm.core import cpu_ops, elementwise, pool
from dynalm.kernel import backends
from tolerances import U, sum_bound

WIDTHS = [1, 7, 37, 576]
ROWS = [1, 3]


def rms_norm_rtol(width: int) -> float:
    """Two mean squares of ``width`` positive terms differ by twice `sum_bound` relative,
    the square root halves it; six roundings of the scale and the product each way."""
    return sum_bound(width, 1.0) + 12 * U


def rand(*shape: int, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_add(rows: int, width: int):
    x, y = rand(rows, width, seed=1), rand(rows, width, seed=2)
    out = np.empty_like(x)
    elementwise.add(out, x, y)()
    np.testing.assert_array_equal(out, x + y)
    expected = x + y
    elementwise.add(x, x, y)()  # in place, as the fused residual runs it
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [*WIDTHS, 1536])
def test_gated(activation: str, rows: int, width: int):
    gate, up = rand(rows, width, scale=4, seed=3), rand(rows, width, seed=4)
    specials = [-200.0, 200.0, 0.0, -1e-20][: gate.size]  # exp clamps: no NaN or inf
    gate.flat[: len(specials)] = specials
    expected = np.empty_like(gate)
    with np.errstate(over="ignore"):
        cpu_ops.gated(expected, gate, up, activation)
    out = np.empty_like(gate)
    elementwise.gated(out, gate, up, activation)()
    assert np.isfinite(out).all()
    assert (np.abs(out - expected) <= 16 * U * (np.abs(expected) + np.abs(gate * up))).all()


OAI = {"alpha": 1.702, "limit": 7.0}  # gpt-oss's (transformers' GptOssConfig defaults)


def oai_reference(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> None:
    cpu_ops.swiglu_oai(out, gate, up, OAI["alpha"], OAI["limit"])


def oai_budget(expected: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """`test_gated`'s budget, the product's magnitude that of the clamped operands."""
    g = np.minimum(gate, OAI["limit"])
    u = np.clip(up, -OAI["limit"], OAI["limit"]) + 1
    return 16 * U * (np.abs(expected) + np.abs(g * u))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [*WIDTHS, 1536])
def test_swiglu_oai(rows: int, width: int):
    """gpt-oss's gate: both clamps reached (|gate|, |up| up to ~30 past the limit 7),
    exp's clamp too, against the numpy reference and against torch's formula
    (transformers' ``GptOssExperts._apply_gate``, here in float64)."""
    gate, up = rand(rows, width, scale=8, seed=3), rand(rows, width, scale=8, seed=4)
    specials = [-200.0, 200.0, 0.0, -1e-20, 7.0, -7.0][: gate.size]
    gate.flat[: len(specials)] = specials
    up.flat[: len(specials)] = specials[::-1]
    if gate.size > 64:
        assert (gate > 7).any() and (up > 7).any() and (up < -7).any()
    expected, out = np.empty_like(gate), np.empty_like(gate)
    oai_reference(expected, gate, up)
    g, u = np.minimum(gate.astype(np.float64), 7.0), np.clip(up.astype(np.float64), -7, 7)
    with np.errstate(over="ignore"):
        torch_formula = (u + 1) * (g / (1 + np.exp(-1.702 * g)))
    assert (np.abs(expected - torch_formula) <= oai_budget(expected, gate, up)).all()
    elementwise.gated(out, gate, up, "swiglu_oai", **OAI)()
    assert np.isfinite(out).all()
    assert (np.abs(out - expected) <= oai_budget(expected, gate, up)).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm(rows: int, width: int):
    x, w = rand(rows, width, scale=3, seed=5), rand(width, seed=6)
    expected, out = np.empty_like(x), np.empty_like(x)
    cpu_ops.rms_norm(expected, x, w, 1e-6)
    elementwise.rms_norm(out, x, w, 1e-6)()
    np.testing.assert_allclose(out, expected, rtol=rms_norm_rtol(width), atol=0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_ops_of_the_table(rows: int, width: int):
    """mul, scale, a matmul's bias, split's column copy and gather_cols' gather: bitwise
    numpy's (one fp32 operation each, or a copy); SiLU / GELU alone: the gated kernels'
    budget, and bitwise what the gated kernel computes before its multiply by ``up``."""
    x, y = rand(rows, width, scale=3, seed=20), rand(rows, width, seed=21)
    out = np.full_like(x, np.nan)
    elementwise.mul(out, x, y)()
    np.testing.assert_array_equal(out, x * y)
    elementwise.scale(out, x, 0.1)()
    np.testing.assert_array_equal(out, x * np.float32(0.1))
    b = rand(width, seed=22)
    elementwise.bias(out, x, b)()
    np.testing.assert_array_equal(out, x + b)
    ones, gated, expected = np.ones_like(x), np.empty_like(x), np.empty_like(x)
    for activation, reference in (("silu", cpu_ops.silu), ("gelu_tanh", cpu_ops.gelu_tanh)):
        elementwise.activation(out, x, activation)()
        reference(expected, x)
        assert (np.abs(out - expected) <= 16 * U * (np.abs(expected) + np.abs(x))).all()
        elementwise.gated(gated, x, ones, activation)()
        np.testing.assert_array_equal(out, gated)
    big = x * 30  # tanh (a reranker's head): saturates to +-1 without overflow, else ~1 ulp
    elementwise.activation(out, big, "tanh")()
    np.testing.assert_allclose(out, np.tanh(big.astype(np.float64)), rtol=0, atol=8 * U)
    wide = rand(rows, 2 * width + 3, seed=23)
    for start in (0, 3, width + 3):  # a split of a wider buffer, into a view of another
        target = np.full((rows, width + 5), np.nan, np.float32)
        elementwise.columns(target[:, 5:], wide, start)()
        np.testing.assert_array_equal(target[:, 5:], wide[:, start : start + width])
        assert np.isnan(target[:, :5]).all()
    index = np.random.default_rng(24).permutation(width).astype(np.int32)
    elementwise.columns(out, x, 0, index)()
    np.testing.assert_array_equal(out, x[:, index])
    # row gathers (the embedding lookup, select_rows): repeated and out-of-order ids, from
    # a strided view into one; an id past the table reads its last row, never past it
    table = np.repeat(wide, 2, axis=0)[:, 3 : 3 + width]  # 2 * rows rows
    ids = np.resize([2 * rows - 1, 0, 2 * rows - 1, 1, 2 * rows + 7], rows).astype(np.int64)
    target = np.full((rows, width + 5), np.nan, np.float32)
    elementwise.rows(target[:, 5:], table, ids)()
    np.testing.assert_array_equal(target[:, 5:], table[np.minimum(ids, len(table) - 1)])
    assert np.isnan(target[:, :5]).all()


def test_rms_norm_per_head_is_a_norm_of_head_rows():
    rows, heads, head_dim = 3, 4, 10
    x, w = rand(rows, heads * head_dim, seed=7), rand(head_dim, seed=8)
    expected, out = np.empty_like(x), np.empty_like(x)
    cpu_ops.head_rms_norm(expected, x, w, 1e-6, head_dim)
    elementwise.rms_norm(out.reshape(-1, head_dim), x.reshape(-1, head_dim), w, 1e-6)()
    np.testing.assert_allclose(out, expected, rtol=rms_norm_rtol(head_dim), atol=0)


def test_fewer_rows_than_bound():
    """The executor binds full buffers and lowers the count per step."""
    x, w = rand(3, 37, seed=9), rand(37, seed=10)
    out = np.zeros_like(x)
    kernel = elementwise.rms_norm(out, x, w, 1e-5)
    kernel.block[0] = 1
    kernel()
    expected = np.empty_like(x[:1])
    cpu_ops.rms_norm(expected, x[:1], w, 1e-5)
    np.testing.assert_allclose(out[:1], expected, rtol=rms_norm_rtol(37), atol=0)
    assert not out[1:].any()


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 64), (10, 6), (18, 18)])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("view", [False, True])
def test_rope(neox: bool, head_dim: int, rope_dim: int, rows: int, view: bool):
    heads = 3
    x = rand(rows, heads * head_dim, seed=11)
    if view:  # x as some columns of a wider buffer (a merged q/k/v matmul's output)
        x = np.hstack([rand(rows, 5), x, rand(rows, 8)])[:, 5 : 5 + heads * head_dim]
    positions = np.array([7, 0, 300][:rows], np.int64)
    table = cpu_ops.RopeTable(rope_dim, 10000.0, 1.0)
    table.ensure(512)
    expected, out = np.empty_like(x), np.empty_like(x)
    cpu_ops.rope(expected, x, positions, table, head_dim, rope_dim, neox)
    elementwise.rope(out, x, positions, table.cos, table.sin, head_dim, rope_dim, neox)()
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_every_backend(backend: backends.Backend):
    """Each program at the backend's width, over widths with and without a vector tail:
    add and RoPE bitwise as numpy, the others within the budgets above, and every result
    bitwise that of the selected backend (lane-wise work, and RMSNorm's sum in 8 lanes
    everywhere: a model's outputs do not depend on the host's vector width)."""
    on = {"backend": runnable(backend)}
    for width in (7, 37, 576):
        x, y = rand(3, width, scale=3, seed=12), rand(3, width, seed=13)
        out, expected, selected = (np.empty_like(x) for _ in range(3))
        elementwise.add(out, x, y, **on)()
        np.testing.assert_array_equal(out, x + y)
        for activation in ("silu", "gelu_tanh"):
            elementwise.gated(out, x, y, activation, **on)()
            cpu_ops.gated(expected, x, y, activation)
            assert (np.abs(out - expected) <= 16 * U * (np.abs(expected) + np.abs(x * y))).all()
            elementwise.gated(selected, x, y, activation)()
            np.testing.assert_array_equal(out, selected)
        x8 = x * 4  # past the clamps
        elementwise.gated(out, x8, y * 8, "swiglu_oai", **OAI, **on)()
        oai_reference(expected, x8, y * 8)
        assert (np.abs(out - expected) <= oai_budget(expected, x8, y * 8)).all()
        elementwise.gated(selected, x8, y * 8, "swiglu_oai", **OAI)()
        np.testing.assert_array_equal(out, selected)
        w = rand(width, seed=14)
        elementwise.rms_norm(out, x, w, 1e-6, **on)()
        cpu_ops.rms_norm(expected, x, w, 1e-6)
        np.testing.assert_allclose(out, expected, rtol=rms_norm_rtol(width), atol=0)
        elementwise.rms_norm(selected, x, w, 1e-6)()
        np.testing.assert_array_equal(out, selected)
    # a mixture's programs: the router (its exp: bitwise the selected backend's), the
    # combine and a one-token step's expert biases (bitwise numpy's), the naming of experts
    logits = rand(3, 64, scale=3, seed=16)
    for gating in (1, 2):
        route, selected_route = np.empty((2, 3, 16), np.float32)
        elementwise.moe_route(route, logits, 8, gating, True, 2.5, **on)()
        elementwise.moe_route(selected_route, logits, 8, gating, True, 2.5)()
        np.testing.assert_array_equal(route, selected_route)
    y = rand(3, 8 * 37, seed=17)
    combined, expected = np.empty((2, 3, 37), np.float32)
    elementwise.combine(combined, y, route, **on)()
    cpu_ops.moe_combine(expected, y, route)
    np.testing.assert_array_equal(combined, expected)
    bias, slots = rand(64, 37, seed=18), y[:1].reshape(8, 37).copy()
    expected = slots + bias[route[0, :8].astype(int)]
    elementwise.expert_bias(slots, bias, route[:1], **on)()
    np.testing.assert_array_equal(slots, expected)
    table, counter, blocks = (
        np.arange(64, dtype=np.int64) + 1,
        np.zeros(2, np.int64),
        np.zeros((8, 9), np.int64),
    )
    miss = elementwise.MISS(lambda e: 0)  # (every expert in the table: never called)
    elementwise.select_experts(blocks[:, 0], route[:1], table, counter, miss, **on)()
    assert blocks[:, 0].tolist() == (route[0, :8].astype(int) + 1).tolist()
    positions = np.array([7, 0, 300], np.int64)
    for neox in (False, True):
        for head_dim, rope_dim in ((64, 64), (18, 18), (40, 24)):
            x = rand(3, 3 * head_dim, seed=15)
            table = cpu_ops.RopeTable(rope_dim, 10000.0, 1.0)
            table.ensure(512)
            out, expected = np.empty_like(x), np.empty_like(x)
            cpu_ops.rope(expected, x, positions, table, head_dim, rope_dim, neox)
            elementwise.rope(
                out, x, positions, table.cos, table.sin, head_dim, rope_dim, neox, **on
            )()
            np.testing.assert_array_equal(out, expected)


def _split_kernels(threads: int) -> tuple[list[elementwise.BoundKernel], list[np.ndarray]]:
    """Each row-range kernel over 64 rows (or their elements) of width 576, bound with
    ``threads``, and the arrays they write."""
    rows, width, top_k = 64, 576, 8
    x, y = rand(rows, width, scale=3, seed=30), rand(rows, width, seed=31)
    w, slots = rand(width, seed=32), rand(rows, top_k * width, seed=33)
    logits, bias = rand(rows, 64, scale=3, seed=34), rand(64, width, seed=35)
    table = cpu_ops.RopeTable(64, 10000.0, 1.0)
    table.ensure(512)
    positions = np.random.default_rng(36).integers(0, 512, rows)
    ids = np.random.default_rng(37).permutation(rows).astype(np.int64)
    outs = [np.full((rows, width), np.nan, np.float32) for _ in range(12)]
    route, experts = np.empty((rows, 2 * top_k), np.float32), slots.reshape(-1, width).copy()
    ends = np.arange(0, rows, 2, dtype=np.int64) + 1  # sequences of two rows
    pooled = np.empty((len(ends), width), np.float32)
    on = {"threads": threads}
    elementwise.moe_route(route, logits, top_k, 1, True, 1.0, **on)()  # (combine's input)
    kernels = [
        elementwise.add(outs[0], x, y, **on),
        elementwise.mul(outs[1], x, y, **on),
        elementwise.scale(outs[2], x, 0.1, **on),
        elementwise.activation(outs[3], x, "silu", **on),
        elementwise.gated(outs[4], x, y, "silu", **on),
        elementwise.bias(outs[5], x, w, **on),
        elementwise.combine(outs[6], slots, route, **on),
        elementwise.columns(outs[7], slots, 5, **on),
        elementwise.rows(outs[8], x, ids, **on),
        elementwise.rms_norm(outs[9], x, w, 1e-6, **on),
        elementwise.rope(outs[10], x, positions, table.cos, table.sin, 64, 64, False, **on),
        elementwise.l2_norm(outs[11], x, **on),
        elementwise.moe_route(np.empty_like(route), logits, top_k, 1, True, 1.0, **on),
        elementwise.expert_bias(experts, bias, route, **on),
        elementwise.pool_rows(pooled, x, ends, 1, **on),
        elementwise.layer_norm(np.empty_like(x), x, w, w, 1e-5, **on),
        elementwise.gelu(np.empty_like(x), x, **on),
    ]
    written = [*outs, kernels[12].arrays[0], experts, pooled, *(k.arrays[0] for k in kernels[15:])]
    return kernels, written


def test_split_over_threads_is_one_threads_result():
    """Every row-range kernel split over the pool's two threads (a row, or an element, each
    alone): bitwise what one thread computes; and a count too small to pay for the hand-off
    stays on the caller."""
    alone, expected = _split_kernels(1)
    split, got = _split_kernels(2)
    for kernel in alone:
        kernel()
    for kernel in split:
        if pool.available():
            assert kernel.records()[0][0] == pool.SPLIT, kernel.request[1].name
        kernel()
    for kernel, a, b in zip(split, expected, got, strict=True):
        np.testing.assert_array_equal(b, a, err_msg=kernel.request[1].name)
    x = rand(4, 576, seed=38)
    small = elementwise.rms_norm(np.empty_like(x), x, rand(576, seed=39), 1e-6, threads=2)
    assert small.records()[0][0] == pool.RANGE  # 4 rows of 576: ~28 KB


def test_refuses_non_contiguous_arrays():
    x = rand(4, 16)
    with pytest.raises(ValueError, match="C-contiguous"):
        elementwise.add(x[:, :8], x[:, :8], x[:, 8:])


def test_bindings_refuse_buffers_the_kernel_would_overrun():
    """Checks, not asserts (python -O keeps them): each names what does not fit."""
    x, table = rand(4, 64), cpu_ops.RopeTable(16, 10000.0, 1.0)
    table.ensure(8)
    positions = np.arange(4, dtype=np.int64)
    cases = [
        (lambda: elementwise.add(x, x, rand(4, 63)), r"y: expected float32 \[4, 64\]"),
        (lambda: elementwise.gated(x, x, x, "relu"), "unknown gate activation"),
        (lambda: elementwise.gated(x, x, x, "swiglu_oai", limit=-1.0), "limit -1.0"),
        (lambda: elementwise.rms_norm(x, x, rand(63), 1e-5), r"weight: expected float32 \[64\]"),
        (lambda: elementwise.rms_norm(x, x, rand(64), float("nan")), "epsilon nan"),
        (
            lambda: elementwise.rope(x, x, positions, table.cos, table.sin, 16, 32, False),
            "32 of 16",
        ),
        (lambda: elementwise.rope(x, x, positions, table.cos, table.sin, 24, 16, False), "of 24"),
        (
            lambda: elementwise.rope(x, x, positions[:3], table.cos, table.sin, 16, 16, False),
            "3 pos",
        ),
        (lambda: elementwise.rope(x, x, positions, table.cos, table.sin, 32, 32, False), "cos"),
        (lambda: elementwise.add(x, x, x, block=np.zeros(2, np.int64)), "block of 2 words"),
        (lambda: elementwise.scale(x, x, float("inf")), "scale factor inf is not finite"),
        (lambda: elementwise.activation(x, x, "relu"), "unknown activation 'relu'"),
        (lambda: elementwise.bias(x, x, rand(63)), r"bias: expected float32 \[64\]"),
        (lambda: elementwise.columns(rand(4, 16), x, 49), r"columns 49\+16 of \(4, 64\)"),
        (
            lambda: elementwise.columns(x, x, 0, np.arange(63, dtype=np.int32)),
            r"index: expected int32 \[64\]",
        ),
        (lambda: elementwise.rows(x, x, np.arange(3)), r"index: expected int64 \[4\]"),
        (lambda: elementwise.rows(x, rand(9, 63), np.arange(4)), r"x: expected float32"),
    ]
    for bind, message in cases:
        with pytest.raises(ValueError, match=message):
            bind()
