"""The repack cache (``kernel.repack_cache``) under ``QuantMatmul``: the first build writes,
later ones read the file into huge-page memory or map it; a cached weight computes bitwise
what a fresh repack does; a file that is truncated, corrupted, of another key or of other
layout code is never trusted but repacked and replaced; an unwritable cache directory only
costs the repack; the size cap evicts the least recently used files."""

from __future__ import annotations

import ctypes
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_matmul import K_QUANTS, TABLES, VECTOR_BACKENDS, activations, runnable, weights

from dynalm.core import memory
from dynalm.core.matmul import QuantMatmul
from dynalm.kernel import repack_cache

SOURCE = ("/models/x.gguf@4096+1234", "1:2:3:4:5")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNALM_REPACK_CACHE", str(tmp_path / "repack"))
    return tmp_path / "repack"


def build(raw: np.ndarray, ggml_type: T, k: int, mode: str, source=SOURCE) -> QuantMatmul:
    return QuantMatmul(raw, ggml_type, k, mode=mode, threads=1, source=source)


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.bin"))


@pytest.mark.parametrize("pages", ["huge", "mapped"])
@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize(
    "ggml_type", [T.Q4_1, T.Q8_0, T.Q5_0, *K_QUANTS, *TABLES], ids=lambda t: t.name
)
def test_second_build_maps_the_first_ones_file(
    cache_dir: Path, ggml_type: T, mode: str, pages: str, monkeypatch: pytest.MonkeyPatch
):
    """A hit maps the file (``mapped``) or reads it into huge-page memory (``huge``)."""
    monkeypatch.setenv("DYNALM_WEIGHT_PAGES", pages)
    k = 512
    raw = weights(ggml_type, 67, k)
    fresh = QuantMatmul(raw, ggml_type, k, mode=mode, threads=1)  # no source: no cache
    first = build(raw, ggml_type, k, mode)
    assert first.repacked and len(entries(cache_dir)) == 1
    calls = []
    second = QuantMatmul(
        lambda: calls.append(1) or raw, ggml_type, k, mode=mode, threads=1,
        source=SOURCE, n_rows=67,
    )  # fmt: skip
    assert not second.repacked and not calls, "a mapped weight reads no GGUF rows"
    in_memory = memory.huge_pages()
    assert second._weights.flags.writeable == in_memory  # else the file's pages, read-only
    for t_rows in (1, 5, 40):
        x = activations(t_rows, k)
        want = fresh(x)
        assert np.array_equal(first(x), want) and np.array_equal(second(x), want)


