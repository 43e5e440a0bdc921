"""The quant-format table against gguf's reference dequantisers (the oracle)."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest

from dynalm.core.quant import (
    QUANT_FORMATS,
    check_scales,
    dequantize,
    ggml_type_name,
    quant_format,
    random_blocks,
)
from dynalm.errors import ModelFormatError, UnsupportedModel

T = gguf.GGMLQuantizationType

# Byte offsets of the fp16 scale fields in each block: random bytes there could be NaN/inf.
FP16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.MXFP4: [],
}
FLOAT_DTYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.float32}

EXPECTED = {
    T.F32,
    T.F16,
    T.BF16,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q8_0,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ4_NL,
    T.IQ4_XS,
    T.MXFP4,
}


def random_rows(qtype: T, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random uint8 rows of ``qtype`` whose float fields are all finite."""
    fmt = quant_format(qtype)
    if qtype in FLOAT_DTYPES:
        values = rng.standard_normal((n_rows, n_cols)).astype(FLOAT_DTYPES[qtype])
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    n_blocks = n_rows * n_cols // fmt.block_size
    blocks = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, n_blocks).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    for at in fmt.exponents:  # every e8m0 exponent whose block stays finite (12 * 2**124)
        blocks[:, at] = rng.integers(0, 253, n_blocks, dtype=np.uint8)
        blocks[:2, at] = (0, 1)  # the denormal scales 2**-128, 2**-127
    return blocks.reshape(n_rows, fmt.row_bytes(n_cols))


def test_table_has_exactly_the_supported_types() -> None:
    assert set(QUANT_FORMATS) == {int(t) for t in EXPECTED}
    for key, fmt in QUANT_FORMATS.items():
        assert fmt.ggml_type == key
        assert fmt.name == T(key).name.lower()
        assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[T(key)]


@pytest.mark.parametrize("qtype", sorted(EXPECTED), ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    n_cols = 2 * quant_format(qtype).block_size if qtype not in FLOAT_DTYPES else 48
    raw = random_rows(qtype, 37, n_cols, rng)
    ours = dequantize(raw, qtype, n_cols)
    ref = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == np.float32
    assert ours.shape == (37, n_cols)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, ref)  # same float32 op order: bit-exact


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_keeps_leading_dims_and_accepts_memmap(qtype: T, tmp_path) -> None:
    n_cols = 512
    raw = random_rows(qtype, 6, n_cols, np.random.default_rng(0)).reshape(2, 3, -1)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    out = dequantize(mapped, qtype, n_cols)
    assert out.shape == (2, 3, n_cols)
    np.testing.assert_array_equal(
        out.reshape(6, n_cols), dequantize(raw.reshape(6, -1), qtype, n_cols)
    )


def test_quantised_values_round_trip() -> None:
    """A semantic check besides the oracle: quantising then dequantising is close."""
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    for qtype, tol in [(T.Q8_0, 0.02), (T.Q5_1, 0.1), (T.Q4_1, 0.2), (T.Q4_0, 0.3)]:
        raw = gguf.quants.quantize(x, qtype)
        assert np.abs(dequantize(raw, qtype, 256) - x).max() < tol, qtype.name


def test_row_bytes() -> None:
    assert quant_format(T.F32).row_bytes(7) == 28
    assert quant_format(T.F16).row_bytes(576) == 1152
    assert quant_format(T.Q4_1).row_bytes(576) == 18 * 20
    assert quant_format(T.Q8_0).row_bytes(64) == 68
    assert quant_format(T.Q6_K).row_bytes(512) == 420
    for bad in (0, 100, -32):
        with pytest.raises(ValueError, match="block size 32"):
            quant_format(T.Q4_0).row_bytes(bad)


def test_dequantize_rejects_wrong_row_width() -> None:
    raw = np.zeros((2, 41), dtype=np.uint8)
    with pytest.raises(ValueError, match="40 bytes for 64 columns"):
        dequantize(raw, T.Q4_1, 64)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(np.zeros((2, 40), dtype=np.int8), T.Q4_1, 64)


def test_unsupported_types_are_named() -> None:
    with pytest.raises(UnsupportedModel, match="IQ2_XXS"):
        quant_format(T.IQ2_XXS)
    with pytest.raises(UnsupportedModel, match="IQ3_S"):
        dequantize(np.zeros((1, 110), dtype=np.uint8), T.IQ3_S, 256)
    with pytest.raises(UnsupportedModel, match="4242"):
        quant_format(4242)
    assert ggml_type_name(T.Q4_K) == "Q4_K"
    assert ggml_type_name(4242) == "4242"


QUANTISED = [t for t, f in QUANT_FORMATS.items() if f.block_size > 1]


@pytest.mark.parametrize("qtype", QUANTISED, ids=lambda t: QUANT_FORMATS[t].name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_block_scale_is_refused_naming_block_and_row(qtype: int, bad) -> None:
    """Issue 31: NaN scales in one tensor went unnoticed in auto/exact (the JIT kernels
    swallow them); every f16 scale field of every quantised format is checked."""
    fmt = QUANT_FORMATS[qtype]
    rng = np.random.default_rng(31)
    blocks_per_row = 4
    for at in fmt.scales:
        raw = random_blocks(qtype, 3 * blocks_per_row, rng)
        check_scales(raw.reshape(3, -1), qtype)  # finite: accepted
        raw[6, at : at + 2] = np.array([bad], np.float16).view(np.uint8)
        with pytest.raises(ModelFormatError, match=rf"{fmt.name} block 2 of row 1 .*non-finite"):
            check_scales(raw.reshape(3, -1), qtype)


def test_the_scale_fields_are_where_the_reference_dequantiser_reads_them() -> None:
    """A NaN written at each listed offset reaches the reference dequantiser's output (so the
    offsets are the scales, not quants); an e8m0 exponent one higher doubles the block."""
    rng = np.random.default_rng(5)
    for qtype in QUANTISED:
        fmt = QUANT_FORMATS[qtype]
        assert fmt.scales or fmt.exponents, fmt.name
        for at in fmt.scales:
            raw = random_blocks(qtype, 1, rng)
            raw[0, at : at + 2] = np.array([np.nan], np.float16).view(np.uint8)
            assert np.isnan(fmt.dequantize(raw)).any(), (fmt.name, at)
        for at in fmt.exponents:
            raw = random_blocks(qtype, 1, rng)
            before = fmt.dequantize(raw)
            raw[0, at] += 1
            np.testing.assert_array_equal(fmt.dequantize(raw), 2 * before)
