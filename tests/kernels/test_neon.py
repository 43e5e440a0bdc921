"""The AArch64 backends (aarch64-neon-dotprod, aarch64-neon) on this machine: kernels
cross-compiled to AArch64 objects (``kernel.cross``), linked into a C driver with
aarch64-linux-gnu-gcc and run under qemu-aarch64, one emulated process per backend for all
of its kernels (the dotprod one on a Neoverse-N1 model, plain NEON on a Cortex-A72, which
has no dotprod: an ``sdot`` there would be an illegal instruction).

Per backend: every matmul format x mode (exact and auto, the GEMV and the GEMM bucket's
tile) against the numpy reference of test_matmul, and ``auto`` bitwise equal to every
backend this host runs; the paged attention kernel (f32, f16, q8_0 pages) against the
numpy reference of test_attention, pages and outputs bitwise the host's; the pool's worker
loop (futex syscall 98, ``yield``) with two worker threads handing out a
chain of matmul jobs 20 times over, each output bitwise the single-threaded one.

Where qemu-aarch64 or the cross compiler is missing (``make test`` installs them as root:
Debian ``qemu-user gcc-aarch64-linux-gnu``) the tests are skipped saying so; on an
AArch64 host the backends run natively in test_matmul and test_attention instead.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_attention import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    assert_close,
    assert_same_pages,
    attend,
    attention_bound,
    ragged_step,
    tables,
)
from test_matmul import K_QUANTS, LEGACY, TABLES, N, activations, check, weights

from dynalm.core import cpu_ops
from dynalm.core.attention import PagedAttention, StepLayout
from dynalm.core.matmul import QuantMatmul
from dynalm.kernel import attention_program as attention
from dynalm.kernel import backends, cross, jit, layouts
from dynalm.kernel import matmul_programs as programs
from dynalm.kernel import pool_program as pool
from dynalm.kernel.cross import Arena, Harness, Ptr
from dynalm.kernel.formats import QK, UNPACKS

pytestmark = pytest.mark.slow  # cross-compiled, linked and run under qemu

K = 256  # every format's blocks fit (K-quants: 256 per super-block)
T_ROWS = (1, 5)  # the GEMV and the GEMM bucket (a ragged 4-row tile)
QEMU_CPU = {"aarch64-neon-dotprod": "neoverse-n1", "aarch64-neon": "cortex-a72"}
AARCH64 = [backends.NEON_DOTPROD, backends.NEON]
ATTENTION_SEQS = [([3, 7, 1], 40, 5), ([5, 9], 17, 1), ([2], 1, 1)]
GEOMETRY = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 5, 1)  # window 5, one thread
# Steps (KV dtype, sequences, geometry) by name: f32 pages with a window; f16 and q8_0
# pages without one and with a prompt of 13 tokens, so a tile of 8 (``tiles``; with q8_0
# its queries' recent f16 keys) besides 5 tokens alone; and those with MHA's heads (an item
# of one head: its keys' values unrolled).
TILED_SEQS = [([3, 7, 1], 40, 13), *ATTENTION_SEQS[1:]]
MHA = (4, 4, HEAD_DIM, 0.125, 0, 1)
ATTENTION_STEPS = {
    "f32": ("f32", ATTENTION_SEQS, GEOMETRY),
    **{dtype: (dtype, TILED_SEQS, (*GEOMETRY[:4], 0, 1)) for dtype in ("f16", "q8_0")},
    **{f"{dtype} MHA": (dtype, TILED_SEQS, MHA) for dtype in ("f16", "q8_0")},
}
POOL_REPEATS = 20


def _unavailable() -> str | None:
    if jit.host_machine() == "aarch64":
        return "AArch64 host: its backends run natively in test_matmul and test_attention"
    missing = cross.missing_tools()
    if missing:
        return (
            f"AArch64 kernels NOT run under emulation: this host lacks {', '.join(missing)} "
            f"(as root: apt-get install {' '.join(cross.PACKAGES)}, or run `make test`)"
        )
    return None


def _modes(ggml_type: T) -> list[str]:
    return sorted({programs.effective_mode(ggml_type, m) for m in ("exact", "auto")})


def _tile(backend: backends.Backend, ggml_type: T, mode: str, t_rows: int) -> int:
    return max(s.mr for s in programs.buckets(mode, backend, ggml_type) if s.mr <= t_rows)


@dataclass
class Run:
    """One backend's harness run: where each output lies in the arena afterwards."""

    image: bytes = b""
    matmul: dict = field(default_factory=dict)  # (type, mode, T) -> (y Ptr, x)
    attention: dict = field(default_factory=dict)  # dtype -> (out, ours pool, ref, bound, host)
    pool_outputs: list = field(default_factory=list)  # (y Ptr, type, mode)
    kernels: int = 0
    compile_seconds: float = 0.0
    qemu_seconds: float = 0.0


