"""Reading a file that a user hands us (a ``.lum`` program, DynaIR text, a model
directory's config, tokenizer or chat template): a regular file of bounded size that is
UTF-8 text, or one error line saying which it is not. Opened without blocking, so a FIFO or
a device in its place is refused instead of hanging the reader, and the size is checked
before any parser sees the bytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dynalm.errors import DynaError


def read_source(path: Path, max_bytes: int, error: type[DynaError] = DynaError) -> str:
    """The text of file ``path``; an ``OSError`` (``FileNotFoundError`` among them) where it
    cannot be opened, ``error`` where it is not a regular UTF-8 file of at most
    ``max_bytes``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise error(f"{path}: {info.st_size} bytes, more than the {max_bytes} allowed")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grown since the check
        raise error(f"{path}: more than the {max_bytes} bytes allowed")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise error(
            f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
        ) from None
