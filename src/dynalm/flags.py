"""The one parser of every numeric command-line flag: integers, decimal numbers, memory
sizes and durations, written in ASCII (Python's ``int`` and ``float`` also take ``²``-free
Unicode digits such as Arabic-Indic ``٣``, and ``int`` refuses 4,300 digits with an
internal error), each flag with its stated range. An error names the flag, its range and
what was given.

``Int``, ``Float``, ``Size`` and ``Duration`` are the flags' parsers (``typer.Option(parser=...)``);
``parse_int`` and friends are the same parsers for a value found inside another (a list such
as ``bench -p 128,512``)."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import typer

from dynalm.errors import InvalidRequest, show

_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?", re.ASCII | re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# Go's time.ParseDuration units, as Ollama's keep_alive takes them ("5m", "1h30m", "500ms")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION = re.compile(r"[+-]?(?:" + _DURATION_PART.pattern + r")+")
MAX_DURATION_S = 10**9  # ~31 years: longer is "forever", which is written -1
MAX_TOKENS = 1 << 20  # a count of tokens (context, batch, generated): beyond any model
MAX_DIGITS = 40  # more is out of every range: refused before any conversion


def size_text(n: int) -> str:
    """``n`` bytes as the shortest exact binary unit (8MiB), for ranges in messages."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit[:2].lower()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _fail(flag: str, want: str, text: str) -> InvalidRequest:
    """``flag`` (none where click names it already) must be ``want``."""
    return InvalidRequest(f"{flag + ' ' if flag else ''}must be {want}, found {show(text, 60)}")


def parse_int(text: str, flag: str, lo: int, hi: int) -> int:
    text = text.strip()
    want = f"an integer in [{lo}, {hi}] (ASCII digits)"
    if not _INT.fullmatch(text) or len(text) > MAX_DIGITS:
        raise _fail(flag, want, text)
    value = int(text)
    if not lo <= value <= hi:
        raise _fail(flag, want, text)
    return value


def parse_float(text: str, flag: str, lo: float, hi: float) -> float:
    text = text.strip()
    want = f"a number in [{lo:g}, {hi:g}] (ASCII digits)"
    if not _FLOAT.fullmatch(text) or len(text) > MAX_DIGITS:
        raise _fail(flag, want, text)
    value = float(text)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise _fail(flag, want, text)
    return value


def parse_size(text: str, flag: str, lo: int, hi: int) -> int:
    """Bytes of a size such as ``512MiB``, ``1.5GB`` or ``1000000``."""
    text = text.strip()
    want = f"a size in [{size_text(lo)}, {size_text(hi)}] (e.g. 512MiB, 2GB)"
    m = _SIZE.fullmatch(text)
    if not m or len(m.group(1)) > MAX_DIGITS:
        raise _fail(flag, want, text)
    value = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()])  # exact, no float
    if not lo <= value <= hi:
        raise _fail(flag, want, text)
    return value


def parse_duration(text: str, flag: str) -> float:
    """Seconds of a duration as Ollama's ``keep_alive`` takes it: a Go duration (``10m``,
    ``30s``, ``1h30m``, ``500ms``) or a number of seconds; 0 is "now"; any negative is
    "forever" (returned as -1)."""
    text = text.strip()
    want = (
        "a duration such as 10m, 30s, 1h or a number of seconds (0: at once; negative or "
        f"over {MAX_DURATION_S} s: forever)"
    )
    if len(text) > MAX_DIGITS:
        raise _fail(flag, want, text)
    if _FLOAT.fullmatch(text):
        value = float(text)
    elif _DURATION.fullmatch(text):
        parts = _DURATION_PART.findall(text)
        value = sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts)
        value = -value if text.startswith("-") else value
    else:
        raise _fail(flag, want, text)
    if not math.isfinite(value):
        raise _fail(flag, want, text)
    return -1.0 if value < 0 or value > MAX_DURATION_S else value


class _Number:
    """A flag's parser (``typer.Option(parser=...)``); click's message names the flag:
    "Invalid value for '--port': must be an integer in [0, 65535] ..."."""

    def __init__(self, parse: Any, lo: float, hi: float):
        self.parse, self.lo, self.hi = parse, lo, hi

    def __call__(self, value: Any) -> Any:
        try:
            return self.parse(str(value), "", self.lo, self.hi)
        except InvalidRequest as e:
            raise typer.BadParameter(str(e)) from None


class Int(_Number):
    name = "integer"

    def __init__(self, lo: int, hi: int):
        super().__init__(parse_int, lo, hi)


class Float(_Number):
    name = "number"

    def __init__(self, lo: float, hi: float):
        super().__init__(parse_float, lo, hi)


class Duration(_Number):
    name = "duration"

    def __init__(self) -> None:
        super().__init__(lambda text, flag, lo, hi: parse_duration(text, flag), -1, MAX_DURATION_S)


class Size(_Number):
    name = "size"

    def __init__(self, lo: int, hi: int):
        super().__init__(parse_size, lo, hi)