def _matmul_calls(h: Harness, b: backends.Backend, run: Run) -> dict:
    """Every format x mode x bucket; returns the argument blocks the pool test reuses."""
    arena, nb, reuse = h.arena, K // QK, {}
    for ggml_type in LEGACY + K_QUANTS + TABLES:
        raw = weights(ggml_type, N, K)
        for mode in _modes(ggml_type):
            u = UNPACKS[ggml_type]
            w = arena.put(layouts.repack(u, raw, K, programs.layout(mode, b.lanes)))
            spec = {"k_blocks": nb, "ggml_type": int(ggml_type), "mode": mode}
            for t_rows in T_ROWS:
                x = activations(t_rows, K)
                xp, y = arena.put(x), arena.alloc(t_rows * N * 4)
                mr = _tile(b, ggml_type, mode, t_rows)
                fn = h.add(b, programs.MATMUL, {**spec, "mr": mr})[""]
                if mode == "exact":
                    args = arena.words([w, xp, 0, 0, y, t_rows, nb, N, 0])
                    calls = [(fn, args, N)]
                else:
                    rows = t_rows + programs.ROW_OVERREAD
                    xq = arena.alloc(rows * K)
                    xd, xs = arena.alloc(rows * nb * 8), arena.alloc(rows * nb * 4)
                    xk = arena.alloc(rows * nb * 4 * programs.KEY_SUMS)
                    qargs = arena.words([0, xq, xd, xs, xp, t_rows, nb, 0, xk])
                    args = arena.words([w, xq, xd, xs, y, t_rows, nb, N, xk])
                    quantize = h.add(b, programs.MATMUL, {"k_blocks": nb})[""]
                    calls = [(quantize, qargs, t_rows), (fn, args, N)]
                for f, a, total in calls:
                    h.call(f, a, 0, total)
                run.matmul[ggml_type, mode, t_rows] = (y, x)
                reuse[ggml_type, mode, t_rows] = (calls, y)
    return reuse


# The argument words that are addresses (the rest are counts, strides, bits).
_ATTN_POINTERS = [
    attention.A_Q, attention.A_OUT, attention.A_K_NEW, attention.A_V_NEW, attention.A_K,
    attention.A_V, attention.A_KS, attention.A_VS, attention.A_KR, attention.A_VR,
]  # fmt: skip
_STEP_POINTERS = [
    attention.S_PAGES, attention.S_SEQ_OF, attention.S_POS, attention.S_SLOTS,
    attention.S_FIRST_ROW, attention.S_RECENT_ROW, attention.S_RECENT_FROM, attention.S_ORDER,
]  # fmt: skip


def _host_words(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address))


