"""Repacked weights on disk: each weight repacked once per layout, memory-mapped on later loads.

A weight's repacked stream (``layouts.repack``) is a pure function of its GGUF bytes, its
type and shape, the layout and the layout code. It is written once, beside the JIT cache,
to ``$DYNALM_CACHE/repack`` (default ``~/.cache/dynalm/repack``; ``$DYNALM_REPACK_CACHE``
names another directory, or ``off`` disables the cache), one file per weight and layout,
and later loads read that file (or map it read-only) instead of repacking: no repack time.
Read into memory the caller gives (``into``: the CPU's weights go to huge pages, see
``core.memory``), or mapped: file-backed pages the kernel can drop and re-read.

Keys. A file's *name* is a hash of where the weight comes from (the GGUF's real path and
the tensors' byte ranges in it) and how it is laid out (type, shape, layout), so a changed
GGUF overwrites its old entry instead of adding one. Its *header* holds the full key: that
plus the GGUF's identity as the file system reports it (device, inode, size, mtime and
ctime in nanoseconds, read before the file is mapped) and the version of the layout code
(a hash of ``layouts.py``, ``formats.py`` and ``gguf_blocks.py``, whose code decides
the bytes). Hashing the
weights' contents instead would read the whole GGUF on every load (about 70 ms per 100 MB
for a crc32 on the machines here, and the file's pages in memory again), which is what the
cache is there to avoid. The stat identity cannot miss a change made through the file
system: any write or replacement of the file changes its ctime (or its inode), and ctime
cannot be set back from user space; a copy of the file is a new inode, so a new key.

Files. A header (magic, format, payload length, a checksum of the payload, the key, a
crc32 of the header itself; 4 KiB, so the payload is page-aligned) and the payload. Written
to a temporary file and renamed into place, so a reader sees a whole file or none; a file
that does not match (truncated, corrupted, another key or version) is repacked and
replaced. The payload's checksum is checked on every load, so a file half-persisted by a
crash (no fsync is done) is never trusted: ``checksum``, a kernel program of 8 lanes of
64-bit multiplicative hashing (35 GB/s from memory, 0.03 ms a 1.2 MB expert, where zlib's
crc32 ran 4.3 GB/s and 0.28 ms on the Zen 4 host: most of an expert's load). A read-only
or full cache directory costs only time. The cache is kept under
``$DYNALM_REPACK_CACHE_MAX`` bytes (default 8 GiB) by deleting the least recently used
files (a hit refreshes a file's mtime), never those the deleting process uses (the cap
yields to one model's weights).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import llvmlite.ir as ir
import numpy as np

from dynalm.kernel import backends, jit
from dynalm.kernel.backends import Program
from dynalm.kernel.lang import I64, PTR, Module, vec

FORMAT = 2  # of the file; bump it (or change the layout code) and old files are replaced
HEADER_BYTES = 4096
_MAGIC = b"DLMREPK\x00"
# magic, format, payload bytes, payload checksum, key (sha256), then the header's own crc32
_FIXED = struct.Struct("<8sIQQ32s")
# ``checksum``: lanes of 64-bit words, a line of them a step; each lane's state goes
# h -> (h ^ word) * MULTIPLIER (odd: a bijection of h and of the word, so a change to any
# one word changes its lane's end state, and the XOR of the lanes)
LANES, LINE = 8, 64
MULTIPLIER = 0x9E3779B97F4A7C15
SEEDS = tuple(0x243F6A8885A308D3 * (i + 1) % 2**64 for i in range(LANES))
_DEFAULT_MAX_BYTES = 8 << 30
_STALE_TMP_SECONDS = 3600  # temporaries older than this were left by a crashed writer


def cache_dir() -> Path | None:
    """Where repacked weights live; ``None`` when the cache is off."""
    setting = os.environ.get("DYNALM_REPACK_CACHE", "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return Path(setting)
    root = os.environ.get("DYNALM_CACHE")
    return Path(root) / "repack" if root else Path.home() / ".cache" / "dynalm" / "repack"


def max_bytes() -> int:
    try:
        return int(os.environ.get("DYNALM_REPACK_CACHE_MAX", _DEFAULT_MAX_BYTES))
    except ValueError:
        return _DEFAULT_MAX_BYTES


@cache
def code_version() -> str:
    """A hash of the code that decides the repacked bytes (and of ``FORMAT``)."""
    here = Path(__file__).parent
    h = hashlib.sha256(str(FORMAT).encode())
    for name in ("layouts.py", "formats.py", "gguf_blocks.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _signed(value: int) -> ir.Constant:
    return ir.Constant(I64, value - 2**64 if value >= 2**63 else value)


def _build_checksum(module: Module) -> None:
    """``f(args, lo, hi)``, args = [buffer, out]: the lanes' states over the buffer's
    lines ``[lo, hi)`` stored to ``out`` (``LANES`` uint64)."""
    k = module.kernel(module.ir.name, (PTR, I64, I64))
    buf, out = (k.pointer(w) for w in k.words(k.args[0], 2))
    ty = vec(I64, LANES)
    state = k.var(ir.Constant(ty, [_signed(s) for s in SEEDS]), ty)
    multiplier = ir.Constant(ty, [_signed(MULTIPLIER)] * LANES)

    def line(at: ir.Value) -> None:
        state.set(k.b.mul(k.b.xor(state.get(), k.load(ty, buf, at, 8)), multiplier))

    k.loop(k.mul(k.args[1], LINE), k.mul(k.args[2], LINE), LINE, line)
    k.store(state.get(), out, 0, 8)
    k.ret()


CHECKSUM = Program("repack_checksum", _build_checksum)


@cache
def _checksum_lines() -> ctypes._CFuncPtr:
    """The ``CHECKSUM`` program on the host's best backend (integer arithmetic: the same
    lanes on every backend), lowered once per process."""
    fn = backends.host_best().lower(CHECKSUM, {}).addresses[""]
    return jit.cfunc(fn, None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def checksum(payload: np.ndarray) -> int:
    """A uint64 of ``payload`` (uint8, 8-byte aligned): its whole lines through the
    ``CHECKSUM`` program, their lanes' states XORed, then the crc32 of the last partial
    line."""
    lines = payload.size // LINE
    states = np.array(SEEDS, np.uint64)
    if lines:
        args = np.array([payload.ctypes.data, states.ctypes.data], np.int64)
        _checksum_lines()(args.ctypes.data, 0, lines)
    return int(np.bitwise_xor.reduce(states)) ^ zlib.crc32(payload[lines * LINE :])


def _header(key: bytes, payload: np.ndarray, about: dict[str, str]) -> bytes:
    fixed = _FIXED.pack(_MAGIC, FORMAT, payload.size, checksum(payload), key)
    text = json.dumps(about, sort_keys=True).encode()[: HEADER_BYTES - _FIXED.size - 8]
    body = fixed + struct.pack("<I", len(text)) + text
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(HEADER_BYTES, b"\0")


def _read(
    path: Path,
    key: bytes,
    nbytes: int,
    verify: bool = True,
    into: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray | None:
    """The payload of ``path`` mapped read-only (or read into ``into(nbytes)``), or
    ``None`` when the file is missing or does not hold ``nbytes`` of this ``key`` intact."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES or os.fstat(f.fileno()).st_size != HEADER_BYTES + nbytes:
                return None
            magic, fmt, size, check, stored = _FIXED.unpack_from(head)
            (n_text,) = struct.unpack_from("<I", head, _FIXED.size)
            end = _FIXED.size + 4 + n_text
            expected = (_MAGIC, FORMAT, nbytes, key)
            if end + 4 > HEADER_BYTES or (magic, fmt, size, stored) != expected:
                return None
            if struct.unpack_from("<I", head, end)[0] != zlib.crc32(head[:end]):
                return None
            if nbytes == 0:
                return np.empty(0, np.uint8)
            if into is None:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                payload = np.frombuffer(mapped, np.uint8, count=nbytes, offset=HEADER_BYTES)
            else:
                payload = into(nbytes)
                view, done = memoryview(payload), 0
                while done < nbytes:  # (one read returns at most ~2 GiB)
                    n = f.readinto(view[done:])
                    if not n:
                        return None
                    done += n
    except (OSError, ValueError, struct.error):
        return None
    if verify and checksum(payload) != check:
        return None
    return payload


