"""The quant-format table: one row per GGUF tensor type DynaLM can run.

Each row gives the block geometry (elements and bytes per block) and a vectorised
numpy reference dequantiser, following ggml's block layouts (ggml-common.h). The
dequantisers are the oracle that faster kernels are tested against; they are
never used on the hot path except in ``--mode safe``.

All multi-byte fields are little-endian. "fp16" below means an IEEE half scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from dynalm.errors import ModelFormatError, UnsupportedModel
from dynalm.kernel.gguf_blocks import (
    IQ4NL_VALUES,
    MXFP4_VALUES,
    bit_fields,
    e8m0_half,
    f16_field,
    iq4_xs_scales,
    k_scales_mins,
)

QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF tensor type: its block geometry and reference dequantiser."""

    name: str  # lower-case, e.g. "q4_1"
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_size: int  # elements per block
    type_size: int  # bytes per block
    dequantize: Callable[[np.ndarray], np.ndarray]  # u8 [n, type_size] -> f32 [n, block_size]
    scales: tuple[int, ...] = ()  # byte offsets of a block's f16 scale fields (d, dmin)
    exponents: tuple[int, ...] = ()  # byte offsets of a block's e8m0 scale bytes (MXFP4)

    def row_bytes(self, n_cols: int) -> int:
        """Bytes taken by one row of ``n_cols`` elements."""
        if n_cols <= 0 or n_cols % self.block_size:
            raise ValueError(
                f"{self.name}: row length {n_cols} is not a positive multiple of "
                f"the block size {self.block_size}"
            )
        return n_cols // self.block_size * self.type_size


# --- shared helpers ---------------------------------------------------------------