def _attention_calls(h: Harness, b: backends.Backend, run: Run) -> None:
    """The attention of one ragged step per KV dtype, its argument block as the host's
    ``PagedAttention`` fills it (bound to the host's generic kernel), every address in it
    moved to the arena."""
    arena = h.arena
    for name, (dtype, seqs, geometry) in ATTENTION_STEPS.items():
        heads, kv_heads, head_dim = geometry[:3]
        ref_pool, batch, positions, q, k, v = ragged_step(dtype, seqs, 0, *geometry[:3])
        ref = np.zeros_like(q)
        cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry[:-1])
        host = attend(batch, positions, q, k, v, *geometry, backend=backends.GENERIC)
        bound = attention_bound(ref_pool, *tables(batch), q, heads, head_dim, 0.125)
        ours, batch, *_ = ragged_step(dtype, seqs, 0, *geometry[:3])
        step = StepLayout()
        step.set(batch, positions)
        out = np.full_like(q, np.nan)
        att = PagedAttention(step, 0, *geometry, out, q, k, v, backend=backends.GENERIC)
        ((kind, _, args_at, *_),) = att.records()  # binds the pages: one PLAIN "run" call
        assert kind == pool.PLAIN
        kv = batch.kv
        stores = [kv.k, kv.v, kv.k_scale, kv.v_scale, kv.k_recent, kv.v_recent]
        for a in [q, k, v, out, positions, batch.slots, *batch.kernel_tables, step.order]:
            arena.mirror(a)
        for arrays in stores:
            if arrays:
                arena.mirror(arrays[0])
        words = _host_words(args_at, attention.N_ARGS)
        step_words = _host_words(words[attention.A_STEP], attention.N_STEP)
        for i in _STEP_POINTERS:
            step_words[i] = arena.translate(step_words[i], f"step word {i}")
        for i in _ATTN_POINTERS:
            if words[i]:
                words[i] = arena.translate(words[i], f"attention argument {i}")
        words[attention.A_STEP] = arena.words(step_words)
        spec = att._request(kv)[2]  # noqa: SLF001 - the same specialisation, for b
        h.call(h.add(b, attention.ATTENTION, spec)["run"], arena.words(words))
        run.attention[name] = (out, ours, ref_pool, ref, bound, host)