class RepackCache:
    """The on-disk cache of one process: ``load_or_build`` per weight, and counts of what
    it did (``hits``: mapped from disk, ``misses``: built, ``written``: of those, stored)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.hits = self.misses = self.written = 0
        self._total: int | None = None  # bytes in the directory, once scanned
        self._used: set[str] = set()  # files this process read or wrote: never evicted by it

    def load_or_build(
        self,
        source: tuple[str, str],
        layout: str,
        nbytes: int,
        build: Callable[[], np.ndarray],
        into: Callable[[int], np.ndarray] | None = None,
    ) -> tuple[np.ndarray, bool]:
        """The repacked weight: mapped from the cache, or ``build()`` (uint8, ``nbytes``)
        then stored. ``source``: (where the GGUF bytes lie: path and byte ranges; the GGUF
        file's identity: its stat), ``layout``: type, shape and layout of the result;
        ``into(nbytes)``: memory to hold the weight instead of the file's map (the cache's
        copy is read, or the built one copied, into it). Returns the weight and whether it
        was built."""
        if self.directory is None:
            self.misses += 1
            return placed(build(), into), True
        where, identity = source
        name = hashlib.sha256(f"{where}\0{layout}".encode()).hexdigest()[:40]
        path = self.directory / f"{name}.bin"
        key = hashlib.sha256(f"{where}\0{layout}\0{identity}\0{code_version()}".encode()).digest()
        found = _read(path, key, nbytes, into=into)
        if found is not None:
            self.hits += 1
            self._used.add(str(path))
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: evicted last
            return found, False
        self.misses += 1
        built = build()
        if built.dtype != np.uint8 or built.size != nbytes:
            raise ValueError(f"repacked {built.dtype} {built.size} bytes, expected {nbytes}")
        about = {"source": where, "identity": identity, "layout": layout}
        if into is not None:
            self._store(path, key, built, about)
            return placed(built, into), True
        if self._store(path, key, built, about):
            # The stored copy's pages are the page cache's: map it and let the anonymous
            # copy go (so a first load's resident set does not hold every repacked weight).
            mapped = _read(path, key, nbytes, verify=False)
            if mapped is not None:
                return mapped, True
        return built, True

    def _store(self, path: Path, key: bytes, payload: np.ndarray, about: dict[str, str]) -> bool:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            with os.fdopen(fd, "wb") as f:
                f.write(_header(key, payload, about))
                f.write(memoryview(payload))
            os.replace(tmp, path)
        except OSError:  # read-only or full: the weight stays in memory
            if tmp is not None:
                _unlink(tmp)
            return False
        self.written += 1
        self._used.add(str(path))
        self._evict(HEADER_BYTES + payload.size)
        return True

    def _evict(self, added: int) -> None:
        """Delete least recently used files while the directory holds over ``max_bytes()``
        (scanned once per process, then counted as files are added), except those this
        process used: a model whose weights alone pass the cap (gpt-oss-20b's experts,
        ~12 GB) would otherwise evict its own earlier entries as it writes later ones, and
        repack them again on every start."""
        if self._total is not None:
            self._total += added
            if self._total <= max_bytes():
                return
        entries, now = [], time.time()
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.startswith(".tmp-"):
                if now - st.st_mtime > _STALE_TMP_SECONDS:
                    _unlink(entry.path)
            elif entry.name.endswith(".bin"):
                entries.append((st.st_mtime, st.st_size, entry.path))
        self._total = sum(size for _, size, _ in entries)
        for _, size, file in sorted(entries):
            if self._total <= max_bytes():
                break
            if file not in self._used and _unlink(file):
                self._total -= size


def placed(weight: np.ndarray, into: Callable[[int], np.ndarray] | None) -> np.ndarray:
    """``weight`` copied into ``into(its size)`` (``None``: itself)."""
    if into is None:
        return weight
    out = into(weight.size)
    out[:] = weight
    return out


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


_shared: RepackCache | None = None


def shared() -> RepackCache:
    """The process's cache, in the directory ``$DYNALM_REPACK_CACHE`` / ``$DYNALM_CACHE``
    name now (a new one, its counts at zero, when that changed)."""
    global _shared
    directory = cache_dir()
    if _shared is None or _shared.directory != directory:
        _shared = RepackCache(directory)
    return _shared
