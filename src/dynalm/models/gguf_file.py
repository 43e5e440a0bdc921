"""A validating, memory-mapped reader of GGUF files (versions 2 and 3, little-endian).

Layout (all integers little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x       (string key, u32 value type, value)
    n_tensors x  (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment (default 32) | tensor data (offsets are relative to here)

A string is a u64 byte length then UTF-8 bytes; an array is a u32 element type, a u64
count, then the elements. ``ne`` lists dimensions innermost first; ``TensorInfo.shape``
is numpy order (outermost first).

Every problem with the file is reported as a ``dynalm.errors`` exception with a one-line
message naming the file; lengths read from the file are checked against the file size
before anything is allocated, so a corrupt file never costs gigabytes of memory.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from dynalm.core.quant import QUANT_FORMATS, ggml_type_name
from dynalm.errors import ModelFormatError, ModelNotFound, UnsupportedModel, show
from dynalm.models import hparams

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_KEY_BYTES = 65535  # the GGUF specification's limit on a key
MAX_NAME_BYTES = 63  # llama.cpp's limit on a tensor name (GGML_MAX_NAME - 1)
_MAX_ARRAY_NESTING = 8

# Metadata value types.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_ARRAY_DTYPES = {t: np.dtype(f.replace("?", "B")) for t, f in _SCALAR_FORMATS.items()}
# Fewest bytes an element of each kind can take: bounds counts before allocating.
_MIN_STRING_BYTES = 8
_MIN_ARRAY_BYTES = 12
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in the file and what it holds."""

    name: str
    shape: tuple[int, ...]  # numpy order, outermost first
    ggml_type: int
    offset: int  # absolute offset in the file
    nbytes: int


