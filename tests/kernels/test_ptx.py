"""The GPU preview without a GPU: every kernel the device needs lowers to PTX that LLVM
verifies and the structural checker (``kernel.ptx_check``) parses; the checker rejects
broken PTX; the element-wise programs compile to SPIR-V with their entry points; and the
grid mapping (each thread's row range, the element-wise per-thread argument block) is run
on this CPU -- the same entry kernels built for the host with a simulated thread index,
over every thread of a grid -- against the CPU kernels, bitwise.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_matmul import activations, weights

from dynalm.core import elementwise
from dynalm.core.matmul import QuantMatmul
from dynalm.kernel import backends, nvptx, ptx_check, spirv
from dynalm.kernel import elementwise_programs as ew_programs
from dynalm.kernel import sampling_program as sampling
from dynalm.kernel.backends import MMA_ROWS, WARP
from dynalm.kernel.matmul_programs import MATMUL, PAIR, UNPACKS, MatmulKernels, effective_mode
from dynalm.kernel.pool_program import POOL
from tolerances import U, sum_bound

KERNELS = nvptx.device_kernels()


def _id(item: tuple) -> str:
    program, spec = item
    return f"{program.name}-" + "-".join(str(v) for v in spec.values())


@pytest.mark.parametrize("item", KERNELS, ids=[_id(i) for i in KERNELS])
def test_kernel_lowers_to_valid_ptx(item: tuple) -> None:
    program, spec = item
    lowered = nvptx.NVPTX.lower(program, spec)  # LLVM verifies the IR before and after
    summary = ptx_check.check(lowered.ptx)
    assert (summary.version, summary.target, summary.address_size) == ("7.5", "sm_80", 64)
    assert sorted(summary.entries) == sorted(e.name for e in lowered.entries.values())
    assert all(f.kind == "entry" for f in summary.functions)  # the bodies were inlined
    opcodes = {op for f in summary.functions for op in f.opcodes}
    if program.name == "mm" and spec.get("mode") == "auto":
        mma = spec["mr"] == MMA_ROWS  # the prefill tile: tensor cores, else dp4a
        dot = "mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32" if mma else "dp4a"
        assert any(op.startswith(dot) for op in opcodes), dot
        assert ("bar.warp.sync" in opcodes) == mma
    assert not any(op.startswith(("call", "prefetch")) for op in opcodes)


def test_every_format_and_mode_is_covered() -> None:
    seen = {(s["ggml_type"], s["mode"]) for p, s in KERNELS if p.name == "mm" and "mode" in s}
    assert seen == {(t, effective_mode(t, m)) for t in UNPACKS for m in ("exact", "auto")}


def test_pool_programs_are_cpu_only() -> None:
    with pytest.raises(ValueError, match="pool.*CPU-only"):
        nvptx.NVPTX.module(POOL, {"machine": "x86_64"})
    with pytest.raises(ValueError, match="mm_pair.*CPU-only"):
        nvptx.NVPTX.module(PAIR, {})


@pytest.fixture(scope="module")
def small_ptx() -> str:
    return nvptx.NVPTX.lower(ew_programs.PROGRAMS["rms_norm"], {"width": 64, "eps": 1e-5}).ptx


def _replace_first(pattern: str, repl: str) -> callable:
    return lambda ptx: re.sub(pattern, repl, ptx, count=1, flags=re.M)


MUTATIONS = {
    "no .version": (_replace_first(r"^\.version .*$", ""), "expected .version"),
    "bad .target": (_replace_first(r"^\.target sm_80", ".target gfx90a"), "expected .target"),
    "missing ';'": (_replace_first(r"(\tmul\.rn\.f32[^;]*);", r"\1"), "does not end in ';'"),
    "unknown opcode": (_replace_first(r"\tmul\.rn\.f32", "\tmulx.rn.f32"), "unknown opcode"),
    "undeclared register": (_replace_first(r"^\s*\.reg \.b32 .*$", ""), "used before a .reg"),
    "register out of range": (
        _replace_first(r"\.reg \.b32 \t%r<\d+>", ".reg .b32 \t%r<3>"),
        "outside %r<3>",
    ),
    "unbalanced braces": (lambda p: p.rstrip().removesuffix("}"), "unbalanced braces"),
    "undefined label": (
        _replace_first(r"bra(\.uni)? \t\$L__BB0_\d+", "bra \t$L__nowhere"),
        "undefined label",
    ),
    "undeclared parameter": (_replace_first(r"_param_0\]", "_param_9]"), "undeclared"),
    "bad parameter": (_replace_first(r"\.param \.u64 ", ".param .u65 "), "malformed parameter"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_checker_rejects_broken_ptx(small_ptx: str, name: str) -> None:
    mutate, message = MUTATIONS[name]
    broken = mutate(small_ptx)
    assert broken != small_ptx, f"mutation {name!r} changed nothing"
    with pytest.raises(ptx_check.PtxError, match=re.escape(message)):
        ptx_check.check(broken)


SPIRV_KERNELS = [(p, s) for p, s in KERNELS if p.name in spirv.PROGRAMS]


@pytest.mark.parametrize("item", SPIRV_KERNELS, ids=[_id(i) for i in SPIRV_KERNELS])
def test_elementwise_compiles_to_spirv(item: tuple) -> None:
    program, spec = item
    module = spirv.lower(program, spec)
    assert int.from_bytes(module.binary[:4], "little") == spirv.MAGIC
    assert sorted(spirv.entry_points(module.binary)) == sorted(module.entries.values())


def test_spirv_reader_rejects_other_binaries() -> None:
    with pytest.raises(ValueError, match="magic number"):
        spirv.entry_points(b"\x7fELF" + bytes(60))
    broken = bytearray(spirv.lower(ew_programs.PROGRAMS["add"], {}).binary)
    broken[22:24] = b"\xff\xff"  # the first instruction's word count: past the end
    with pytest.raises(ValueError, match="runs past the end"):
        spirv.entry_points(bytes(broken))


# -- the grid mapping, run on this CPU ---------------------------------------------------
def run_grid(entry: nvptx.HostEntry, args: int, rows: int) -> None:
    """Every thread of a launch over ``rows`` in blocks of 4 threads (the last ones past
    the end), through the NVPTX backend's host twin."""
    entry.launch(args, rows, entry.entry.grid(rows, 4))


