"""Weights on huge pages (``core.memory.weight_buffer``): buffers that never overlap, each
on a cache line, a large one starting a huge page of its own, memory the kernel backs with
2 MiB pages where it has transparent huge pages, reserved pieces faulted in beside their
making, and ``$DYNALM_WEIGHT_PAGES`` read and checked."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from dynalm.core import memory
from dynalm.errors import InvalidRequest


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def huge_kib(a: np.ndarray) -> int:
    """``AnonHugePages`` of the mapping holding ``a``, KiB."""
    return smaps_field(a, "AnonHugePages:")


def smaps_field(a: np.ndarray, name: str) -> int:
    """A field of the mapping holding ``a`` in /proc/self/smaps, KiB."""
    at, inside = address(a), False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.readlines()
    for line in lines:
        field = line.split()
        if "-" in field[0] and not field[0].endswith(":"):
            lo, hi = (int(x, 16) for x in field[0].split("-"))
            inside = lo <= at < hi
        elif inside and field[0] == name:
            return int(field[1])
    raise AssertionError("no mapping holds the buffer")


def test_buffers_are_aligned_and_disjoint():
    sizes = [1, 63, 64, 1_216_512, 4096, 1_720_320, 7, 20 << 20]
    bufs = [memory.weight_buffer(n) for n in sizes]
    for buf, n in zip(bufs, sizes, strict=True):
        assert buf.dtype == np.uint8 and buf.size == n and buf.flags.writeable
        assert address(buf) % 64 == 0
    spans = sorted((address(b), address(b) + b.size) for b in bufs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    for i, buf in enumerate(bufs):  # written through, none clobbers another
        buf[:] = i
    assert all((buf == i).all() for i, buf in enumerate(bufs))
    big = bufs[-1]  # over half a chunk: a mapping of its own, from a huge page's start
    assert address(big) % memory.HUGE_PAGE == 0


@pytest.mark.skipif(not memory.transparent_huge_pages(), reason="kernel without THP")
def test_a_weight_sits_on_huge_pages():
    buf = memory.weight_buffer(16 << 20)
    buf[:] = 1  # faulted in
    assert huge_kib(buf) >= 8 << 10, "at least half of 16 MiB on 2 MiB pages"


def test_weight_pages_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DYNALM_WEIGHT_PAGES", "mapped")
    assert not memory.huge_pages()
    monkeypatch.setenv("DYNALM_WEIGHT_PAGES", "huge")
    assert memory.huge_pages() == memory.transparent_huge_pages()
    monkeypatch.setenv("DYNALM_WEIGHT_PAGES", "big")
    with pytest.raises(
        InvalidRequest, match="WEIGHT_PAGES: unknown value 'big' .choose huge or mapped"
    ):
        memory.huge_pages()


def rss_kib(a: np.ndarray) -> int:
    """``Rss`` of the mapping holding ``a``, KiB."""
    return smaps_field(a, "Rss:")


@pytest.mark.skipif(not memory.huge_pages(), reason="weights not on huge pages here")
def test_reserved_weights_come_in_turn_from_memory_faulted_in_beside():
    """``reserve_weights(each, count)`` (a step's newly routed experts): the next ``count``
    buffers of ``each`` bytes follow one another in one mapping, whose pages a thread of
    its own faults in meanwhile (Linux 5.14's ``MADV_POPULATE_WRITE``)."""
    each, count = 1_216_512, 12
    memory.reserve_weights(each, count)
    bufs = [memory.weight_buffer(each) for _ in range(count)]
    starts = [address(b) for b in bufs]
    assert all(b - a == -(-each // 64) * 64 for a, b in zip(starts, starts[1:], strict=False))
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    if release >= (5, 14):
        deadline = time.monotonic() + 10
        while rss_kib(bufs[-1]) < count * each // 1024 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rss_kib(bufs[-1]) >= count * each // 1024, "faulted in without a write"
    for i, b in enumerate(bufs):
        b[:] = i
    assert all((b == i).all() for i, b in enumerate(bufs))