class _Cursor:
    """Reads GGUF fields from a buffer, turning every over-read into ModelFormatError."""

    def __init__(self, path: Path, buf: memoryview) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def fail(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated: {what} at offset {self.pos} needs {n} bytes "
                f"but the file has {self.size}"
            )

    def take(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes; returns where they start."""
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        # surrogateescape: a token that is not valid UTF-8 keeps its bytes recoverable
        return bytes(self.buf[start : start + n]).decode("utf-8", "surrogateescape")

    def name(self, max_bytes: int, what: str) -> str:
        """A key or tensor name: at most ``max_bytes`` of valid UTF-8."""
        at = self.pos
        n = self.u64(f"length of {what}")
        if n > max_bytes:
            raise self.fail(f"{what} at offset {at} is {n} bytes long (at most {max_bytes})")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode()
        except UnicodeDecodeError:
            raw = bytes(self.buf[start : start + n])
            raise self.fail(f"{what} {show(raw)} is not valid UTF-8") from None

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings in a row: ``string`` inlined, as a vocabulary has ~100k of them and
        this loop was most of the load time."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        length = struct.Struct("<Q").unpack_from
        for i in range(n):
            if size - pos < 8 or (k := length(buf, pos)[0]) > size - pos - 8:
                self.pos = pos
                self.string(f"{what}[{i}]")  # truncated: raises the error naming the element
            pos += 8
            out.append(str(buf[pos : pos + k], "utf-8", "surrogateescape"))
            pos += k
        self.pos = pos
        return out

    def count(self, min_item_bytes: int, what: str) -> int:
        """A u64 element count, refused when the elements cannot fit in the rest of the file."""
        n = self.u64(f"count of {what}")
        self.need(n * min_item_bytes, f"{n} {what}")
        return n

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= _MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_ARRAY_NESTING} deep")
        etype = self.u32(f"element type of {what}")
        if etype in _ARRAY_DTYPES:
            dtype = _ARRAY_DTYPES[etype]
            n = self.count(dtype.itemsize, f"elements of {what}")
            start = self.take(n * dtype.itemsize, what)
            arr = np.frombuffer(self.buf, dtype, n, start).astype(dtype.newbyteorder("="))
            return arr.astype(bool) if etype == 7 else arr
        if etype == _STRING:  # a vocabulary or its merges: bounded before any is read
            n = self.count(_MIN_STRING_BYTES, f"strings of {what}")
            if n > hparams.MAX_VOCAB:
                raise self.fail(
                    f"{what} holds {n} strings, more than {hparams.MAX_VOCAB} (the largest "
                    "vocabulary read)"
                )
            return self.strings(n, what)
        if etype == _ARRAY:
            n = self.count(_MIN_ARRAY_BYTES, f"arrays of {what}")
            return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(n)]
        raise self.fail(f"{what} has unknown element type {etype}")


class GGUFFile:
    """An open GGUF file: its metadata, its tensor table, and read-only views of tensor bytes.

    The file is memory-mapped; ``raw`` returns views into the map, which stay valid
    after ``close`` for as long as they are referenced.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            # Read before mapping: the identity the repack cache keys this file's weights by.
            self.stat, self.opened_at = self.path.stat(), time.time()
            self.file_size = self.stat.st_size
            if self.path.is_dir():
                raise ModelFormatError(f"{self.path} is a directory, not a GGUF file")
            if self.file_size == 0:
                raise ModelFormatError(f"{self.path} is empty, not a GGUF file")
            self._map: np.memmap | None = np.memmap(self.path, dtype=np.uint8, mode="r")
            self._fd = os.open(self.path, os.O_RDONLY) if hasattr(os, "preadv") else None
        except FileNotFoundError:
            raise ModelNotFound(f"{self.path}: no such file") from None
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read ({e.strerror})") from None
        self._parse(_Cursor(self.path, memoryview(self._map)))

    def _parse(self, cur: _Cursor) -> None:
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            if len(magic) < 4 and GGUF_MAGIC.startswith(magic):
                cur.need(4, "magic")
            raise ModelFormatError(f"{self.path} is not a GGUF file (magic {magic!r})")
        cur.pos = 4
        self.version: int = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            if int.from_bytes(self.version.to_bytes(4, "little"), "big") in (1, 2, 3):
                raise cur.fail("big-endian GGUF files are not supported")
            raise cur.fail(
                f"unsupported GGUF version {self.version} (DynaLM reads versions 2 and 3)"
            )
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        cur.need(n_kv * _MIN_KV_BYTES, f"{n_kv} metadata entries")

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.name(MAX_KEY_BYTES, f"metadata key #{i}")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {show(key)}")
            vtype = cur.u32(f"value type of {show(key)}")
            self.metadata[key] = cur.value(vtype, f"metadata {show(key)}")

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment = {show(alignment)} is not a power of two")

        cur.need(n_tensors * _MIN_TENSOR_INFO_BYTES, f"{n_tensors} tensor infos")
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
        data_start = cur.pos + -cur.pos % alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, rel_offset in infos:
            if name in self.tensors:
                raise cur.fail(f"duplicate tensor name {name!r}")
            if rel_offset % alignment:
                raise cur.fail(
                    f"tensor {name!r} has offset {rel_offset}, "
                    f"not a multiple of the alignment {alignment}"
                )
            fmt = QUANT_FORMATS[ggml_type]
            nbytes = math.prod(shape[:-1]) * fmt.row_bytes(shape[-1])
            start = data_start + rel_offset
            if start + nbytes > self.file_size:
                raise cur.fail(
                    f"truncated: tensor {name!r} needs bytes {start}..{start + nbytes} "
                    f"but the file has {self.file_size}"
                )
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_offset, by_offset[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise cur.fail(
                    f"tensors {a.name!r} (bytes {a.offset}..{a.offset + a.nbytes}) and "
                    f"{b.name!r} (from byte {b.offset}) overlap"
                )

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.name(MAX_NAME_BYTES, f"name of tensor #{i}")
        what = f"tensor {name!r}"
        n_dims = cur.u32(f"n_dims of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = [cur.u64(f"dimensions of {what}") for _ in range(n_dims)]
        if any(not 1 <= d < 2**63 for d in ne):
            raise cur.fail(f"{what} has invalid dimensions {ne}")
        ggml_type = cur.u32(f"type of {what}")
        rel_offset = cur.u64(f"offset of {what}")
        if ggml_type not in QUANT_FORMATS:
            raise UnsupportedModel(
                f"{self.path}: {what} has type {ggml_type_name(ggml_type)}, "
                "which DynaLM cannot run yet"
            )
        fmt = QUANT_FORMATS[ggml_type]
        if ne[0] % fmt.block_size:
            raise cur.fail(
                f"{what} has rows of {ne[0]} elements, not a multiple of the "
                f"{fmt.name} block size {fmt.block_size}"
            )
        return name, tuple(reversed(ne)), ggml_type, rel_offset

    @property
    def architecture(self) -> str:
        """``general.architecture``, e.g. ``"llama"``."""
        arch = self.metadata.get("general.architecture")
        if arch is None:
            raise ModelFormatError(f"{self.path}: metadata has no general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: general.architecture {show(arch)} is not a name")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """Read-only uint8 view of a tensor's bytes, shape ``(*shape[:-1], row_bytes)``."""
        if self._map is None:
            raise ValueError(f"{self.path} is closed")
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path}: no tensor named {name!r}")
        row_bytes = QUANT_FORMATS[info.ggml_type].row_bytes(info.shape[-1])
        view = self._map[info.offset : info.offset + info.nbytes].view(np.ndarray)
        return view.reshape(*info.shape[:-1], row_bytes)

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of tensor ``name`` as uint8 ``[len(ids), row bytes]``, read with
        ``pread``: a lookup into a large table (an embedding) then maps none of its pages
        (the kernel maps whole folios around a touched row: 512 random rows of a 262k-row
        embedding made 147 MB of it resident)."""
        info = self.tensors[name]
        row_bytes = QUANT_FORMATS[info.ggml_type].row_bytes(info.shape[-1])
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and not (ids.min() >= 0 and ids.max() < math.prod(info.shape[:-1])):
            raise ValueError(f"row ids outside tensor {name!r} of shape {info.shape}")
        if self._fd is None:  # no pread on this platform: read through the map
            return self.raw(name).reshape(-1, row_bytes)[ids]
        # each row once: a step's positions repeat across its sequences, its token types
        # are one or two rows (an encoder step read them a pread per token: ~3 % of it)
        unique, where = np.unique(ids, return_inverse=True)
        rows = np.empty((unique.size, row_bytes), np.uint8)
        for row, i in zip(rows, unique.tolist(), strict=True):
            if os.preadv(self._fd, [row], info.offset + i * row_bytes) != row_bytes:
                raise ModelFormatError(f"{self.path}: short read in tensor {name!r}")
        return rows[where.reshape(-1)]

    def release_pages(self, name: str | None = None, rows: tuple[int, int] | None = None) -> None:
        """Let the OS unmap the resident pages of tensor ``name`` (default: the whole file),
        or of its ``rows`` (lo, hi), from this process: once weights are repacked into memory
        of their own, the map would count them twice in RSS. A page read again faults back in
        from the page cache (no disk read while it stays cached)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = 0, len(self._map)
        if name is not None:
            info = self.tensors[name]
            start, end = info.offset, info.offset + info.nbytes
            if rows is not None:
                row_bytes = QUANT_FORMATS[info.ggml_type].row_bytes(info.shape[-1])
                start, end = info.offset + rows[0] * row_bytes, info.offset + rows[1] * row_bytes
            start -= start % mmap.PAGESIZE
        self._map._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Drop this object's map; views from ``raw`` keep the mapping alive until freed."""
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
