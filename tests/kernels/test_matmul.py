"""QuantMatmul against the numpy reference: dequantise (dynalm.core.quant), fp64 matmul.

Every kernel backend (``dynalm.kernel.backends``) is checked: natively where this CPU has
its instructions (a test per backend not runnable here is skipped naming the missing
features), and always through its portable twin (same program and width, plain integer
IR), so AVX-512 numerics are tested on an AVX2-only host too. ``auto`` kernels of every
backend and twin give bitwise the same output (exact integer sums, same float order).

Every supported format x mode x path (GEMV T=1, small batches, prefill-sized T) on shapes
whose N is not a multiple of any tile. Legacy formats and MXFP4 quantise random weights
with gguf; K-quants and IQ4_NL / IQ4_XS (which gguf cannot quantise) are random valid
blocks. Budgets: ``exact``, every
output within the rounding of an fp32 sum of its K products (`tolerances.sum_bound`);
``auto``, rms error < 1e-2 of the output rms: activations rounded to int8 per 32-block
(as ggml's Q8_0/Q8_1 vec_dot types) move each by up to 1/254 of its block's largest, an
rms error of ~0.3 % of a Gaussian output.
"""

from __future__ import annotations

import re
from functools import cache

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from dynalm.core import elementwise, matmul, pool
from dynalm.core.matmul import QuantMatmul
from dynalm.core.quant import QK_K, dequantize, random_blocks
from dynalm.kernel import backends, layouts
from dynalm.kernel import matmul_programs as programs
from tolerances import sum_bound

LEGACY = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# 4-bit indices into a 16-value table (``kernel.formats.Table``): blocks of 32, 256, 32
TABLES = [T.IQ4_NL, T.IQ4_XS, T.MXFP4]
SUPER_BLOCKS = {*K_QUANTS, T.IQ4_XS}  # formats of 256-weight blocks
N = 67