@pytest.mark.parametrize(
    ("ggml_type", "mode", "t_rows"),
    [(T.Q4_1, "auto", 1), (T.Q4_1, "auto", 5), (T.Q4_1, "exact", 1), (T.Q8_0, "auto", 3),
     (T.Q4_K, "auto", 1), (T.Q6_K, "exact", 4), (T.IQ4_NL, "auto", 5), (T.IQ4_XS, "exact", 1),
     (T.MXFP4, "auto", 1)],
    ids=str,
)  # fmt: skip
def test_grid_matmul_is_the_cpu_kernel(ggml_type: T, mode: str, t_rows: int) -> None:
    """The device's lowering of a matmul, with the grid's row split, computes bitwise what
    the CPU's generic backend does (same width, same integer sums, same float order)."""
    k, n = 256, 67
    raw, x = weights(ggml_type, n, k), activations(t_rows, k)
    want = QuantMatmul(raw, ggml_type, k, mode=mode, backend=backends.GENERIC, threads=1)(x)
    qm = QuantMatmul(raw, ggml_type, k, mode=mode, backend=nvptx.NVPTX.twin(), threads=1)
    out = np.full((t_rows, n), np.nan, np.float32)
    for which, args, total in qm.kernel_calls(x, out):
        spec = qm._kernels.specs[which]
        run_grid(nvptx.host_twin(MATMUL, spec)[""], args, total)
    np.testing.assert_array_equal(out, want)