def _pool_calls(h: Harness, b: backends.Backend, run: Run, reuse: dict) -> None:
    """Two workers started on the pool's state, then ``program`` runs a Q4_1 auto and a
    Q8_0 exact matmul split over the pool, POOL_REPEATS times, each into fresh outputs."""
    arena = h.arena
    fns = h.add(b, pool.POOL, {"machine": "aarch64"})
    state = arena.alloc(pool.STATE_BYTES)
    h.threads(fns["worker"], 2, state)
    for _ in range(POOL_REPEATS):
        records: list[int | Ptr] = []
        fn_slots = []
        for ggml_type, mode, chunk in ((T.Q4_1, "auto", b.lanes), (T.Q8_0, "exact", 4)):
            calls, y = reuse[ggml_type, mode, 5]
            y_new = arena.alloc(5 * N * 4)
            for i, (f, a, total) in enumerate(calls):
                words = _arena_words(arena, a, programs.N_ARGS)
                if i == len(calls) - 1:  # the matmul (auto: after the quantiser)
                    words[programs.A_Y] = y_new
                fn_slots.append((len(records) + 1, f))
                split_chunk = chunk if total == N else 1
                records += [pool.SPLIT, 0, arena.words(words), total, split_chunk]
            run.pool_outputs.append((y_new, ggml_type, mode))
        at = arena.words(records)
        for slot, f in fn_slots:
            h.function_address(Ptr(at.offset + 8 * slot), f)
        h.call(fns["program"], state, at, len(records) // 5)


def _arena_words(arena: Arena, at: Ptr, n: int) -> list[int | Ptr]:
    """An argument block written earlier, its addresses as ``Ptr`` again."""
    raw = np.frombuffer(arena.image(), np.int64, n, at.offset)
    return [
        Ptr(int(w)) if at.offset + 8 * i in arena.relocations else int(w) for i, w in enumerate(raw)
    ]


@cache
def harness_run(name: str) -> Run:
    """All kernels of backend ``name`` in one emulated process."""
    b = next(x for x in AARCH64 if x.name == name)
    run, h = Run(), Harness(Arena())
    t0 = time.perf_counter()
    reuse = _matmul_calls(h, b, run)
    _attention_calls(h, b, run)
    _pool_calls(h, b, run, reuse)
    setup = time.perf_counter() - t0
    run.image, run.qemu_seconds = h.run(QEMU_CPU[name])
    h.arena.copy_back(run.image)
    run.kernels, run.compile_seconds = h.kernels, h.compile_seconds
    print(
        f"\n{name}: {h.kernels} kernels run under qemu-aarch64 -cpu {QEMU_CPU[name]} in "
        f"{run.qemu_seconds:.1f} s (cross-compiles {run.compile_seconds:.1f} s of LLVM time, "
        f"0 when cached; inputs and references {setup:.1f} s)"
    )
    return run


@pytest.fixture(params=AARCH64, ids=lambda b: b.name)
def emulated(request: pytest.FixtureRequest) -> tuple[backends.Backend, Run]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    return request.param, harness_run(request.param.name)


HOST_BACKENDS = [b for b in backends.BACKENDS if not b.missing()]


def test_matmuls_match_reference_and_auto_is_bitwise_the_hosts(emulated) -> None:
    b, run = emulated
    for ggml_type in LEGACY + K_QUANTS + TABLES:
        raw = weights(ggml_type, N, K)
        for mode in _modes(ggml_type):
            for t_rows in T_ROWS:
                at, x = run.matmul[ggml_type, mode, t_rows]
                y = cross.read(run.image, at, np.float32, (t_rows, N))
                check(y, raw, ggml_type, x, mode)
                if mode == "auto":
                    for host in HOST_BACKENDS:
                        expected = QuantMatmul(raw, ggml_type, K, mode="auto", backend=host)(x)
                        what = f"{ggml_type.name} T={t_rows}: {b.name} vs {host.name}"
                        assert np.array_equal(y, expected), what


def test_attention_matches_numpy_and_the_host(emulated) -> None:
    _, run = emulated
    for name in ATTENTION_STEPS:
        out, ours, ref_pool, ref, bound, host = run.attention[name]
        assert_close(out, ref, bound)
        assert_same_pages(ours, ref_pool)  # the step's k/v stored as PagePool.write does
        # The program's float order is the same on every target (``halving_sum``, explicit
        # FMAs): every step gives the host's bits.
        assert np.array_equal(out, host), name


def test_pool_workers_hand_out_jobs(emulated) -> None:
    _, run = emulated
    assert len(run.pool_outputs) == 2 * POOL_REPEATS
    for at, ggml_type, mode in run.pool_outputs:
        expected = cross.read(run.image, run.matmul[ggml_type, mode, 5][0], np.float32, (5, N))
        assert np.array_equal(cross.read(run.image, at, np.float32, (5, N)), expected)


def test_dotprod_backend_uses_sdot_and_plain_neon_does_not() -> None:
    """The instructions each backend's auto kernel is made of (assembly of the objects'
    IR for their CPUs; runs without the emulator)."""
    import llvmlite.binding as llvm

    spec = {"k_blocks": 8, "ggml_type": int(T.Q8_0), "mode": "auto", "mr": 1}
    for b, has_sdot in ((backends.NEON_DOTPROD, True), (backends.NEON, False)):
        tm = cross._target_machine(b.triple(), b.cross_cpu, b.cross_features)  # noqa: SLF001
        asm = tm.emit_assembly(llvm.parse_assembly(b.module(programs.MATMUL, spec).text()))
        assert ("\tsdot\t" in asm) == has_sdot, b.name
    if jit.host_machine() != "aarch64":  # the host's JIT refuses foreign code
        with pytest.raises(backends.BackendUnavailable, match="cannot run on this x86_64"):
            backends.NEON.lower(programs.MATMUL, spec)
