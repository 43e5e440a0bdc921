"""Typed, range-checked reads of GGUF metadata values.

A GGUF file can hold any type under any key: a float where a count belongs, an array where
a scalar does, ``nan``, a negative id. Every read here names the key and the (shortened)
value it refuses, so the loader's error says exactly what in the file is wrong. An absent
key gives ``default`` unchecked (None allowed); without a default it is an error.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dynalm.errors import ModelFormatError, UnsupportedModel, show

_REQUIRED: Any = object()


def bad(key: str, value: object, expected: str) -> ModelFormatError:
    """The error for ``key`` holding ``value`` where ``expected`` belongs."""
    return ModelFormatError(f"{key} = {show(value)} is not {expected}")


def _absent(key: str, default: Any) -> Any:
    if default is _REQUIRED:
        raise ModelFormatError(f"the metadata has no {key}")
    return default


def integer(
    metadata: dict[str, Any],
    key: str,
    default: Any = _REQUIRED,
    lo: int = 0,
    hi: int = 2**63 - 1,
    n_layers: int = 0,
) -> Any:
    """An integer in ``[lo, hi]``; with ``n_layers`` also an array of one value per layer
    (some files store head counts so), which must then all be equal."""
    if key not in metadata:
        return _absent(key, default)
    value = metadata[key]
    if n_layers and isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        if len(value) != n_layers:
            raise bad(key, value, f"one value per layer ({n_layers})")
        if (value != value[0]).any():
            raise UnsupportedModel(
                f"{key} = {show(value)}: hyper-parameters that vary per layer are not supported"
            )
        value = int(value[0])
    if type(value) is not int:
        raise bad(key, value, "an integer")
    if not lo <= value <= hi:
        if lo == hi:
            raise bad(key, value, str(lo))
        if hi < 2**63 - 1:
            raise bad(key, value, f"an integer from {lo} to {hi}")
        raise bad(key, value, "a positive integer" if lo == 1 else f"an integer of at least {lo}")
    return value


def number(
    metadata: dict[str, Any], key: str, default: Any = _REQUIRED, hi: float = math.inf
) -> Any:
    """A finite number greater than 0 and at most ``hi``."""
    if key not in metadata:
        return _absent(key, default)
    value = metadata[key]
    if type(value) not in (int, float):
        raise bad(key, value, "a number")
    if not (math.isfinite(value) and 0 < value <= hi):
        limit = f" and at most {hi:g}" if hi < math.inf else ""
        raise bad(key, value, f"a finite number greater than 0{limit}")
    return float(value)


def _utf8(key: str, s: str) -> str:
    """``s`` unless it holds bytes that were not UTF-8 (the reader keeps them as lone
    surrogates, for tokens; no other string may have them)."""
    if not s.isascii():
        try:
            s.encode()
        except UnicodeEncodeError:
            raise bad(key, s, "valid UTF-8") from None
    return s


def text(metadata: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """A string of valid UTF-8."""
    if key not in metadata:
        return _absent(key, default)
    value = metadata[key]
    if not isinstance(value, str):
        raise bad(key, value, "a string")
    return _utf8(key, value)


def flag(metadata: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean (0 and 1 are taken as one)."""
    value = metadata.get(key, default)
    if type(value) is not bool and not (type(value) is int and value in (0, 1)):
        raise bad(key, value, "a boolean")
    return bool(value)


def strings(metadata: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """An array of valid UTF-8 strings."""
    if key not in metadata:
        return _absent(key, default)
    value = metadata[key]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(key, value, "an array of strings")
    for i, s in enumerate(value):
        _utf8(f"{key}[{i}]", s)
    return value


def numbers(metadata: dict[str, Any], key: str, length: int, kinds: str = "iuf") -> Any:
    """An array of ``length`` numbers of the numpy ``kinds`` ("iu": integers), or None."""
    if key not in metadata:
        return None
    value = metadata[key]
    if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds:
        raise bad(key, value, "an array of integers" if kinds == "iu" else "an array of numbers")
    if len(value) != length:
        raise ModelFormatError(f"{key} has {len(value)} entries for {length} tokens")
    return value