def test_a_damaged_file_is_repacked_and_replaced(cache_dir: Path):
    raw, k = weights(T.Q4_1, 67, 576), 576
    x = activations(3, 576)
    want = build(raw, T.Q4_1, k, "auto")(x)
    (path,) = entries(cache_dir)
    good = path.read_bytes()
    header = repack_cache.HEADER_BYTES
    flipped = bytearray(good)
    flipped[header + len(good[header:]) // 2] ^= 0x10
    damages = {
        "truncated": good[:-100],
        "payload corrupted": bytes(flipped),
        "key corrupted": good[:40] + bytes([good[40] ^ 1]) + good[41:],
        "header text corrupted": good[:70] + bytes([good[70] ^ 1]) + good[71:],
        "empty": b"",
        "header only": good[:header],
    }
    for what, damaged in damages.items():
        path.write_bytes(damaged)
        mm = build(raw, T.Q4_1, k, "auto")
        assert mm.repacked, what
        assert np.array_equal(mm(x), want), what
        assert path.read_bytes() == good, f"{what}: the file is replaced"
        assert not build(raw, T.Q4_1, k, "auto").repacked, what


def test_other_identity_or_layout_code_never_hits(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The same place in a changed file (another stat identity) takes the old entry's
    slot; other layout code (its hash) does not read files of the old."""
    raw, k = weights(T.Q8_0, 67, 256), 256
    other = weights(T.Q8_0, 67, 512)[:, : raw.shape[1]].copy()  # other bytes, same shape
    x = activations(2, k)
    build(raw, T.Q8_0, k, "auto")
    changed = (SOURCE[0], "1:2:3:4:6")  # the GGUF's ctime moved
    mm = build(other, T.Q8_0, k, "auto", source=changed)
    assert mm.repacked
    assert np.array_equal(mm(x), QuantMatmul(other, T.Q8_0, k, mode="auto")(x))
    assert len(entries(cache_dir)) == 1, "a changed file overwrites its own entry"
    assert not build(other, T.Q8_0, k, "auto", source=changed).repacked
    monkeypatch.setattr(repack_cache, "code_version", lambda: "other layout code")
    assert build(other, T.Q8_0, k, "auto", source=changed).repacked


def test_layouts_and_modes_have_entries_of_their_own(cache_dir: Path):
    raw, k = weights(T.Q4_1, 67, 256), 256
    assert build(raw, T.Q4_1, k, "exact").repacked
    assert build(raw, T.Q4_1, k, "auto").repacked
    assert len(entries(cache_dir)) == 2
    assert not build(raw, T.Q4_1, k, "exact").repacked


def test_unwritable_cache_costs_only_the_repack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    raw, k = weights(T.Q4_1, 67, 256), 256
    x = activations(2, k)
    want = QuantMatmul(raw, T.Q4_1, k, mode="auto")(x)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    # a directory that cannot be created (works as root too), then a read-only one
    places = [blocker / "repack"]
    if os.geteuid() != 0:
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        places.append(read_only)
    for place in places:
        monkeypatch.setenv("DYNALM_REPACK_CACHE", str(place))
        for _ in range(2):
            mm = build(raw, T.Q4_1, k, "auto")
            assert mm.repacked and np.array_equal(mm(x), want)
    monkeypatch.setenv("DYNALM_REPACK_CACHE", "off")
    assert build(raw, T.Q4_1, k, "auto").repacked
    assert repack_cache.shared().directory is None


def test_read_only_cache_with_an_entry_maps_it(cache_dir: Path):
    """A cache written once and then made read-only (a shared, pre-filled directory) is
    still read."""
    raw, k = weights(T.Q4_1, 67, 256), 256
    build(raw, T.Q4_1, k, "auto")
    cache_dir.chmod(0o555)
    try:
        assert not build(raw, T.Q4_1, k, "auto").repacked
    finally:
        cache_dir.chmod(0o755)


def test_size_cap_evicts_least_recently_used(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    raw, k = weights(T.Q8_0, 67, 256), 256
    one = repack_cache.HEADER_BYTES + build(raw, T.Q8_0, k, "auto", ("a", "1"))._weights.size
    monkeypatch.setenv("DYNALM_REPACK_CACHE_MAX", str(2 * one))
    build(raw, T.Q8_0, k, "auto", ("b", "1"))
    (a,) = [p for p in entries(cache_dir) if p.stat().st_mtime == min(
        q.stat().st_mtime for q in entries(cache_dir))]  # fmt: skip
    os.utime(a, (1, 1))  # "a" used long ago
    fresh = repack_cache.RepackCache(cache_dir)  # a new process: scans the directory
    fresh.load_or_build(("c", "1"), "x", 10, lambda: np.zeros(10, np.uint8))
    assert len(entries(cache_dir)) == 2 and not a.exists()
    stale = cache_dir / ".tmp-crashed.bin"
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))
    monkeypatch.setenv("DYNALM_REPACK_CACHE_MAX", "0")
    repack_cache.RepackCache(cache_dir).load_or_build(
        ("d", "1"), "x", 10, lambda: np.zeros(10, np.uint8)
    )
    assert not stale.exists(), "a crashed writer's temporary is cleared"
    assert [p.name for p in entries(cache_dir)] != []  # the file just written stays


def test_a_process_never_evicts_the_entries_it_uses(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """One model's weights past the cap (gpt-oss-20b's experts past 8 GiB) all stay: the
    process writing them evicts none of its own; the next process that writes evicts them,
    least recently used first, down to the cap."""
    size = 4096
    one = repack_cache.HEADER_BYTES + size

    def weight(name: str, cache: repack_cache.RepackCache) -> bool:
        return cache.load_or_build((name, "1"), "x", size, lambda: np.ones(size, np.uint8))[1]

    monkeypatch.setenv("DYNALM_REPACK_CACHE_MAX", str(2 * one))
    model = repack_cache.RepackCache(cache_dir)
    assert all(weight(name, model) for name in "abcd")
    assert len(entries(cache_dir)) == 4, "none of the process's own entries evicted"
    again = repack_cache.RepackCache(cache_dir)  # the next start of the same model: all hits
    assert not any(weight(name, again) for name in "abcd")
    assert len(entries(cache_dir)) == 4
    other = repack_cache.RepackCache(cache_dir)  # another model's process
    assert weight("e", other)
    assert len(entries(cache_dir)) == 2


def lanes_oracle(payload: np.ndarray) -> np.ndarray:
    """``CHECKSUM``'s lane states, in numpy: per line of 8 uint64 words, h = (h ^ w) * M."""
    lines = payload.size // repack_cache.LINE
    words = payload[: lines * repack_cache.LINE].view(np.uint64).reshape(lines, -1)
    h = np.array(repack_cache.SEEDS, np.uint64)
    with np.errstate(over="ignore"):
        for row in words:
            h = (h ^ row) * np.uint64(repack_cache.MULTIPLIER)
    return h


@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_checksum_program_is_its_numpy_oracle_on_every_backend(backend):
    """The payload checksum's program (64-bit integer arithmetic only) gives the lanes the
    numpy oracle gives, on every backend and twin: a cache file checks the same whatever
    kernel ISA the process reading it runs."""
    backend = runnable(backend)
    payload = np.random.default_rng(5).integers(0, 256, 64 * 301, dtype=np.uint8)
    states = np.zeros(repack_cache.LANES, np.uint64)
    args = np.array([payload.ctypes.data, states.ctypes.data], np.int64)
    backend.lower(repack_cache.CHECKSUM, {}).cfunc(
        "", ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
    )(args.ctypes.data, 0, 301)
    assert np.array_equal(states, lanes_oracle(payload))


def test_checksum_tells_every_single_change():
    """Any one byte changed (in a whole line: one lane's word; in the partial last line:
    its crc32), a length cut short, or two lines swapped: another checksum."""
    payload = np.random.default_rng(6).integers(0, 256, 64 * 40 + 23, dtype=np.uint8)
    want = repack_cache.checksum(payload)
    assert want == int(np.bitwise_xor.reduce(lanes_oracle(payload))) ^ zlib.crc32(
        payload[40 * 64 :]
    )
    for at in range(0, payload.size, 7):
        for flip in (1, 0x80):
            changed = payload.copy()
            changed[at] ^= flip
            assert repack_cache.checksum(changed) != want, (at, flip)
    swapped = payload.copy()
    swapped[:64], swapped[64:128] = payload[64:128], payload[:64]
    assert repack_cache.checksum(swapped) != want
    assert repack_cache.checksum(payload[:-1]) != want
