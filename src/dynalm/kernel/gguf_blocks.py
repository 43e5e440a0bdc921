"""Bit-level fields of GGUF quant blocks (numpy): shared by the reference dequantisers
(``core.quant``) and the kernels' weight repacking (``kernel.formats``)."""

from __future__ import annotations

import numpy as np


def f16_field(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at : at + 2]).view("<f2").astype(np.float32)


def bit_fields(x: np.ndarray, width: int) -> np.ndarray:
    """Split each byte of ``x [..., k]`` into ``width``-bit fields, lowest field first.

    Returns ``[..., (8 // width) * k]`` where element ``s * k + j`` is field ``s``
    of byte ``j`` (for width 4: all low nibbles, then all high nibbles).
    """
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    fields = (x[..., None, :] >> shifts) & np.uint8((1 << width) - 1)
    return fields.reshape(*x.shape[:-1], -1)


def k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit (scale, min) pairs packed in 12 bytes, as float32 [n, 8].

    Bytes 0-3 hold scales 0-3 in bits 0-5; bytes 4-7 hold mins 0-3 likewise. Pairs
    4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min: high nibble)
    and their top 2 bits from bits 6-7 of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# 16-value tables that 4-bit indices select from (ggml-common.h): llama.cpp's non-linear
# int8 grid of IQ4_NL and IQ4_XS (kvalues_iq4nl), and MXFP4's e2m1 values doubled
# (kvalues_mxfp4: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, times 2; the block scale
# is halved to match, ``e8m0_half``).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's block scale, the e8m0 exponent byte ``e`` as float32 ``2**(e - 128)`` (half
    of e8m0's ``2**(e - 127)``; ggml's GGML_E8M0_TO_FP32_HALF): exponent field ``e - 1``,
    and for ``e`` < 2 the denormals 2**-128 and 2**-127."""
    e = e.astype(np.uint32)
    small = np.uint32(0x00200000) << (e & np.uint32(1))
    bits = np.where(e < 2, small, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS: the 6-bit scales (32 still to subtract) of a super-block's eight 32-blocks,
    uint8 [n, 8]. Low 4 bits from ``scales_l`` (bytes 4-7: block 2j's in byte j's low
    nibble, 2j + 1's in its high one), top 2 from the little-endian u16 ``scales_h``
    (bytes 2-3: bits 2i for block i)."""
    low = (b[:, 4:8, None] >> np.array([0, 4], np.uint8)) & np.uint8(15)
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))
    return low.reshape(-1, 8) | ((high & 3).astype(np.uint8) << np.uint8(4))
