"""GGUF files taken apart and put back together, so tests can corrupt any field of one.

`Layout.read` splits a valid file into its header fields: the version, the metadata (each
value kept as its encoded bytes), the tensor infos and the tensor data; `Layout.encode`
writes them back byte for byte. Tests edit a copy (`replace`, `set_value`, `set_info`) or
the encoded bytes themselves (truncations), and `Layout.regions` names where each field of
the encoded file lies.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

V = GGUFValueType
_SCALAR = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


def string(s: str | bytes) -> bytes:
    data = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(data)) + data


def value(vtype: V, v: object, sub: V | None = None) -> bytes:
    """The encoded bytes of a metadata value (type id first), e.g. ``value(V.INT32, -1)``."""
    head = struct.pack("<I", vtype)
    if vtype == V.STRING:
        return head + string(v)  # type: ignore[arg-type]
    if vtype == V.ARRAY:
        assert sub is not None
        items = list(v)  # type: ignore[call-overload]
        body = b"".join(value(sub, x)[4:] for x in items)
        return head + struct.pack("<IQ", sub, len(items)) + body
    return head + struct.pack(_SCALAR[vtype], v)


@dataclass
class Info:
    """One tensor-info record; ``name`` in bytes so that it may be invalid UTF-8."""

    name: bytes
    ne: list[int]  # innermost first, as stored
    type: int
    offset: int  # relative to the data start
    n_dims: int | None = None  # as stored; None: len(ne)

    def encode(self) -> bytes:
        n_dims = len(self.ne) if self.n_dims is None else self.n_dims
        dims = struct.pack(f"<{len(self.ne)}Q", *(d % 2**64 for d in self.ne))
        return (
            string(self.name)
            + struct.pack("<I", n_dims)
            + dims
            + struct.pack("<IQ", self.type, self.offset % 2**64)
        )


@dataclass
class Layout:
    version: int
    kv: list[tuple[bytes, bytes]]  # (key, encoded value with its type id)
    infos: list[Info]
    data: bytes  # the tensor data region
    alignment: int = 32
    counts: tuple[int | None, int | None] = (None, None)  # stored (n_tensors, n_kv) overrides
    regions: list[tuple[str, int, int]] = field(default_factory=list)  # set by encode

    @classmethod
    def read(cls, path: Path) -> Layout:
        r = GGUFReader(path)
        kv = []
        for name, f in r.fields.items():
            if not name.startswith("GGUF."):
                kv.append((name.encode(), b"".join(p.tobytes() for p in f.parts[2:])))
        infos = [
            Info(
                t.name.encode(),
                [int(d) for d in t.shape],
                int(t.tensor_type),
                int(t.data_offset) - r.data_offset,
            )
            for t in r.tensors
        ]
        data = np.memmap(path, np.uint8, mode="r")[r.data_offset :].tobytes()
        return cls(int(r.fields["GGUF.version"].parts[0][0]), kv, infos, data, r.alignment)

    def copy(self, **changes: object) -> Layout:
        return dataclasses.replace(
            self, kv=list(self.kv), infos=[dataclasses.replace(i) for i in self.infos], **changes
        )

    def key_index(self, key: str) -> int:
        return [k for k, _ in self.kv].index(key.encode())

    def get(self, key: str) -> bytes:
        return self.kv[self.key_index(key)][1]

    def set_value(self, key: str, encoded: bytes) -> Layout:
        """A copy with ``key`` set to ``encoded`` (see `value`); added when absent."""
        out = self.copy()
        if key.encode() in [k for k, _ in out.kv]:
            out.kv[out.key_index(key)] = (key.encode(), encoded)
        else:
            out.kv.append((key.encode(), encoded))
        return out

    def without(self, key: str) -> Layout:
        out = self.copy()
        del out.kv[out.key_index(key)]
        return out

    def set_info(self, name: str, **fields: object) -> Layout:
        """A copy with the fields of tensor info ``name`` changed."""
        out = self.copy()
        info = next(i for i in out.infos if i.name == name.encode())
        for field_name, new in fields.items():
            setattr(info, field_name, new)
        return out

    def region(self, what: str) -> tuple[int, int]:
        """Where the region named ``what`` lies in the file ``encode`` last wrote."""
        return next((start, end) for name, start, end in self.regions if name == what)

    def encode(self) -> bytes:
        n_tensors, n_kv = self.counts
        parts = [(b"GGUF", "magic"), (struct.pack("<I", self.version), "version")]
        parts.append(
            (struct.pack("<Q", len(self.infos) if n_tensors is None else n_tensors), "tensor count")
        )
        parts.append((struct.pack("<Q", len(self.kv) if n_kv is None else n_kv), "kv count"))
        for key, encoded in self.kv:
            parts.append((string(key), f"key {key!r}"))
            parts.append((encoded, f"value of {key!r}"))
        for info in self.infos:
            parts.append((info.encode(), f"info {info.name!r}"))
        at = sum(len(p) for p, _ in parts)
        parts.append((bytes(-at % self.alignment), "padding"))
        parts.append((self.data, "tensor data"))
        out, self.regions = bytearray(), []
        for data, what in parts:
            self.regions.append((what, len(out), len(out) + len(data)))
            out += data
        return bytes(out)

    def write(self, path: Path, sparse_data: bool = False) -> Path:
        """Write the file; ``sparse_data`` leaves the tensor data a hole of zeros (no disk
        writes: for a large model whose header must be refused before any weight is read)."""
        encoded = self.encode()
        with open(path, "wb") as f:
            f.write(encoded[: len(encoded) - len(self.data)] if sparse_data else encoded)
            f.truncate(len(encoded))
        return path