def test_twin_mma_is_the_ptx_isa_fragment_product() -> None:
    """``mma_s8u8`` on the twin, each lane's fragments loaded as the PTX ISA lays them out
    for m16n8k16 integer mma (lane l: g = l >> 2, q = l & 3; a0 = A[g][4q..], a1 =
    A[g+8][4q..], b = B[4q..][g]; C/D [g][2q], [g][2q+1], [g+8][2q], [g+8][2q+1]), the
    lanes run one after another: D = A @ B + C in int32, exactly (bytes at their extremes)."""
    from dynalm.kernel import jit
    from dynalm.kernel.lang import I32, I64, PTR, Module

    twin = nvptx.NVPTX.twin()
    module = Module("mma_check", twin, jit.triple())
    k = module.kernel("mma_check", (PTR, PTR, PTR, PTR, I64))
    a, bt, c, d, lane = k.args
    g, q = k.lshr(lane, 2), k.and_(lane, 3)

    def fragment(lane):  # A row-major 16 x 16, B as its transpose 8 x 16 (col layout)
        g_l, q_l = k.lshr(lane, 2), k.and_(lane, 3)
        at = [k.add(k.mul(k.add(g_l, 8 * h), 16), k.mul(q_l, 4)) for h in (0, 1)]
        b = k.load(I32, bt, k.add(k.mul(g_l, 16), k.mul(q_l, 4)))
        return k.load(I32, a, at[0]), k.load(I32, a, at[1]), b

    cells = [(k.add(g, 8 * (e // 2)), k.add(k.shl(q, 1), e % 2)) for e in range(4)]
    offsets = [k.mul(k.add(k.mul(r, 8), col), 4) for r, col in cells]
    out = twin.mma_s8u8(k, lane, fragment, [k.load(I32, c, at) for at in offsets])
    for value, at in zip(out, offsets, strict=True):
        k.store(value, d, at)
    k.ret()
    addresses, _ = jit.compile_module(module.text(), module.names)
    fn = jit.cfunc(addresses["mma_check"], None, *([ctypes.c_void_p] * 4), ctypes.c_int64)
    rng = np.random.default_rng(16)
    am = rng.integers(-128, 128, (16, 16)).astype(np.int8)
    bm = rng.integers(0, 256, (16, 8)).astype(np.uint8)
    am[0], bm[:, 0] = -128, 255  # the largest products
    cm = rng.integers(-(2**20), 2**20, (16, 8)).astype(np.int32)
    dm = np.zeros((16, 8), np.int32)
    bt_m = np.ascontiguousarray(bm.T)
    for lane in range(WARP):
        fn(am.ctypes.data, bt_m.ctypes.data, cm.ctypes.data, dm.ctypes.data, lane)
    want = am.astype(np.int64) @ bm.astype(np.int64) + cm
    np.testing.assert_array_equal(dm, want)


@pytest.mark.parametrize(
    ("ggml_type", "n", "k_blocks", "t_rows"),
    [(T.Q4_1, 67, 8, 21), (T.Q8_0, 13, 1, 16), (T.Q4_K, 20, 8, 37), (T.Q6_K, 9, 16, 17),
     (T.Q5_0, 8, 3, 47), (T.IQ4_XS, 11, 8, 16), (T.MXFP4, 8, 2, 19)],
    ids=str,
)  # fmt: skip
def test_grid_mma_matmul_is_the_cpu_kernel(ggml_type: T, n: int, k_blocks: int, t_rows: int):
    """The prefill tile of ``auto`` on the device (``MMA_ROWS`` rows and more): a warp's
    m16n8k16 int8 ``mma`` per key, on the host twin (each lane's D from the lanes whose
    fragments hold its rows and columns, the warp's lanes one after another, blocks of
    whole warps). Tokens not a multiple of 16, N not a multiple of 8, K of 1 to 16 blocks,
    formats with one and two sub-blocks a block: bitwise the CPU generic backend's y."""
    k = 32 * k_blocks
    raw, x = weights(ggml_type, n, k), activations(t_rows, k)
    want = QuantMatmul(raw, ggml_type, k, mode="auto", backend=backends.GENERIC, threads=1)(x)
    qm = QuantMatmul(raw, ggml_type, k, mode="auto", backend=nvptx.NVPTX.twin(), threads=1)
    out = np.full((t_rows, n), np.nan, np.float32)
    calls = qm.kernel_calls(x, out)
    assert [qm._kernels.specs[which]["mr"] for which, _, _ in calls[1:]] == [MMA_ROWS]
    for which, args, total in calls:
        entry = nvptx.host_twin(MATMUL, qm._kernels.specs[which])[""]
        assert entry.entry.width == (WARP if which != qm._kernels.quantize else 1)
        run_grid(entry, args, total)
    np.testing.assert_array_equal(out, want)


def test_mma_tile_is_chosen_from_16_rows_on_the_device_only() -> None:
    """The choice is ``MatmulKernels.tile_for``: dp4a below 16 rows, the warps' mma from
    16; CPU backends have no warp tile, and a warp tile refuses a CPU call by name."""
    device = MatmulKernels(T.Q4_1, "auto", nvptx.NVPTX, 256)
    mrs = {t: device.specs[device.tile_for(t)]["mr"] for t in (1, 4, 15, 16, 17, 512)}
    assert mrs == {1: 1, 4: 4, 15: 4, 16: MMA_ROWS, 17: MMA_ROWS, 512: MMA_ROWS}
    grid = nvptx.NVPTX.lower(MATMUL, device.specs[device.tile_for(16)]).entries[""].grid
    assert grid(67) == (3, 128) and grid(8) == (1, 32)  # a warp per 8 weight rows
    cpu = MatmulKernels(T.Q4_1, "auto", backends.GENERIC, 256)
    assert all(s.get("mr") != MMA_ROWS for s in cpu.specs)
    with pytest.raises(ValueError, match="warp-cooperative"):
        MatmulKernels(T.Q4_1, "auto", nvptx.NVPTX.twin(), 256).call(device.tile_for(16))


def test_grid_elementwise_is_the_cpu_kernel() -> None:
    """Each thread's own argument block (count and arrays advanced by its first row)."""
    rng = np.random.default_rng(7)
    rows, heads, head_dim = 7, 3, 16
    x = rng.standard_normal((rows, 80)).astype(np.float32)  # a wider buffer: strided rows
    dense = np.ascontiguousarray(x[:, :48])
    w = rng.standard_normal(48).astype(np.float32)
    pos = rng.integers(0, 20, rows).astype(np.int64)
    ang = rng.uniform(0, 6, (20, head_dim // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cases = {
        "rms_norm": lambda out, be: elementwise.rms_norm(out, dense, w, 1e-5, backend=be),
        "rope": lambda out, be: elementwise.rope(
            out, x[:, :48], pos, cos, sin, head_dim, head_dim, False, backend=be
        ),
        "gated": lambda out, be: elementwise.gated(
            out, np.ascontiguousarray(x[:, :48]), np.ascontiguousarray(x[:, 8:56]), "silu",
            backend=be,
        ),
        "mul": lambda out, be: elementwise.mul(out, dense, dense[::-1].copy(), backend=be),
        "scale": lambda out, be: elementwise.scale(out, dense, 0.1, backend=be),
        "act": lambda out, be: elementwise.activation(out, dense, "gelu_tanh", backend=be),
        "tanh": lambda out, be: elementwise.activation(out, dense, "tanh", backend=be),
        "bias": lambda out, be: elementwise.bias(out, dense, w, backend=be),
        "columns": lambda out, be: elementwise.columns(out, x, 29, backend=be),  # a split
        "gather": lambda out, be: elementwise.columns(out, x, 0, perm, backend=be),
        "rows": lambda out, be: elementwise.rows(out, x[:, 8:56], ids, backend=be),
    }  # fmt: skip
    ids = rng.integers(0, rows, rows).astype(np.int64)
    perm = rng.permutation(80)[:48].astype(np.int32)
    for kind, bind in cases.items():
        want = np.empty((rows, heads * head_dim), np.float32)
        bind(want, backends.GENERIC)()
        got = np.full_like(want, np.nan)
        bound = bind(got, nvptx.NVPTX.twin())
        program = bound.request[1]
        entry = nvptx.host_twin(program, bound._params)[program.name.removeprefix("ew_")]
        run_grid(entry, bound.block.ctypes.data, int(bound.block[0]))
        np.testing.assert_array_equal(got, want, err_msg=kind)
    np.testing.assert_array_equal(got, x[ids, 8:56])  # the row gather is x[index]


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_grid_attention_write_is_a_thread_per_row(dtype: str) -> None:
    """The device stores a step's keys and values with ``write_rows``, one thread per
    (token, kv head) row (here in blocks of 4 threads, rows of one token on different
    threads): the pages hold bitwise what ``PagePool.write`` stores, and nothing else."""
    from test_attention import HEAD_DIM, HEADS, KV_HEADS, ragged_step

    from dynalm.core.attention import PagedAttention, StepLayout
    from dynalm.kernel.attention_program import ATTENTION

    seqs = [([0, 1], 20, 3), ([2], 9, 1), ([3, 4], 17, 17)]  # a chunk past a page edge
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs, seed=5)
    ref, *_ = ragged_step(dtype, seqs, seed=5)
    n = len(batch.slots)
    shape = (n, KV_HEADS, HEAD_DIM)
    ref.storage.write(0, batch.slots, k.reshape(shape), v.reshape(shape))
    step = StepLayout()
    step.set(batch, positions)
    out = np.empty((n, HEADS * HEAD_DIM), np.float32)
    att = PagedAttention(step, 0, HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 1, out, q, k, v)
    args = att.records()[0][2]  # binds the pages: the layer's argument block
    spec = {"dtype": dtype, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    spec |= {"page": pool.page_size, "recent": pool.storage.recent, "softcap": 0.0}
    entry = nvptx.host_twin(ATTENTION, spec)["write_rows"]
    assert entry.entry.chunk == 1  # a thread per row
    run_grid(entry, args, n * KV_HEADS)
    stores = ("k", "v", "k_scale", "v_scale")
    for name in stores if dtype == "q8_0" else stores[:2]:
        got, want = getattr(pool.storage, name)[0], getattr(ref.storage, name)[0]
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_grid_split_k_attention_is_the_cpu_kernel(dtype: str) -> None:
    """The device's split-K attention: ``parts`` on a thread per (item, chunk) of a pool's
    longest context, threads past an item's chunks idle, then ``merge`` a thread per item.
    Its outputs are bitwise the CPU generic backend's at contexts of 600, 257 and 256 keys
    (3, 2 and 1 chunks), whichever schedule the CPU ran."""
    from test_attention import HEAD_DIM, HEADS, KV_HEADS, LONG, attend, ragged_step

    from dynalm.core.attention import PagedAttention, StepLayout
    from dynalm.kernel.attention_program import A_SLICES, ATTENTION, N_ARGS, chunks, parts_bytes

    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0)
    _, batch, positions, q, k, v = ragged_step(dtype, LONG, seed=2, n_pages=72)
    want = attend(batch, positions, q, k, v, *geometry, 1, backend=backends.GENERIC)
    pool, batch, *_ = ragged_step(dtype, LONG, seed=2, n_pages=72)
    step = StepLayout()
    step.set(batch, positions)
    out = np.full_like(want, np.nan)
    att = PagedAttention(step, 0, *geometry, 1, out, q, k, v, backend=backends.GENERIC)
    args = att.records()[0][2]  # binds the pages: the layer's argument block
    block = np.ctypeslib.as_array((ctypes.c_int64 * N_ARGS).from_address(args))
    capacity = pool.storage.geometry.slot_shape[0]
    slices = block[A_SLICES] = chunks(capacity)  # 72 pages of 16: 5 chunks
    items = len(LONG) * HEADS // 3  # 3 query heads an item
    step.reserve(parts_bytes(items, capacity, HEADS, KV_HEADS, HEAD_DIM))
    spec = {"dtype": dtype, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    spec |= {"page": pool.page_size, "recent": pool.storage.recent, "softcap": 0.0}
    entries = nvptx.host_twin(ATTENTION, spec)
    run_grid(entries["write_rows"], args, len(LONG) * KV_HEADS)
    run_grid(entries["parts"], args, items * slices)
    run_grid(entries["merge"], args, items)
    if pool.storage.recent:
        run_grid(entries["write_recent"], args, 1)
    np.testing.assert_array_equal(out, want)


def test_greedy_argmax_on_the_grid() -> None:
    """``ARGMAX`` (a thread per ``ARGMAX_CHUNK`` logits, then a pick per row) gives each
    row's first argmax, ``np.argmax``'s, across a chunk edge and in a tie between chunks;
    -1 for a row with a NaN or only -inf (which the host's greedy sampler refuses)."""
    rng = np.random.default_rng(1)
    rows, vocab = 6, 2500  # 3 chunks, the last partial
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[1, [3, 1500]] = 60.0  # a tie across chunks: the first
    x[2, 7] = np.nan
    x[3, :] = -np.inf
    x[4, [2047, 2048]] = 70.0  # a tie across the chunk edge
    x[5, 2499] = 80.0  # the last logit
    chunks = sampling.argmax_chunks(vocab)
    part_max, part_arg = np.zeros(rows * chunks, np.float32), np.zeros(rows * chunks, np.int64)
    tokens = np.zeros(rows, np.int64)
    args = np.array([a.ctypes.data for a in (x, part_max, part_arg, tokens)], np.int64)
    entries = nvptx.host_twin(sampling.ARGMAX, {"vocab": vocab})
    run_grid(entries["parts"], args.ctypes.data, rows * chunks)
    run_grid(entries["pick"], args.ctypes.data, rows)
    np.testing.assert_array_equal(tokens, sampling.argmax_reference(x))
    np.testing.assert_array_equal(tokens, [x[0].argmax(), 3, -1, -1, 2047, 2499])


def test_sampling_reduction() -> None:
    """Per row: max and first argmax exactly, sum(exp(x - max)) within its rounding; run
    through the grid mapping, and on the CPU's generic backend."""
    rng = np.random.default_rng(3)
    rows, vocab = 6, 1003
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[1, [5, 900]] = 50.0  # a tie: the first index wins
    logits[2, 17] = np.nan  # skipped by the max
    m_ref, arg_ref, s_ref = sampling.reference(logits)
    spec = {"vocab": vocab}
    for run in ("grid", "cpu"):
        outs = [np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.zeros(rows, np.float32)]
        args = np.array([a.ctypes.data for a in (logits, *outs)], np.int64)
        if run == "grid":
            run_grid(nvptx.host_twin(sampling.ROW_REDUCE, spec)[""], args.ctypes.data, rows)
        else:
            done = backends.GENERIC.lower(sampling.ROW_REDUCE, spec)
            fn = done.cfunc("", ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
            fn(args.ctypes.data, 0, rows)
        top, arg, total = outs
        np.testing.assert_array_equal(top, m_ref)
        np.testing.assert_array_equal(arg, arg_ref)
        assert arg[1] == 5
        # rows with a NaN sum to NaN (exp(NaN)); in the others each term e^d is off by the
        # rounding of d = x - max (|d| u relative) and exp's own error (a few ulp: 4 u),
        # and the sum adds an fp32 sum's rounding
        finite = ~np.isnan(logits).any(axis=1)
        d = logits[finite].astype(np.float64) - m_ref[finite, None]
        terms = (np.exp(d) * (4 + np.abs(d)) * U).sum(axis=1)
        bound = sum_bound(vocab, s_ref[finite]) + terms
        assert (np.abs(total[finite] - s_ref[finite]) <= bound).all(), run