def _q5_high_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1: the 32 fifth bits (a little-endian u32 at ``at``) as uint8 [n, 32]."""
    return np.unpackbits(b[:, at : at + 4], axis=1, bitorder="little") << np.uint8(4)


# --- dequantisers: uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size] -------


def _deq_f32(b: np.ndarray) -> np.ndarray:
    return b.view("<f4").astype(np.float32)


def _deq_f16(b: np.ndarray) -> np.ndarray:
    return b.view("<f2").astype(np.float32)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32
    return (b.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    # fp16 d | 16 B nibbles (x[j] = low nibble of byte j, x[j+16] = high nibble); (q-8)*d
    q = bit_fields(b[:, 2:18], 4).astype(np.float32) - 8
    return f16_field(b, 0) * q


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    # fp16 d | fp16 m | 16 B nibbles as in Q4_0; q*d + m
    return f16_field(b, 0) * bit_fields(b[:, 4:20], 4).astype(np.float32) + f16_field(b, 2)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    # fp16 d | u32 fifth bits (bit j for x[j]) | 16 B nibbles as in Q4_0; (q-16)*d
    q = (bit_fields(b[:, 6:22], 4) | _q5_high_bits(b, 2)).astype(np.float32) - 16
    return f16_field(b, 0) * q


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    # fp16 d | fp16 m | u32 fifth bits | 16 B nibbles; q*d + m
    q = (bit_fields(b[:, 8:24], 4) | _q5_high_bits(b, 4)).astype(np.float32)
    return f16_field(b, 0) * q + f16_field(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    # fp16 d | 32 x int8; q*d
    return f16_field(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    # 16 B scales (per 16-element sub-block: low nibble scale, high nibble min) |
    # 64 B 2-bit quants (two halves of 32 B; in each, x[32*s + l] = bits 2s of byte l) |
    # fp16 d | fp16 dmin;  x = d*scale*q - dmin*min
    n = len(b)
    sc = b[:, 0:16]
    q = bit_fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).astype(np.float32)
    dl = (f16_field(b, 80) * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (f16_field(b, 82) * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    # 32 B high-bit mask (x[32*s + l] = bit s of byte l) | 64 B low 2 bits as in Q2_K |
    # 12 B sixteen 6-bit scales (low 4 bits: nibbles of bytes 0-7, low nibbles first;
    # top 2 bits: 2-bit fields of bytes 8-11) | fp16 d;
    # x = d*(scale-32)*(q - (high bit clear ? 4 : 0))
    n = len(b)
    low = bit_fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, QK_K)
    minus4 = (bit_fields(b[:, 0:32], 1) ^ np.uint8(1)) << np.uint8(2)
    q = (low.astype(np.float32) - minus4.astype(np.float32)).reshape(n, 16, 16)
    sc = bit_fields(b[:, 96:104], 4) | (bit_fields(b[:, 104:108], 2) << np.uint8(4))
    dl = (f16_field(b, 108) * (sc.astype(np.float32) - 32))[:, :, None]
    return (dl * q).reshape(n, QK_K)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    # fp16 d | fp16 dmin | 12 B 6-bit scales/mins | 128 B nibbles: four 32 B chunks,
    # each 64 elements (low nibbles, then high); 8 sub-blocks of 32;
    # x = d*scale*q - dmin*min
    n = len(b)
    scales, mins = k_scales_mins(b[:, 4:16])
    q = bit_fields(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32).astype(np.float32)
    dl = (f16_field(b, 0) * scales)[:, :, None]
    ml = (f16_field(b, 2) * mins)[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    # fp16 d | fp16 dmin | 12 B 6-bit scales/mins | 32 B fifth bits (x[32*s + l] = bit s
    # of byte l) | 128 B nibbles as in Q4_K;  x = d*scale*q - dmin*min
    n = len(b)
    scales, mins = k_scales_mins(b[:, 4:16])
    low = bit_fields(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, QK_K)
    q = (low | (bit_fields(b[:, 16:48], 1) << np.uint8(4))).reshape(n, 8, 32).astype(np.float32)
    dl = (f16_field(b, 0) * scales)[:, :, None]
    ml = (f16_field(b, 2) * mins)[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    # 128 B low nibbles (two halves of 64 B; in each, 128 elements: low nibbles then high) |
    # 64 B top 2 bits (two halves of 32 B; x[32*s + l] = bits 2s of byte l) |
    # 16 x int8 scales (one per 16 elements) | fp16 d;  x = d*scale*(q-32)
    n = len(b)
    low = bit_fields(b[:, 0:128].reshape(n, 2, 64), 4).reshape(n, QK_K)
    high = bit_fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, QK_K)
    q = (low | (high << np.uint8(4))).astype(np.float32).reshape(n, 16, 16) - 32
    dl = (f16_field(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    return (dl * q).reshape(n, QK_K)


_IQ4NL = np.array(IQ4NL_VALUES, np.float32)
_MXFP4 = np.array(MXFP4_VALUES, np.float32)


def _deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    # fp16 d | 16 B 4-bit indices (nibbles as Q4_0) into kvalues_iq4nl; d*value
    return f16_field(b, 0) * _IQ4NL[bit_fields(b[:, 2:18], 4)]


def _deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    # fp16 d | u16 scales_h | 4 B scales_l (a 6-bit scale per 32, see iq4_xs_scales) |
    # 128 B indices: 16 B per 32-block, nibbles as IQ4_NL;  x = d*(scale-32)*value
    n = len(b)
    dl = f16_field(b, 0) * (iq4_xs_scales(b).astype(np.float32) - 32)
    q = _IQ4NL[bit_fields(b[:, 8:136].reshape(n, 8, 16), 4)]
    return (dl[:, :, None] * q).reshape(n, QK_K)


def _deq_mxfp4(b: np.ndarray) -> np.ndarray:
    # e8m0 exponent e | 16 B 4-bit indices (nibbles as Q4_0) into kvalues_mxfp4 (e2m1
    # doubled);  x = 2**(e-128)*value
    return e8m0_half(b[:, 0:1]) * _MXFP4[bit_fields(b[:, 1:17], 4)]


# --- the table --------------------------------------------------------------------

_T = GGMLQuantizationType
QUANT_FORMATS: dict[int, QuantFormat] = {
    int(row.ggml_type): row
    for row in (
        QuantFormat("f32", _T.F32, 1, 4, _deq_f32),
        QuantFormat("f16", _T.F16, 1, 2, _deq_f16),
        QuantFormat("bf16", _T.BF16, 1, 2, _deq_bf16),
        QuantFormat("q4_0", _T.Q4_0, 32, 18, _deq_q4_0, (0,)),
        QuantFormat("q4_1", _T.Q4_1, 32, 20, _deq_q4_1, (0, 2)),
        QuantFormat("q5_0", _T.Q5_0, 32, 22, _deq_q5_0, (0,)),
        QuantFormat("q5_1", _T.Q5_1, 32, 24, _deq_q5_1, (0, 2)),
        QuantFormat("q8_0", _T.Q8_0, 32, 34, _deq_q8_0, (0,)),
        QuantFormat("q2_k", _T.Q2_K, QK_K, 84, _deq_q2_k, (80, 82)),
        QuantFormat("q3_k", _T.Q3_K, QK_K, 110, _deq_q3_k, (108,)),
        QuantFormat("q4_k", _T.Q4_K, QK_K, 144, _deq_q4_k, (0, 2)),
        QuantFormat("q5_k", _T.Q5_K, QK_K, 176, _deq_q5_k, (0, 2)),
        QuantFormat("q6_k", _T.Q6_K, QK_K, 210, _deq_q6_k, (208,)),
        QuantFormat("iq4_nl", _T.IQ4_NL, 32, 18, _deq_iq4_nl, (0,)),
        QuantFormat("iq4_xs", _T.IQ4_XS, QK_K, 136, _deq_iq4_xs, (0,)),
        QuantFormat("mxfp4", _T.MXFP4, 32, 17, _deq_mxfp4, exponents=(0,)),
    )
}


def check_scales(raw: np.ndarray, ggml_type: int) -> None:
    """Raise ``ModelFormatError`` where a block's f16 scale of ``raw`` (uint8 rows of GGUF
    blocks) is NaN or infinite. The JIT kernels would not carry it to the logits (their
    integer sums and max-based activation scales swallow it), so the model would answer
    fluently from a damaged tensor; refused here, at the cost of one strided read per
    field while the weight is repacked anyway."""
    fmt = quant_format(ggml_type)
    if not fmt.scales:
        return
    blocks = raw.reshape(-1, fmt.type_size)
    for at in fmt.scales:
        bits = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.uint16).ravel()
        bad = np.flatnonzero((bits & 0x7C00) == 0x7C00)  # exponent all ones: inf or NaN
        if len(bad):
            i = int(bad[0])
            value = float(bits[i : i + 1].view(np.float16)[0])
            per_row = raw.shape[-1] // fmt.type_size if raw.ndim > 1 else len(blocks)
            raise ModelFormatError(
                f"{fmt.name} block {i % per_row} of row {i // per_row} has a non-finite "
                f"scale ({value}; {len(bad)} such fields)"
            )


# Integer tensors a model may carry beside its weights: indices, never multiplied (a GPTQ
# act-order layer's input permutation, see ``models.gptq_awq``). Not rows of the table: no
# matmul, embedding or vector kernel takes them.
INDEX_TYPES: dict[int, str] = {int(_T.I32): "i32"}


def tensor_type_name(ggml_type: int) -> str:
    """The DynaIR dtype of a tensor type: its table row's name, or an index type's."""
    if ggml_type in INDEX_TYPES:
        return INDEX_TYPES[ggml_type]
    return quant_format(ggml_type).name


def tensor_type(name: str) -> int:
    """The GGUF tensor type of a DynaIR dtype (``tensor_type_name``'s inverse)."""
    return int(GGMLQuantizationType[name.upper()])


def ggml_type_name(ggml_type: int) -> str:
    """The GGUF name of a tensor type (``"IQ2_XXS"``), or its number if unknown."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


def quant_format(ggml_type: int) -> QuantFormat:
    """The table row of ``ggml_type``; ``UnsupportedModel`` if DynaLM cannot run it."""
    row = QUANT_FORMATS.get(ggml_type)
    if row is None:
        raise UnsupportedModel(
            f"tensor type {ggml_type_name(ggml_type)} is not supported by DynaLM yet"
        )
    return row


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks with random quants and small fp16 scales, for kernel tests and benchmarks
    of formats gguf cannot quantise (uint8 ``[n_blocks, type_size]``; quantised types only)."""
    fmt = quant_format(ggml_type)
    blocks = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    for at in fmt.scales:
        scale = rng.uniform(0.002, 0.02, n_blocks).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    for at in fmt.exponents:  # 2**-10 .. 2**-5
        blocks[:, at] = rng.integers(118, 124, n_blocks, dtype=np.uint8)
    return blocks


def dequantize(raw: np.ndarray, ggml_type: int, n_cols: int) -> np.ndarray:
    """Dequantise ``raw`` (uint8 ``[..., row_bytes]``) to float32 ``[..., n_cols]``."""
    fmt = quant_format(ggml_type)
    row_bytes = fmt.row_bytes(n_cols)
    if raw.dtype != np.uint8 or raw.ndim == 0 or raw.shape[-1] != row_bytes:
        raise ValueError(
            f"{fmt.name}: expected uint8 rows of {row_bytes} bytes for {n_cols} columns, "
            f"got {raw.dtype} array of shape {raw.shape}"
        )
    blocks = np.ascontiguousarray(raw).reshape(-1, fmt.type_size)
    return fmt.dequantize(blocks).reshape(*raw.shape[:-1], n_cols)
