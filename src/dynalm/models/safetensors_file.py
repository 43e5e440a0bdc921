"""A validating, memory-mapped reader of SafeTensors files.

Layout::

    u64 header length N (little-endian) | N bytes of JSON | tensor data

The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data) and may hold a ``"__metadata__"`` object of
strings. Nothing in the header is trusted: its length must lie within the file, it must be
a JSON object of well-formed entries, every dtype known, every byte range inside the file,
no two ranges may overlap, and each range must hold exactly ``prod(shape) x dtype size``
bytes. Every problem is a ``dynalm.errors`` exception with a one-line message naming the
file and the tensor. Tensor bytes are views of the file's map, never copied.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynalm.errors import ModelFormatError, ModelNotFound, show

# The dtypes the SafeTensors format defines, with their numpy equivalents (little-endian);
# None: known to the format, but no numpy dtype reads it (refused where used, by name).
DTYPES: dict[str, np.dtype | None] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # read as raw 16-bit words: numpy has no bfloat16
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": None,
    "F8_E5M2": None,
}
_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1} | {k: v.itemsize for k, v in DTYPES.items() if v}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit
MAX_DIMS = 8


@dataclass(frozen=True)
class SafeTensor:
    """Where a tensor lies in its file and what it holds."""

    name: str
    dtype: str  # SafeTensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute offset in the file
    nbytes: int


class SafeTensorsFile:
    """An open SafeTensors file: its tensor table and read-only views of tensor bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.stat, self.opened_at = self.path.stat(), time.time()
            if self.path.is_dir():
                raise ModelFormatError(f"{self.path} is a directory, not a SafeTensors file")
            self.file_size = self.stat.st_size
            self._map: np.memmap | None = (
                np.memmap(self.path, dtype=np.uint8, mode="r") if self.file_size else None
            )
        except FileNotFoundError:
            raise ModelNotFound(f"{self.path}: no such file") from None
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read ({e.strerror})") from None
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, SafeTensor] = {}
        self._parse()

    def fail(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {message}")

    def _parse(self) -> None:
        if self.file_size < 8:
            raise self.fail(f"truncated: {self.file_size} bytes, not even a header length")
        assert self._map is not None
        n = int(self._map[:8].view("<u8")[0])
        if n > min(self.file_size - 8, MAX_HEADER_BYTES):
            raise self.fail(
                f"truncated: the header is {n} bytes long but the file has {self.file_size}"
            )
        try:
            header = json.loads(bytes(self._map[8 : 8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self.fail(f"the header is not JSON ({show(str(e), 120)})") from None
        if not isinstance(header, dict):
            raise self.fail(f"the header is {type(header).__name__}, not a JSON object")
        data_start, data_size = 8 + n, self.file_size - 8 - n
        for name, entry in header.items():
            if name == "__metadata__":
                if not isinstance(entry, dict) or not all(
                    isinstance(v, str) for v in entry.values()
                ):
                    raise self.fail(f"__metadata__ {show(entry)} is not an object of strings")
                self.metadata = entry
                continue
            self.tensors[name] = self._entry(name, entry, data_start, data_size)
        by_offset = sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes))
        for a, b in zip(by_offset, by_offset[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise self.fail(
                    f"tensors {show(a.name)} (bytes {a.offset}..{a.offset + a.nbytes}) and "
                    f"{show(b.name)} (from byte {b.offset}) overlap"
                )

    def _entry(self, name: str, entry: object, data_start: int, data_size: int) -> SafeTensor:
        what = f"tensor {show(name)}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise self.fail(f"{what}: {show(entry)} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise self.fail(f"{what} has unknown dtype {show(dtype)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d < 2**62 for d in shape)
        ):
            raise self.fail(f"{what} has invalid shape {show(shape)}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise self.fail(f"{what} has invalid data_offsets {show(offsets)}")
        begin, end = offsets
        if end > data_size:
            raise self.fail(
                f"truncated: {what} needs data bytes {begin}..{end} but the file holds "
                f"{data_size} bytes of data"
            )
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != nbytes:
            raise self.fail(
                f"{what} of {dtype} {shape} needs {nbytes} bytes but data_offsets "
                f"{offsets} hold {end - begin}"
            )
        return SafeTensor(name, dtype, tuple(shape), data_start + begin, nbytes)

    def array(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` with its dtype (BF16 as uint16 words), shaped."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        if dtype is None:
            raise self.fail(f"tensor {show(name)} has dtype {info.dtype}, which DynaLM cannot read")
        return self.bytes(name).view(dtype).reshape(info.shape)

    def bytes(self, name: str) -> np.ndarray:
        """A read-only uint8 view of tensor ``name``'s bytes."""
        if self._map is None:
            raise ValueError(f"{self.path} is closed")
        info = self.tensors[name]
        return self._map[info.offset : info.offset + info.nbytes].view(np.ndarray)

    def release_pages(self, start: int = 0, end: int | None = None) -> None:
        """Let the OS drop the resident pages of bytes ``start..end`` of the file (see
        ``GGUFFile.release_pages``)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = len(self._map) if end is None else end
        start -= start % mmap.PAGESIZE
        if end > start:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._map = None
