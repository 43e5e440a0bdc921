"""Checks of the arrays a JIT kernel is bound to.

A kernel gets raw addresses and indexes them with the shapes compiled into it, so an array
of the wrong shape, dtype or layout would make it read or write past a buffer. Every
binding checks its arrays here first and raises ``ValueError`` (a bug in the caller: user
input is checked long before, when the model is loaded). These checks are not ``assert``s,
which ``python -O`` removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check(
    what: str,
    a: np.ndarray,
    dtype: type | str,
    shape: Sequence[int | None],
    strided_rows: bool = False,
) -> np.ndarray:
    """``a`` must be ``dtype`` of ``shape`` (None: any size on that axis) and C-contiguous;
    with ``strided_rows`` its rows may lie further apart (a view of some columns of a wider
    2-D buffer), each row dense. Returns ``a``."""
    expected = np.dtype(dtype)
    fits = a.ndim == len(shape) and all(
        e is None or e == n for e, n in zip(shape, a.shape, strict=True)
    )
    if a.dtype != expected or not fits:
        dims = ", ".join("?" if e is None else str(e) for e in shape)
        raise ValueError(f"{what}: expected {expected.name} [{dims}], got {a.dtype} {a.shape}")
    if strided_rows:
        row_bytes = a.shape[1] * a.itemsize
        dense = a.ndim == 2 and a.strides[1] == a.itemsize and a.strides[0] >= row_bytes
    else:
        dense = a.flags.c_contiguous
    if not dense:
        layout = "rows of contiguous values" if strided_rows else "C-contiguous"
        raise ValueError(f"{what}: must be {layout}, got strides {a.strides}")
    return a


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (a binding's other invariants)."""
    if not condition:
        raise ValueError(message)
