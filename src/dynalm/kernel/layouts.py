"""Compact weight layouts: GGUF rows repacked once into the order the matmul programs read.

Two layouts, both a stream of *records* per row group so that a register tile reads one
contiguous stream; K-quants' super-blocks each start with a *side record* (the rows'
fp16 factors, ``Unpack.side``) before the records of its ``SUPER`` blocks, so the stream
stays one linear read (``side_interleave``):

* ``RowLayout(rows=4)`` (``exact``): ``rows`` weight rows interleaved; per row group one
  record per step of the kernel's block loop (``GROUP`` blocks while a whole group fits,
  then single blocks); a record holds each field in turn, and a field the rows' blocks one
  row after the other, so a row's scales for the record's blocks are one vector load.
* ``LaneLayout(lanes=L)`` (``auto``): ``L`` rows, one per fp32 lane of the backend's
  vectors; per row group one record per block holding each field of the group's rows in
  *lane order* (quants as chunks of 4 elements of every row side by side; scales and side
  fields as one vector of the rows per value).

``repack`` walks the GGUF rows a chunk at a time, so memory holds one chunk's
temporaries and the mapped source of a chunk can be dropped (``release_rows``) before the
next is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynalm.kernel.formats import QK, SUPER, Unpack

GROUP = 4  # blocks per exact main-loop step: their scales are loaded and converted as one vector

# Repack this many bytes of GGUF rows at a time.
_REPACK_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class RowLayout:
    rows: int = 4

    def write(
        self, u: Unpack, planes: dict[str, np.ndarray], n_rows: int, nb: int, out: np.ndarray
    ) -> None:
        """Repacked planes (``[n_rows * nb, size]`` per field, in block order; side fields
        ``[n_rows * nb / SUPER, size]``) -> ``out``, uint8 ``[ceil(n_rows / rows), rows *
        packed row bytes]`` (the last row group padded with zero blocks)."""
        rows, groups = self.rows, out.shape[0]
        main = nb - nb % GROUP
        for lo, hi, g in ((0, main, GROUP), (main, nb, 1)):
            n_rec = (hi - lo) // g
            if not n_rec:
                continue
            records = out[:, rows * lo * u.block_bytes : rows * hi * u.block_bytes]
            records = records.reshape(groups, n_rec, -1)
            for f, size, at in u.fields:
                src = planes[f].view(np.uint8).reshape(n_rows, nb, size)[:, lo:hi]
                if n_rows % rows:
                    src = np.concatenate(
                        [src, np.zeros((groups * rows - n_rows, *src.shape[1:]), np.uint8)]
                    )
                dst = records[:, :, rows * g * at : rows * g * (at + size)]
                dst = dst.reshape(groups, n_rec, rows, g, size)
                dst[...] = src.reshape(groups, rows, n_rec, g, size).transpose(0, 2, 1, 3, 4)


@dataclass(frozen=True)
class LaneLayout:
    rows: int = 8  # one weight row per fp32 lane of the backend's vectors

    def write(
        self, u: Unpack, planes: dict[str, np.ndarray], n_rows: int, nb: int, out: np.ndarray
    ) -> None:
        """Repacked planes -> ``out``, uint8 ``[ceil(n_rows / rows), nb * rows *
        block_bytes]`` (the last row group padded with zero rows)."""
        lanes, groups = self.rows, out.shape[0]
        full = n_rows // lanes
        out = out[:, : nb * lanes * u.block_bytes].reshape(groups, nb, lanes * u.block_bytes)
        for f, size, at in u.fields:
            src = planes[f].view(np.uint8).reshape(n_rows, nb, size)
            dst = out[:, :, lanes * at : lanes * (at + size)]
            if full:
                self._lane_order(u, f, src[: full * lanes], dst[:full])
            if full < groups:
                last = np.zeros((lanes, nb, size), np.uint8)
                last[: n_rows - full * lanes] = src[full * lanes :]
                self._lane_order(u, f, last, dst[full:])

    def _lane_order(self, u: Unpack, field: str, rows: np.ndarray, dst: np.ndarray) -> None:
        """One field of whole row groups, uint8 ``[groups * lanes, nb, size]``, into
        ``dst`` ``[groups, nb, lanes * size]``: quants as chunks (``qs``: the rows' 4-byte
        units side by side, unit j of every row, then j + 1; ``qh``: chunk j's 4 bits of
        each row together, bit 4r + c; ``q2``: word w's byte 4r + c holds chunk 4w + s's
        2 bits at bit 2s), scales as one vector of the rows per sub-block scale. One
        strided copy (the weights may be large)."""
        lanes = self.rows
        groups, nb, width = dst.shape
        size = width // lanes
        src = rows.reshape(groups, lanes, nb, size)
        if field == "qh":
            bits = np.unpackbits(src, axis=-1, bitorder="little").reshape(groups, lanes, nb, 8, 4)
            bits = bits.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8, lanes * 4)
            dst[...] = np.packbits(bits, axis=-1, bitorder="little").reshape(groups, nb, width)
            return
        if field == "q2":  # the plane: element e at bits 2 * (e // 8) of byte e % 8
            two = (src[..., None, :] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
            two = two.reshape(groups, lanes, nb, 32)  # [.., element]
            chunks = two.reshape(groups, lanes, nb, 2, 4, 4)  # [.., w, s, c]
            shifted = chunks << (2 * np.arange(4, dtype=np.uint8))[:, None]
            words = np.bitwise_or.reduce(shifted, axis=-2)  # [g, lanes, nb, w, c]
            dst[...] = words.transpose(0, 2, 3, 1, 4).reshape(groups, nb, width)
            return
        unit = 4 if field == "qs" else u.unit(field)
        view = dst.reshape(groups, nb, size // unit, lanes, unit)
        if not np.may_share_memory(view, dst):  # a copy would leave dst unwritten
            raise ValueError(f"{field}: the lane order needs a view of the destination")
        view[...] = src.reshape(groups, lanes, nb, size // unit, unit).transpose(0, 2, 3, 1, 4)


Layout = RowLayout | LaneLayout


def side_interleave(
    u: Unpack, planes: dict[str, np.ndarray], n_rows: int, nb: int, out: np.ndarray, per: int
) -> None:
    """``out`` (row groups of ``per`` rows, their block records written in order) with
    each super-block's side record put before its ``SUPER`` blocks' records: per field
    the ``per`` rows' values side by side."""
    groups, n_super = out.shape[0], nb // SUPER
    main = np.array(out[:, : nb * per * u.block_bytes]).reshape(groups, n_super, -1)
    side_rec = per * u.side_bytes
    dst = out.reshape(groups, n_super, side_rec + main.shape[-1])
    dst[:, :, side_rec:] = main
    for f, size, at in u.side_fields:
        src = planes[f].view(np.uint8).reshape(n_rows, n_super, size)
        if n_rows % per:
            pad = np.zeros((groups * per - n_rows, n_super, size), np.uint8)
            src = np.concatenate([src, pad])
        field = dst[:, :, per * at : per * (at + size)].reshape(groups, n_super, per, size)
        field[...] = src.reshape(groups, per, n_super, size).transpose(0, 2, 1, 3)


def repack(
    u: Unpack,
    raw: np.ndarray,
    n_cols: int,
    layout: Layout,
    release_rows: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """GGUF rows ``raw`` (uint8 ``[N, row bytes]``) -> the flat uint8 stream of ``layout``,
    a chunk of whole row groups at a time; ``release_rows(lo, hi)`` is called once rows
    ``lo:hi`` are repacked."""
    n_rows, per = raw.shape[0], layout.rows
    groups = -(-n_rows // per)
    out = np.empty((groups, per * u.packed_bytes(n_cols)), np.uint8)
    step = max(1, _REPACK_CHUNK_BYTES // raw.shape[1] // per) * per
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        planes = u.repack(np.ascontiguousarray(raw[lo:hi]).reshape(-1, u.type_size))
        part = out[lo // per : -(-hi // per)]
        layout.write(u, planes, hi - lo, n_cols // QK, part)
        if u.side:
            side_interleave(u, planes, hi - lo, n_cols // QK, part, per)
        if release_rows is not None:
            release_rows(lo, hi)
    return out.reshape(-1)
