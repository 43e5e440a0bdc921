"""The JIT's concurrent compile (``jit.compile_modules`` under ``backends.lower_all``):
the same object code as one module at a time, errors raised on the caller, no thread
alive afterwards (a thread alive at fork() hangs the forked workers of the GGUF fuzzer),
and kernels still lowered only for the step that first calls them.

Kernels here are specialised on shapes no other test uses (K = 224, odd widths), on a
backend instance of their own, with an empty disk cache: each one is really compiled.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_elementwise import rand, rms_norm_rtol
from test_matmul import activations, check, weights

from dynalm.core import cpu_ops, elementwise
from dynalm.core.matmul import QuantMatmul
from dynalm.kernel import backends, jit
from dynalm.kernel import matmul_programs as mm_programs

# A prefill batch that one GEMM tile covers on every backend (a multiple of each tile's
# rows: 3, 4, 8, 16), with no ragged rest on a second tile.
PREFILL = 48


def fresh_backend() -> backends.Backend:
    """The selected backend with nothing lowered: its kernels are compiled anew."""
    return dataclasses.replace(backends.select(), _lowered={})


def requests(backend: backends.Backend, k: int, width: int) -> list[backends.Request]:
    """Kernels of unlike sizes (a GEMM tile's IR is ~15x a quantiser's): a Q4_1 matmul's
    GEMV, GEMM tile and quantiser for ``k`` columns, an RMSNorm of rows of ``width``."""
    mm = mm_programs.MatmulKernels(T.Q4_1, "auto", backend, k)
    which = [mm.tile_for(1), mm.tile_for(PREFILL), mm.quantize]
    rms_norm = elementwise.programs.PROGRAMS["rms_norm"]
    rms = [(backend, rms_norm, {"width": width, "eps": float(np.float32(3e-6))})]
    return [r for w in which for r in mm.pending(w)] + rms


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNALM_CACHE", str(tmp_path))
    return tmp_path / "jit"


@pytest.mark.slow  # compiles from an empty cache, twice
def test_concurrent_compile_is_serial_compile(empty_cache, monkeypatch):
    """Two threads compile at once (a barrier that only two concurrent compiles pass),
    none is left afterwards, and every object is byte for byte what one thread makes."""
    monkeypatch.setattr(jit, "_cpus", lambda: 2)
    emit, seen, lock = jit._emit_object, [], threading.Lock()
    together = threading.Barrier(2, timeout=60)

    def overlapping(ir: str, tm: object) -> tuple[bytes, float]:
        with lock:
            seen.append(threading.current_thread().name)
            first_two = len(seen) <= 2
        if first_two:
            together.wait()
        return emit(ir, tm)

    monkeypatch.setattr(jit, "_emit_object", overlapping)
    backend = fresh_backend()
    wanted = requests(backend, 224, 41)
    threads = threading.active_count()
    done = backends.lower_all(wanted)
    assert threading.active_count() == threads
    assert len(seen) == len(wanted) and len(set(seen)) == 2
    assert all(e.compile_seconds > 0 for e in done)
    # lowering again hands out the same executables (addresses), compiling nothing
    assert all(backend.lower(p, s) is e for (_, p, s), e in zip(wanted, done, strict=True))
    assert len(seen) == len(wanted)
    serial = jit._new_target_machine(backend.host_off)
    objects = sorted(empty_cache.glob("*.o"))
    assert len(objects) == len(wanted)
    for obj in objects:
        assert emit(obj.with_suffix(".ll").read_text(), serial)[0] == obj.read_bytes(), obj


def test_concurrently_compiled_kernels_compute(empty_cache, monkeypatch):
    """The kernels lowered together run right: a matmul of each batch bucket against
    the numpy reference, an RMSNorm against cpu_ops."""
    monkeypatch.setattr(jit, "_cpus", lambda: 2)
    backend = fresh_backend()
    backends.lower_all(requests(backend, 160, 39))
    assert len(list(empty_cache.glob("*.o"))) == 4
    raw = weights(T.Q4_1, 67, 160)
    mm = QuantMatmul(raw, T.Q4_1, 160, mode="auto", backend=backend, threads=1)
    assert mm.pending(1) == mm.pending(PREFILL) == []  # lowered above, nothing left to compile
    for t_rows in (1, PREFILL):
        x = activations(t_rows, 160)
        check(mm(x), raw, T.Q4_1, x, "auto")
    x, w = rand(3, 39, seed=3), rand(39, seed=4)
    out, expected = np.empty_like(x), np.empty_like(x)
    elementwise.rms_norm(out, x, w, 3e-6, backend=backend)()
    cpu_ops.rms_norm(expected, x, w, 3e-6)
    np.testing.assert_allclose(out, expected, rtol=rms_norm_rtol(39), atol=0)
    assert len(list(empty_cache.glob("*.o"))) == 4  # all compiled by lower_all


def test_compile_error_reaches_the_caller(empty_cache, monkeypatch):
    """A module LLVM rejects fails the call on the calling thread; the helper is joined."""
    monkeypatch.setattr(jit, "_cpus", lambda: 2)
    backend = fresh_backend()
    _, program, spec = requests(backend, 128, 47)[0]
    good = backend.module(program, spec)
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="expected"):
        jit.compile_modules(
            [(good.text(), [], ""), ("define void @dynalm_test_jit_bad( {", [], "")]
        )
    assert threading.active_count() == threads


@pytest.mark.parametrize("path", ["lower_all", "lower"])
def test_avx2_code_is_what_an_avx2_cpu_runs(empty_cache, path: str):
    """x86-avx2 compiles with the host's AVX-512 (and AVX-VNNI) off, whether its kernels
    are lowered together (``lower_all``, the matmuls) or one by one (``Backend.lower``):
    on any x86 host with AVX2 its object is what a TargetMachine without them makes, and
    its code names no zmm register, no ymm past 15 and no mask register, which only EVEX
    encodes: an AVX-512 host's x86-avx2 figures are an AVX2 CPU's, and its tests test that
    code."""
    if backends.AVX2.missing():
        pytest.skip(f"x86-avx2 cannot run here: lacks {', '.join(backends.AVX2.missing())}")
    backend = dataclasses.replace(backends.AVX2, _lowered={})
    # a K of its own: a module this process has loaded already (another test's) compiles
    # no object again
    mm = mm_programs.MatmulKernels(T.Q4_K, "auto", backend, 29 * 256)
    if path == "lower_all":  # the prefill tile
        (request,) = mm.pending(mm.tile_for(PREFILL))
        backends.lower_all([request])
    else:  # the GEMV (another module)
        request = mm.pending(mm.tile_for(1))[0]
        backend.lower(*request[1:])
    (obj,) = empty_cache.glob("*.o")
    ir = backend.module(*request[1:]).text()
    assert obj.read_bytes() == jit._emit_object(ir, jit._new_target_machine("-avx512f,-avxvnni"))[0]
    assembly = jit.assembly(ir, backend.host_off)
    assert "vpmaddubsw" in assembly
    assert not re.search(r"%zmm|%ymm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\{1to", assembly)


def test_kernels_lowered_when_a_step_first_needs_them(empty_cache):
    """A decode step (T = 1) lowers the GEMV and the quantiser, never a GEMM tile;
    binding an element-wise kernel compiles nothing until it first runs."""
    backend = fresh_backend()
    mm = QuantMatmul(weights(T.Q4_1, 67, 96), T.Q4_1, 96, mode="auto", backend=backend)
    assert len(mm.pending(1)) == 2 and len(mm.pending(PREFILL)) == 2
    mm(activations(1, 96))
    assert mm.pending(1) == [] and len(mm.pending(PREFILL)) == 1  # the GEMM tile is still to do
    assert len(list(empty_cache.glob("*.o"))) == 2
    x, w = rand(2, 41, seed=5), rand(41, seed=6)
    kernel = elementwise.rms_norm(np.empty_like(x), x, w, 5e-6, backend=backend)
    assert len(kernel.pending()) == 1 and len(list(empty_cache.glob("*.o"))) == 2
    kernel()
    assert kernel.pending() == [] and len(list(empty_cache.glob("*.o"))) == 3