@cache
def weights(ggml_type: T, n: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(k * 100 + int(ggml_type))
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.1, 2, (n, 1))
    w = w.astype(np.float32)
    if ggml_type == T.F32:
        return w.view(np.uint8)
    if ggml_type in (T.F16, T.BF16):
        return quants.quantize(w, ggml_type).view(np.uint8)
    if ggml_type in K_QUANTS or ggml_type in (T.IQ4_NL, T.IQ4_XS):
        per = QK_K if ggml_type in SUPER_BLOCKS else 32
        return random_blocks(ggml_type, n * k // per, rng).reshape(n, -1)
    return quants.quantize(w, ggml_type)


def activations(t_rows: int, k: int) -> np.ndarray:
    x = np.random.default_rng(t_rows + k).standard_normal((t_rows, k)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: the int8 quantiser must not divide by zero
    return x


def check(y: np.ndarray, raw: np.ndarray, ggml_type: T, x: np.ndarray, mode: str) -> None:
    w = dequantize(raw, ggml_type, x.shape[1]).astype(np.float64)
    x64 = x.astype(np.float64)
    ref = x64 @ w.T
    err = y - ref
    if mode == "exact" or ggml_type in (T.F32, T.F16, T.BF16, T.Q2_K):
        # an fp32 sum of K products (plus a scale and a min per block: a few roundings more)
        bound = sum_bound(x.shape[1] + 8, np.abs(x64) @ np.abs(w).T)
        assert (np.abs(err) <= bound).all(), (np.abs(err) / bound).max()
    else:
        rms = np.sqrt(np.mean(ref**2))
        assert np.sqrt(np.mean(err**2)) < 1e-2 * rms


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize(
    ("ggml_type", "k"),
    [(t, k) for t in LEGACY for k in (64, 576, 1536)]
    + [(t, k) for t in K_QUANTS for k in (256, 1536)]
    + [(t, k) for t in TABLES for k in ((256, 1536) if t in SUPER_BLOCKS else (64, 576))],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_matches_reference(ggml_type: T, mode: str, k: int) -> None:
    raw = weights(ggml_type, N, k)
    mm = QuantMatmul(raw, ggml_type, k, mode=mode)
    for t_rows in (1, 3, 8, 33, 128):
        x = activations(t_rows, k)
        check(mm(x), raw, ggml_type, x, mode)


# Each backend natively, and each one's portable twin.
ALL_BACKENDS = [*backends.BACKENDS, *(b.twin() for b in backends.BACKENDS if b.requires)]
# Attention and the element-wise kernels use no tiles: x86-amx lowers them as x86-avx512.
VECTOR_BACKENDS = [b for b in ALL_BACKENDS if not b.tiles]


def runnable(backend: backends.Backend) -> backends.Backend:
    missing = backend.missing()
    if missing:
        pytest.skip(f"{backend.name} not native here (CPU lacks {', '.join(missing)}): twin only")
    return backend


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize(
    "ggml_type",
    # (IQ4_NL: IQ4_XS's lookup with Q4_0's scale; its every backend bitwise in the slow test)
    [T.F16, T.Q4_1, T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.Q2_K, T.IQ4_XS, T.MXFP4],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=lambda b: b.name)
def test_every_backend(backend: backends.Backend, ggml_type: T, mode: str) -> None:
    raw = weights(ggml_type, N, 768)
    mm = QuantMatmul(raw, ggml_type, 768, mode=mode, backend=runnable(backend))
    for t_rows in (1, 5, 8, 21):  # each batch bucket's tile (kernel.matmul_programs.buckets)
        x = activations(t_rows, 768)
        check(mm(x), raw, ggml_type, x, mode)


@pytest.mark.slow  # every backend of every format compiled
@pytest.mark.parametrize(
    "ggml_type",
    [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *TABLES],
    ids=lambda t: t.name,
)
def test_auto_backends_agree_bitwise(ggml_type: T) -> None:
    """int8 sums are exact whatever the instructions (vpdpbusd into int32, vpmaddubsw pairs
    into int16, widened IR), and each backend converts and scales them in one float order:
    a backend (or its twin) never changes an auto result, so auto's validation holds for
    all of them."""
    raw = weights(ggml_type, N, 512)
    here = [b for b in ALL_BACKENDS if not b.missing()]
    mms = [QuantMatmul(raw, ggml_type, 512, mode="auto", backend=b) for b in here]
    for t_rows in (9, 37):  # vector tiles; tile products of 16 rows and a ragged last
        x = activations(t_rows, 512)
        ys = [mm(x) for mm in mms]
        for b, y in zip(here[1:], ys[1:], strict=True):
            assert np.array_equal(y, ys[0]), f"T={t_rows}: {b.name} differs from {here[0].name}"


@pytest.mark.parametrize("backend", [backends.host_best(), backends.GENERIC], ids=lambda b: b.name)
def test_every_mxfp4_exponent_is_read_as_ggml_reads_it(backend: backends.Backend) -> None:
    """MXFP4's e8m0 byte e is 2**(e - 128) in the kernels too, the denormals of e = 0, 1
    included: an exact matmul by the identity gives each weight back bitwise (one product
    by 1.0, the rest zeros), row e holding blocks of exponent e (up to 252: 12 * 2**124,
    the largest that stays finite)."""
    rng = np.random.default_rng(39)
    n, k = 253, 64
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(n, dtype=np.uint8)[:, None]
    raw = raw.reshape(n, -1)
    mm = QuantMatmul(raw, T.MXFP4, k, mode="exact", backend=runnable(backend))
    y = mm(np.eye(k, dtype=np.float32))
    np.testing.assert_array_equal(y, dequantize(raw, T.MXFP4, k).T)


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_threads_split_rows_identically(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(matmul, "_PARALLEL_MIN_BYTES", 0)
    raw = weights(T.Q4_1, 203, 576)
    one = QuantMatmul(raw, T.Q4_1, 576, mode=mode, threads=1)
    many = [QuantMatmul(raw, T.Q4_1, 576, mode=mode, threads=t) for t in (2, 3)]
    for t_rows in (1, 5, 70):
        x = activations(t_rows, 576)
        expected = one(x)
        for _ in range(50):  # many jobs in a row: the pool hands over without losing one
            for mm in many:
                assert np.array_equal(mm(x), expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_native_program_runs_like_direct_calls(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Two chained matmuls and an add kernel as one ``pool.Program``: the second reads what
    the first wrote, within the same native call."""
    monkeypatch.setattr(matmul, "_PARALLEL_MIN_BYTES", 0)
    first = QuantMatmul(weights(T.Q4_1, 224, 576), T.Q4_1, 576, mode="auto", threads=threads)
    second = QuantMatmul(weights(T.Q8_0, 576, 224), T.Q8_0, 224, mode="exact", threads=threads)
    x = activations(5, 576)
    expected = second(first(x)) + x
    h, y, total = np.zeros((5, 224), np.float32), *np.zeros((2, 5, 576), np.float32)
    add = elementwise.add(total, y, x)
    records = first.records(x, h) + second.records(h, y) + add.records()
    assert {kind for kind, *_ in records} >= ({pool.SPLIT} if threads > 1 else {pool.RANGE})
    program = pool.Program(records, threads)
    for _ in range(3):
        total[...] = 0
        program()
        assert np.array_equal(total, expected)


def test_reused_buffers_see_new_values_and_shapes() -> None:
    raw = weights(T.Q8_0, N, 576)
    mm = QuantMatmul(raw, T.Q8_0, 576, mode="auto")
    x = activations(4, 576)
    out = np.empty((4, N), np.float32)
    assert mm(x, out) is out
    x *= -2  # same array object, new contents
    mm(x, out)
    check(out, raw, T.Q8_0, x, "auto")
    x1 = activations(1, 576)
    check(mm(x1), raw, T.Q8_0, x1, "auto")
    with pytest.raises(ValueError):
        mm(x, np.empty((3, N), np.float32))


def test_refuses_what_it_cannot_run() -> None:
    assert QuantMatmul.supported(T.Q4_1, "auto")
    assert not QuantMatmul.supported(T.IQ2_XXS, "exact")
    assert not QuantMatmul.supported(T.Q4_1, "fast")
    with pytest.raises(ValueError):
        QuantMatmul(weights(T.Q4_1, N, 64), T.Q4_1, 64, mode="fast")
    with pytest.raises(ValueError):
        QuantMatmul(weights(T.Q4_1, N, 64), T.Q4_1, 64)(np.zeros((1, 64), np.float64))


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=lambda b: b.name)
def test_rows_do_not_depend_on_the_batch(
    backend: backends.Backend, ggml_type: T, mode: str
) -> None:
    # The engine relies on it: a sequence's logits are bitwise the same whatever it is
    # batched with (every batch bucket's tile sums each row in the same order).
    raw = weights(ggml_type, N, 768)
    mm = QuantMatmul(raw, ggml_type, 768, mode=mode, backend=runnable(backend))
    x = activations(37, 768)
    batched = mm(x)
    for t, size in ((0, 1), (5, 4), (20, 8), (36, 1), (3, 16), (10, 27)):  # each bucket's tile
        assert np.array_equal(mm(x[t : t + size].copy())[0], batched[t])


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=lambda b: b.name)
def test_auto_products_of_a_nan_or_inf_activation_are_not_finite(
    backend: backends.Backend, ggml_type: T
) -> None:
    """As in exact, a NaN or an inf in a row's activations makes that row's products not
    finite (its scale group's int8 scale is NaN or inf), so the engine's check of the logits
    sees it; the quantiser once dropped a NaN (products finite). The other rows are the
    bits they are without them, in the GEMV and in each tile."""
    raw = weights(ggml_type, N, 512)
    mm = QuantMatmul(raw, ggml_type, 512, mode="auto", backend=runnable(backend))
    for t_rows in (1, 5, 21):
        x = activations(t_rows, 512)
        clean = mm(x)
        x[0, 37], x[-1, 300] = np.nan, np.inf
        y = mm(x)
        assert np.isnan(y[0]).all()
        assert not np.isfinite(y[-1]).any()
        assert np.array_equal(y[1:-1], clean[1:-1])


def test_a_ragged_batch_runs_its_rest_on_the_rest_s_own_tile() -> None:
    """A partial group of a tile costs a whole one: 9 rows are a tile of 8 and a GEMV of 1,
    12 a tile of 8 and one of 4, 20 on AMX a tile product of 16 and a vector tile of 4; a
    rest the smaller tile would not do in fewer rows (15 = 8 + 7: 8 rows of 4-tiles)
    stays on the batch's tile. (Every row's result is the same whichever tile computes it:
    ``test_rows_do_not_depend_on_the_batch``.)"""
    from dynalm.kernel.matmul_programs import MatmulKernels

    def cover(backend: backends.Backend, mode: str, t_rows: int) -> list[tuple[int, int, int]]:
        kernels = MatmulKernels(T.Q4_1, mode, backend, 256)
        return [(kernels.specs[k]["mr"], first, n) for k, first, n in kernels.cover(t_rows)]

    assert cover(backends.AVX512, "auto", 9) == [(8, 0, 8), (1, 8, 1)]
    assert cover(backends.AVX512, "auto", 11) == [(8, 0, 8), (4, 8, 3)]  # not 3 GEMV rows
    assert cover(backends.AVX512, "auto", 12) == [(8, 0, 8), (4, 8, 4)]
    assert cover(backends.AVX512, "auto", 15) == [(8, 0, 15)]
    assert cover(backends.AVX512, "auto", 16) == [(8, 0, 16)]
    assert cover(backends.AVX512, "auto", 3) == [(1, 0, 3)]
    assert cover(backends.AVX512, "auto", 5) == [(4, 0, 4), (1, 4, 1)]
    for t in (6, 7):  # one taller tile (a GEMV row costs about two tile rows)
        assert cover(backends.AVX512, "auto", t) == [(8, 0, t)]
    assert cover(backends.AMX, "auto", 20) == [(16, 0, 16), (4, 16, 4)]
    assert cover(backends.AMX, "auto", 28) == [(16, 0, 28)]
    assert cover(backends.GENERIC, "auto", 6) == [(4, 0, 4), (1, 4, 2)]
    assert cover(backends.GENERIC, "auto", 7) == [(4, 0, 7)]
    assert cover(backends.AVX512, "exact", 9) == [(4, 0, 8), (1, 8, 1)]  # Q4_1: 4 x 2


def test_avx2_prefill_batches_run_on_the_wide_tile() -> None:
    """x86-avx2 (and its twin) take batches of ``WIDE_ROWS`` rows and more on the tile of
    3 activation rows x 3 row groups, the rest of a ragged batch where it is cheaper on
    another; smaller batches keep the 4-row tile."""
    from dynalm.kernel.matmul_programs import WIDE_ROWS, MatmulKernels

    for backend in (backends.AVX2, backends.AVX2.twin()):
        kernels = MatmulKernels(T.Q4_0, "auto", backend, 256)

        def cover(t_rows: int, kernels: MatmulKernels = kernels) -> list[tuple[int, int, int]]:
            return [(kernels.specs[k]["mr"], first, n) for k, first, n in kernels.cover(t_rows)]

        assert WIDE_ROWS == 16
        assert cover(15) == [(4, 0, 15)]
        assert cover(16) == [(3, 0, 15), (1, 15, 1)]
        assert cover(17) == [(3, 0, 17)]
        assert cover(512) == [(3, 0, 512)]
        assert cover(5) == [(4, 0, 4), (1, 4, 1)]
        assert [s.nr for s in programs.buckets("auto", backend)] == [8, 8, 24]
    assert programs.buckets("auto", backends.GENERIC)[-1].nr == 8  # no wide tile elsewhere


# N: within one tile (24 rows: 3 whole groups; 20: a partial third), 67 (a partial group
# past two tiles), 203 (several); T: tiles of 3 with 0, 1 or 2 rows over the edge.
@pytest.mark.parametrize(
    "ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_1, *TABLES], ids=lambda t: t.name
)
@pytest.mark.parametrize("backend", [backends.AVX2, backends.AVX2.twin()], ids=lambda b: b.name)
def test_the_wide_tile_at_edge_shapes_equals_the_other_tiles(
    backend: backends.Backend, ggml_type: T
) -> None:
    """Every row of a wide-tile batch is bitwise the row the GEMV and the 4-row tile give
    (and the generic backend's), whatever N, T and K leave over its 3 x 24 tile."""
    # K = 9 blocks of 32 (an odd count); not test_jit's K (96, 160, 224): it counts its
    # kernels as they are compiled (one compiled here first is loaded, not compiled)
    k = 256 if ggml_type in SUPER_BLOCKS else 288
    for n in (20, 24, 67, 203):
        raw = weights(ggml_type, n, k)
        mm = QuantMatmul(raw, ggml_type, k, mode="auto", backend=runnable(backend))
        generic = QuantMatmul(raw, ggml_type, k, mode="auto", backend=backends.GENERIC)
        for t_rows in (16, 17, 18, 40):
            x = activations(t_rows, k)
            y = mm(x)
            check(y, raw, ggml_type, x, "auto")
            assert np.array_equal(y, generic(x)), (n, t_rows)
            assert np.array_equal(mm(x[:1].copy()), y[:1])  # the GEMV
            assert np.array_equal(mm(x[-4:].copy()), y[-4:])  # the 4-row tile


# Q4_0 unpacks its weights in each tile, Q6_K reads them from the tile's panel
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_cut_the_wide_tile_s_row_groups(
    monkeypatch: pytest.MonkeyPatch, threads: int, ggml_type: T
) -> None:
    """Threads take whole wide tiles (shares of 24 rows: a share ending inside one computed
    all of it); the matrix's last tile runs past N = 203, its groups past the end are
    not stored; every job's rows are the 1-thread ones."""
    monkeypatch.setattr(matmul, "_PARALLEL_MIN_BYTES", 0)
    k = 512 if ggml_type in K_QUANTS else 576
    raw = weights(ggml_type, 203, k)
    backend = runnable(backends.AVX2)
    one = QuantMatmul(raw, ggml_type, k, mode="auto", threads=1, backend=backend)
    many = QuantMatmul(raw, ggml_type, k, mode="auto", threads=threads, backend=backend)
    assert programs.MatmulKernels(ggml_type, "auto", backend, k).row_multiple == 24
    assert programs.buckets("auto", backend, ggml_type)[-1].panel == (ggml_type == T.Q6_K)
    x = activations(37, k)
    expected = one(x)
    for _ in range(20):
        assert np.array_equal(many(x), expected)


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_repack_in_chunks_equals_repack_at_once(
    monkeypatch: pytest.MonkeyPatch, ggml_type: T, mode: str
) -> None:
    """The repack walks row chunks (whole row groups) and releases each chunk's source
    rows once done; chunks of 8 rows with a ragged last group give the same weights."""
    raw = weights(ggml_type, N, 512)
    whole = QuantMatmul(raw, ggml_type, 512, mode=mode)
    released: list[tuple[int, int]] = []
    monkeypatch.setattr(layouts, "_REPACK_CHUNK_BYTES", raw.shape[1])  # one group a chunk
    chunked = QuantMatmul(
        raw, ggml_type, 512, mode=mode, release_rows=lambda lo, hi: released.append((lo, hi))
    )
    assert np.array_equal(chunked._weights, whole._weights)
    group = whole._kernels.layout.rows
    assert released == [(lo, min(lo + group, N)) for lo in range(0, N, group)]
    x = activations(3, 512)
    assert np.array_equal(chunked(x), whole(x))


def test_matmuls_share_one_activation_scratch() -> None:
    """auto matmuls of different K quantise into one shared buffer; when it grows (a taller
    x), matmuls bound to the old buffer rebind instead of reading freed memory."""
    scratch = matmul.ActivationScratch()
    wide = QuantMatmul(weights(T.Q8_0, N, 1536), T.Q8_0, 1536, mode="auto", scratch=scratch)
    narrow = QuantMatmul(weights(T.Q4_1, N, 576), T.Q4_1, 576, mode="auto", scratch=scratch)
    alone = QuantMatmul(weights(T.Q4_1, N, 576), T.Q4_1, 576, mode="auto")
    x_wide, x_narrow = activations(2, 1536), activations(4, 576)
    expected_wide = QuantMatmul(weights(T.Q8_0, N, 1536), T.Q8_0, 1536, mode="auto")(x_wide)
    assert np.array_equal(narrow(x_narrow), alone(x_narrow))
    generation = scratch.generation
    assert np.array_equal(wide(activations(64, 1536))[:0], np.empty((0, N), np.float32))
    assert scratch.generation > generation  # grown: narrow's bound address is stale now
    assert np.array_equal(narrow(x_narrow), alone(x_narrow))
    assert np.array_equal(wide(x_wide), expected_wide)


def test_amx_lowers_to_tile_instructions() -> None:
    """The x86-amx tile kernel as LLVM makes it for an AMX CPU (on any host: assembly
    only): tiles configured once, per block one A load and a zeroed C, B load, tdpbsud and
    C store per key, tiles released. Its arithmetic is tested above through its twin."""
    from dynalm.kernel import jit
    from dynalm.kernel.matmul_programs import MATMUL

    features = ",".join(f"+{f}" for f in backends.AMX.requires)
    for ggml_type, keys in ((T.Q4_1, 2), (T.Q6_K, 4)):  # 1 and 2 scales per 32-block
        spec = {"k_blocks": 18, "ggml_type": int(ggml_type), "mode": "auto", "mr": 16}
        asm = jit.assembly(backends.AMX.module(MATMUL, spec).text(), features)
        ops = re.findall(
            r"^\s+(ldtilecfg|tileloadd|tilezero|tdpbsud|tilestored|tilerelease)\b", asm, re.M
        )
        assert ops.count("ldtilecfg") == 1 and ops.count("tilerelease") == 1
        assert ops.count("tdpbsud") == ops.count("tilezero") == ops.count("tilestored") == keys
        assert ops.count("tileloadd") == 1 + keys


@pytest.mark.parametrize("ggml_type", TABLES, ids=lambda t: t.name)
def test_table_formats_decode_by_byte_shuffles_on_x86(ggml_type: T) -> None:
    """A 16-value table's nibbles decode by ``pshufb`` on AVX2 and AVX-512 (assembly only,
    any host): one per block and row in the exact GEMV (4 rows x 4 blocks, then the rest
    loop's 4), one per chunk of 4 elements in the auto GEMV, and none of the portable
    form's compares; the twins' compare-and-select form is tested bitwise against them
    above, the AArch64 ``tbl`` in test_neon."""
    from dynalm.kernel import jit
    from dynalm.kernel.matmul_programs import MATMUL

    for backend in (backends.AVX2, backends.AVX512):
        features = ",".join(f"+{f}" for f in backend.requires)
        for mode, shuffles in (("exact", 20), ("auto", 8)):
            spec = {"k_blocks": 16, "ggml_type": int(ggml_type), "mode": mode, "mr": 1}
            asm = jit.assembly(backend.module(MATMUL, spec).text(), features)
            ops = re.findall(r"^\s+(vpshufb|vpcmpeqb)\b", asm, re.M)
            assert ops.count("vpshufb") == shuffles, (backend.name, mode)
            assert "vpcmpeqb" not in ops, (backend.name, mode)


def test_int8_probes_multiply_once_per_chain_and_round() -> None:
    """kernel_bench's int8 peaks on AVX2 (assembly only, any host): the multiply probe is 8
    ``vpmaddubsw`` per round, the multiply-and-widen probe 8 ``vpmaddubsw`` + 8 ``vpmaddwd``
    -- a probe whose chains shared their operands compiled to one of each per round -- and
    the auto-cell probe 8 chains' 8 products, 2 widenings and 2 converts."""
    from dynalm.kernel import jit, probes

    features = ",".join(f"+{f}" for f in backends.AVX2.requires)
    for program, widens in ((probes.INT8_MUL, 0), (probes.INT8_DOT, probes.DOT_CHAINS)):
        asm = jit.assembly(backends.AVX2.module(program, {}).text(), features)
        ops = re.findall(r"^\s+(vpmaddubsw|vpmaddwd)\b", asm, re.M)
        assert ops.count("vpmaddubsw") == probes.DOT_CHAINS, program.name
        # (the multiply probe widens its int16 sums once, after the loop)
        assert ops.count("vpmaddwd") == max(widens, 1), program.name
    # the auto-cell probe: per chain a 32-block's products, widened once per scale group
    asm = jit.assembly(backends.AVX2.module(probes.INT8_CELL, {}).text(), features)
    ops = re.findall(r"^\s+(vpmaddubsw|vpmaddwd|vcvtdq2ps)\b", asm, re.M)
    assert ops.count("vpmaddubsw") == probes.DOT_CHAINS * probes.CELL_PRODUCTS
    assert ops.count("vpmaddwd") == ops.count("vcvtdq2ps") == 2 * probes.DOT_CHAINS


def test_amx_needs_its_features_and_permission() -> None:
    """Where x86-amx cannot run, it says why; ``DYNALM_ISA=amx`` is refused naming it."""
    from dynalm.kernel import jit

    if not jit.host_flags().get("amx-tile", False):  # Linux grants tile state to AMX CPUs only
        assert "refused AMX tile permission" in (jit.amx_permission() or "")
    missing = backends.AMX.missing()
    if missing:
        with pytest.raises(backends.BackendUnavailable, match="cannot run here: lacks"):
            backends.by_name("amx")
        assert backends.host_best() is not backends.AMX
    else:
        assert backends.by_name("amx") is backends.AMX
        assert backends.host_best() is backends.AMX
