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
