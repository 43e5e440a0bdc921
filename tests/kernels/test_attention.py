"""The JIT paged-attention kernel against the numpy reference (cpu_ops.attention), within
the rounding of two fp32 evaluations (`attention_bound`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_matmul import VECTOR_BACKENDS, runnable

from dynalm.core import cpu_ops
from dynalm.core.attention import PagedAttention, StepLayout
from dynalm.core.kv_storage import AttentionBatch
from dynalm.kernel import backends
from dynalm.runtime.engine.kv_cache import PagePool
from tolerances import U, sum_bound

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def ragged_step(
    dtype: str,
    seqs: list[tuple[list[int], int, int]],
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    kv=lambda k, v: (k, v),
    n_pages: int = 32,
):
    """A pool whose sequences (pages, context length, new tokens) hold random earlier keys,
    plus the step's random q/k/v for the new tokens (keys and values passed through ``kv``).
    With recent buffers (q8_0), each sequence's earlier keys count as a prefix-cache hit."""
    rng = np.random.default_rng(seed)
    pool = PagePool(1, kv_heads, head_dim, n_pages, PAGE, dtype, n_seqs=len(seqs))

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    for pages, n_ctx, n_new in seqs:
        earlier = pool.slots(pages, 0, n_ctx - n_new)
        shape = (len(earlier), kv_heads, head_dim)
        pool.storage.write(0, earlier, *kv(rand(*shape), rand(*shape)))
    n_tokens = sum(n for *_, n in seqs)
    positions = np.concatenate([np.arange(c - n, c) for _, c, n in seqs]).astype(np.int64)
    batch = AttentionBatch(
        kv=pool.storage,
        query_start=np.cumsum([0] + [n for *_, n in seqs]),
        seq_lens=np.array([c for _, c, _ in seqs]),
        page_tables=[np.asarray(p, np.int64) for p, _, _ in seqs],
        slots=np.concatenate([pool.slots(p, c - n, c) for p, c, n in seqs]),
        recent=np.array([pool.open_recent() for _ in seqs]) if pool.recent else None,
        recent_from=np.array([c - n for _, c, n in seqs]) if pool.recent else None,
    )
    q = rand(n_tokens, heads * head_dim)
    k, v = kv(rand(n_tokens, kv_heads * head_dim), rand(n_tokens, kv_heads * head_dim))
    return pool, batch, positions, q, k, v


def attend(
    batch,
    positions,
    q,
    k,
    v,
    heads,
    kv_heads,
    head_dim,
    scale,
    window,
    threads,
    backend=None,
    softcap=0.0,
    sinks=None,
):
    """The kernel's output for one step (it stores the step's k/v in the pool first)."""
    step = StepLayout()
    step.set(batch, positions)
    out = np.full((len(q), heads * head_dim), np.nan, np.float32)
    geometry = (heads, kv_heads, head_dim, scale, window, threads)
    how = {"softcap": softcap, "sinks": sinks, "backend": backend}
    PagedAttention(step, 0, *geometry, out, q, k, v, **how)()
    return out


def attention_bound(
    pool, tables, lengths, q, heads, head_dim, scale, softcap=0.0, sinks=None
) -> np.ndarray:
    """Per token and query head, how far two fp32 attentions may differ (`sum_bound`, each
    way): a score's dot product of head_dim terms errs by at most ``sum_bound(head_dim,
    scale * |q| * |k|)`` (Cauchy-Schwarz), which is a relative error of the key's weight
    after exp; the weights' normaliser and the weighted sum of values add the rounding of
    a sum over the context; the values' largest magnitude scales it all. The q8_0 keys'
    Hadamard rotation (32 terms a row) adds one more score-sized error. A score cap
    ``c tanh(s / c)`` has slope at most 1, so it passes a score's error on unchanged, and
    adds its own rounding: s / c (U |s| after the cap), the kernel's tanh through exp
    (e = exp(-2|y|) within 2U relative, times |d tanh / de| <= 2, then 1 - e, 1 + e and
    the division: 7U absolute; numpy's tanh 1U more), and the product with c (U c): at
    most 10 U (c + |s|) a score, each way. A sink's term exp(sink - max) errs as a score
    does by the rounding of its exponent (U (|sink| + |max|)) and of exp (2 U), each way;
    the normaliser's sum has one more term."""
    keys, values = [], []
    for table, n in zip(tables, lengths, strict=True):
        k, v = pool.storage.read(0, pool.slots(table, 0, n))
        keys.append(k)
        values.append(v)
    k_max = max(float(np.linalg.norm(k, axis=-1).max()) for k in keys)
    v_max = max(float(np.abs(v).max()) for v in values)
    n_max = int(max(lengths))
    q_norm = np.linalg.norm(q.reshape(len(q), heads, head_dim), axis=-1, keepdims=True)
    score = 2 * sum_bound(head_dim, scale * q_norm * k_max)
    if softcap:
        score = score + 2 * 10 * U * (softcap + scale * q_norm * k_max)
    if sinks is not None:
        sink = np.abs(sinks).reshape(1, heads, 1)
        score = np.maximum(score, 2 * U * (sink + scale * q_norm * k_max + 2))
        n_max += 1
    per_head = 2 * v_max * (2 * score + 2 * sum_bound(n_max, 1.0) + 4 * U)
    return np.broadcast_to(per_head, (len(q), heads, head_dim)).reshape(len(q), -1)


def tables(batch: AttentionBatch) -> tuple[list[np.ndarray], np.ndarray]:
    return batch.page_tables, batch.seq_lens


def assert_close(out: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> None:
    assert (np.abs(out - ref) <= bound).all(), (np.abs(out - ref) / bound).max()


def assert_same_pages(a: PagePool, b: PagePool) -> None:
    arrays = [
        (*p.k, *p.v, *p.k_scale, *p.v_scale, *p.k_recent, *p.v_recent)
        for p in (a.storage, b.storage)
    ]
    for x, y in zip(*arrays, strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("merged", [False, True])
def test_kernel_matches_numpy(dtype: str, window: int, threads: int, merged: bool):
    # a prefill chunk inside a 3-page context, a decode token, and a 1-token sequence
    seqs = [([3, 7, 1], 40, 5), ([5, 9], 17, 1), ([2], 1, 1)]
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, HEADS, KV_HEADS, HEAD_DIM, 0.125, window)
    if merged:  # q, k and v as column ranges of one matmul's output
        qkv = np.concatenate([q, k, v], axis=1)
        q, k, v = np.split(qkv, np.cumsum([q.shape[1], k.shape[1]]), axis=1)
    ours, batch, *_ = ragged_step(dtype, seqs)
    batch.kv = ours.storage
    out = attend(batch, positions, q, k, v, HEADS, KV_HEADS, HEAD_DIM, 0.125, window, threads)
    assert_close(out, ref, attention_bound(pool, *tables(batch), q, HEADS, HEAD_DIM, 0.125))
    assert_same_pages(ours, pool)  # the step's k/v stored exactly as PagePool.write does


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 32), (4, 4, 64), (16, 2, 32), (6, 1, 128)],
)
def test_long_context_and_other_geometries(
    dtype: str, window: int, heads: int, kv_heads: int, head_dim: int
):
    # many key blocks with a partial last one, a window across blocks, query heads per
    # work item 1 to 4 (a group of 6 or 8 splits in two), and enough work for 2 threads
    seqs = [([1, 3], 23, 1), ([4, 0, 6, 2, 9, 11, 13], 100, 8)]
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs, 1, heads, kv_heads, head_dim)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, heads, kv_heads, head_dim, 0.1, window)
    out = attend(batch, positions, q, k, v, heads, kv_heads, head_dim, 0.1, window, 2)
    assert_close(out, ref, attention_bound(pool, *tables(batch), q, heads, head_dim, 0.1))


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_every_backend_computes_the_same(backend: backends.Backend, dtype: str):
    """The attention program is written for 8 lanes and no ISA-dependent primitive, so
    every backend (native where this CPU runs it, and each one's portable twin) lowers it
    to the same float order: within the numpy budget, and outputs and pages bitwise those
    of the selected backend."""
    seqs = [([3, 7, 1], 40, 5), ([5, 9], 17, 1), ([2], 1, 1)]
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 5, 2)
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry[:-1])
    expected = attend(batch, positions, q, k, v, *geometry)
    ours, batch, *_ = ragged_step(dtype, seqs)
    out = attend(batch, positions, q, k, v, *geometry, backend=runnable(backend))
    assert np.array_equal(out, expected)
    assert_same_pages(ours, pool)
    assert_close(out, ref, attention_bound(pool, *tables(batch), q, HEADS, HEAD_DIM, 0.125))


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_softcap_matches_numpy_and_every_backend(backend: backends.Backend, dtype: str):
    """Gemma 2's score cap (``softcap * tanh(s / softcap)`` of the scaled scores): within
    the numpy reference's budget (`attention_bound` with the cap's rounding), bitwise the
    same on every backend and twin as on the selected one, and the cap matters: the scores
    (std ~4 at this scale) are well past it."""
    seqs = [([3, 7, 1], 40, 5), ([5, 9], 17, 1), ([2], 1, 1)]
    scale, cap = 0.5, 1.5
    geometry = (HEADS, KV_HEADS, HEAD_DIM, scale, 0, 2)
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry[:-1], softcap=cap)
    expected = attend(batch, positions, q, k, v, *geometry, softcap=cap)
    ours, batch, *_ = ragged_step(dtype, seqs)
    out = attend(batch, positions, q, k, v, *geometry, backend=runnable(backend), softcap=cap)
    assert np.array_equal(out, expected)
    bound = attention_bound(pool, *tables(batch), q, HEADS, HEAD_DIM, scale, softcap=cap)
    assert_close(out, ref, bound)
    _, batch, *_ = ragged_step(dtype, seqs)
    uncapped = attend(batch, positions, q, k, v, *geometry)
    assert (np.abs(uncapped - ref) / bound).max() > 100


SINK_STEPS = [
    # a prefill of 5 in one chunk, one of 3 over two chunks (290 keys), a 1-token sequence:
    # enough items for the ``items`` schedule, which folds an item's chunks on one thread
    [([3, 7, 1], 40, 5), ([*range(30, 49)], 290, 3), ([9], 1, 1)],
    # one decode token over two chunks (300 keys): ``parts`` on two threads, then ``merge``
    [([*range(10, 29)], 300, 1)],
]


@pytest.mark.parametrize("seqs", SINK_STEPS, ids=["items", "parts-merge"])
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_sinks_match_numpy_and_every_backend(backend: backends.Backend, dtype: str, seqs):
    """gpt-oss's sinks (a logit per head in the softmax's denominator): within the numpy
    reference's budget, bitwise the same on every backend and twin as on the selected one,
    in both schedules of split-K chunks; sinks from far below the scores to far above them
    (the output then near 0), and the sinks matter."""
    scale = 0.25
    geometry = (HEADS, KV_HEADS, HEAD_DIM, scale, 0, 2)
    sinks = np.linspace(-20.0, 30.0, HEADS).astype(np.float32)
    pool, batch, positions, q, k, v = ragged_step(dtype, seqs, n_pages=64)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry[:-1], sinks=sinks)
    expected = attend(batch, positions, q, k, v, *geometry, sinks=sinks)
    ours, batch, *_ = ragged_step(dtype, seqs, n_pages=64)
    out = attend(batch, positions, q, k, v, *geometry, backend=runnable(backend), sinks=sinks)
    assert np.array_equal(out, expected)
    assert_same_pages(ours, pool)
    bound = attention_bound(pool, *tables(batch), q, HEADS, HEAD_DIM, scale, sinks=sinks)
    assert_close(out, ref, bound)
    _, batch, *_ = ragged_step(dtype, seqs, n_pages=64)
    sinkless = attend(batch, positions, q, k, v, *geometry)
    assert (np.abs(sinkless - ref) / bound).max() > 100
    last = np.abs(ref.reshape(len(q), HEADS, HEAD_DIM))[:, -1]  # sink e^30: the rest ~0
    assert last.max() < 1e-6


def test_rotated_q8_0_keys_with_outlier_channels_halve_the_error_of_plain_q8_0():
    # A few large key channels, as real keys have, set their q8_0 blocks' scales and crush
    # the other channels; Hadamard-rotated first, the blocks keep them.
    gain = np.ones(HEAD_DIM, np.float32)
    gain[[3, 36, 37]] = 20.0

    def outliers(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (k.reshape(-1, HEAD_DIM) * gain).reshape(k.shape), v

    def plain_q8(x: np.ndarray) -> np.ndarray:  # q8_0 round trip without rotation
        blocks = x.reshape(-1, 32)
        d = np.abs(blocks).max(-1, keepdims=True) / 127.0
        return (np.rint(blocks / d) * d.astype(np.float16)).astype(np.float32).reshape(x.shape)

    def out(dtype: str, kv) -> np.ndarray:
        _, batch, positions, q, k, v = ragged_step(dtype, [([3, 7, 1], 40, 5)], kv=kv)
        return attend(batch, positions, q, k, v, HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 1)

    # against f32 pages holding the same q8_0 values: only the keys' error counts
    exact = out("f32", lambda k, v: (outliers(k, v)[0], plain_q8(v)))
    rotated = np.abs(out("q8_0", outliers) - exact).mean()
    plain = np.abs(out("f32", lambda k, v: tuple(map(plain_q8, outliers(k, v)))) - exact).mean()
    assert rotated < plain / 2, (rotated, plain)  # measured 2.6x less


def test_result_of_a_token_does_not_depend_on_the_batch():
    seqs = [([3, 7, 1], 40, 5), ([5, 9], 17, 1)]
    pool, batch, positions, q, k, v = ragged_step("f16", seqs)
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 1)
    together = attend(batch, positions, q, k, v, *geometry)
    second = AttentionBatch(
        pool.storage, np.array([0, 1]), batch.seq_lens[1:], [[5, 9]], batch.slots[5:], batch.recent
    )
    alone = attend(second, positions[5:].copy(), q[5:], k[5:], v[5:], *geometry)
    assert np.array_equal(together[5:], alone)


def run_chunks(
    chunks: list[int],
    kernel: bool,
    recent_from: int = 0,
    threads: int = 2,
    geometry: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
):
    """One q8_0 sequence of ``sum(chunks)`` tokens (random q/k/v per position) run step by
    step in ``chunks``, the tokens before ``recent_from`` as a prefix-cache hit; returns
    every token's output, the pool, and the bound of the outputs (`attention_bound`)."""
    rng = np.random.default_rng(7)
    heads, kv_heads, head_dim = geometry
    n = recent_from + sum(chunks)
    pages = [4, 1, 6, 0, 3, 7] + list(range(8, 8 + max(0, -(-n // PAGE) - 6)))
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    q, k, v = (rng.standard_normal((n, w)).astype(np.float32) for w in widths)
    pool = PagePool(1, kv_heads, head_dim, max(8, len(pages) + 2), PAGE, "q8_0", n_seqs=2)
    cached = [x[:recent_from].reshape(-1, kv_heads, head_dim) for x in (k, v)]
    pool.storage.write(0, pool.slots(pages, 0, recent_from), *cached)
    recent = pool.open_recent() + pool.open_recent()  # buffer 1: not the first rows
    out, start = np.zeros_like(q), recent_from
    geometry = (heads, kv_heads, head_dim, 0.125, 0)
    for size in chunks:
        rows = slice(start, start + size)
        batch = AttentionBatch(
            pool.storage,
            np.array([0, size]),
            np.array([start + size]),
            [np.array(pages)],
            pool.slots(pages, start, start + size),
            np.array([recent]),
            np.array([recent_from]),
        )
        positions = np.arange(start, start + size, dtype=np.int64)
        qkv = (q[rows], k[rows], v[rows])
        if kernel:
            out[rows] = attend(batch, positions, *qkv, *geometry, threads)
        else:
            cpu_ops.attention(out[rows], *qkv, positions, batch, 0, *geometry)
        start += size
    bound = attention_bound(pool, [pages], [n], q[recent_from:], heads, head_dim, 0.125)
    return out[recent_from:], pool, bound


@pytest.mark.parametrize("recent_from", [0, 21])
def test_recent_window_across_steps_matches_numpy(recent_from: int):
    # a prefill in two chunks, then decode steps past the 32-token window
    chunks = [30, 19, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    ours, pool, bound = run_chunks(chunks, kernel=True, recent_from=recent_from)
    ref, ref_pool, _ = run_chunks(chunks, kernel=False, recent_from=recent_from)
    assert_close(ours, ref, bound)
    assert_same_pages(pool, ref_pool)


def test_recent_window_result_does_not_depend_on_chunking():
    whole, *_ = run_chunks([64], kernel=True)
    for chunks in ([5, 40, 19], [1] * 64, [33, 31]):
        np.testing.assert_array_equal(run_chunks(chunks, kernel=True, threads=1)[0], whole)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 32)])
@pytest.mark.parametrize("recent_from", [0, 21])
def test_q8_0_tiles_give_each_token_what_it_gets_alone(
    heads: int, kv_heads: int, head_dim: int, recent_from: int
):
    """A q8_0 prefill's tiles, where each query reads its keys from the pages up to its
    window of 32 f16 keys: the blocks of pages all a tile's queries read, walked together,
    then each query's own rest, give each token bitwise what steps of 7 tokens (too few
    for a tile: each token alone) give, over 270 positions (a chunk edge of the keys at
    256), with a prefix-cache hit before them or not; MHA and groups of 3 (tiles of 8
    tokens x 1 head) and of 4 (4 x 2). Within the numpy reference's budget."""
    geometry, n = (heads, kv_heads, head_dim), 270 - recent_from
    tiled, pool, bound = run_chunks([n], True, recent_from, 2, geometry)
    alone, alone_pool, _ = run_chunks([7] * (n // 7) + [n % 7], True, recent_from, 2, geometry)
    assert np.array_equal(tiled, alone)
    assert_same_pages(pool, alone_pool)
    ref, *_ = run_chunks([n], False, recent_from, 2, geometry)
    assert_close(tiled, ref, bound)


def test_binding_refuses_buffers_the_kernel_would_overrun():
    pool, batch, positions, q, k, v = ragged_step("f32", [([0, 1], 20, 20)])
    step = StepLayout()
    step.set(batch, positions)
    out = np.empty_like(q)
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 1)
    with pytest.raises(ValueError, match="k: expected float32"):
        PagedAttention(step, 0, *geometry, out, q, k[:, :-1], v)
    with pytest.raises(ValueError, match="no attention kernel"):
        PagedAttention(step, 0, HEADS, 2, HEAD_DIM, 0.125, 0, 1, out, q, k, v)
    with pytest.raises(ValueError, match="layer 3 of a KV pool of 1"):
        PagedAttention(step, 3, *geometry, out, q, k, v)()
    short = PagedAttention(step, 0, *geometry, out[:10], q[:10], k[:10], v[:10])
    with pytest.raises(ValueError, match="20 tokens in 10 rows"):
        short()
    batch.slots[3] = len(pool.storage.k[0])  # a slot past the pages
    with pytest.raises(ValueError, match="KV slot outside the pool"):
        StepLayout().set(batch, positions)
    batch.slots[3] = 3
    batch.seq_lens[0] = 33  # longer than its two pages
    with pytest.raises(ValueError, match="longer than its pages"):
        StepLayout().set(batch, positions)


# Contexts of 600 keys (3 split-K chunks, the last partial), 257 (a chunk and one key) and
# 256 (exactly one chunk: the unsplit online softmax), each a decode token.
LONG = [(list(range(0, 38)), 600, 1), (list(range(38, 55)), 257, 1), (list(range(55, 71)), 256, 1)]


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 300])
def test_split_k_long_contexts_match_numpy_and_every_schedule(dtype: str, window: int):
    """Past ``CHUNK`` keys an item's keys are split into chunks whose partial softmaxes are
    folded in chunk order. The fold's rounding stays inside `attention_bound`: per chunk
    of 256 keys it rescales the running sums by two exps (about 1 ulp each) with one
    multiply and one add, about 6 u, or 6/256 u a key, while the blocks of 16 inside a
    chunk already take about 4 u of rescale per 16 keys; both are far below the n u of
    the bound's sum term. The chunks and the fold are the same whichever schedule runs
    them: one thread (``run``: an item's chunks in turn), items split over 2 threads, and
    one decode token's chunks spread over 2 threads (``parts`` + ``merge``) are bitwise
    equal."""
    from dynalm.kernel.attention_program import CHUNK, chunks

    assert [chunks(n) for _, n, _ in LONG] == [3, 2, 1] and CHUNK == 256
    pool, batch, positions, q, k, v = ragged_step(dtype, LONG, n_pages=72)
    ref = np.zeros_like(q)
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, window)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry)
    outs = []
    for threads in (1, 2):  # 9 items: on 2 threads the items split, not their chunks
        _, ours, *_ = ragged_step(dtype, LONG, n_pages=72)
        outs.append(attend(ours, positions, q, k, v, *geometry, threads))
    assert_close(outs[0], ref, attention_bound(pool, *tables(batch), q, HEADS, HEAD_DIM, 0.125))
    assert np.array_equal(outs[0], outs[1])
    for i in range(len(LONG)):  # each alone: 3 items, split-K over 2 threads
        at = slice(i, i + 1)
        recent = [x[at] if x is not None else None for x in (ours.recent, ours.recent_from)]
        alone = AttentionBatch(
            ours.kv, np.array([0, 1]), ours.seq_lens[at], ours.page_tables[at], ours.slots[at],
            *recent,
        )  # fmt: skip
        got = attend(alone, positions[at].copy(), q[at], k[at], v[at], *geometry, 2)
        assert np.array_equal(got, outs[0][at])


def test_split_k_prefill_equals_decode_of_each_token():
    """A prefill chunk of 8 tokens at 593..600 keys (24 items: split over 2 threads, each
    item's chunks in turn) gives each token bitwise what a decode step of that token alone
    gives (3 items: its chunks split over 2 threads): the split depends on a token's own
    context only, never on the step."""
    seqs = [(list(range(38)), 600, 8)]
    _, batch, positions, q, k, v = ragged_step("f16", seqs, n_pages=38)
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 2)
    together = attend(batch, positions, q, k, v, *geometry)
    for t in (0, 7):  # after the step, the pool holds every token's keys
        n = 600 - 7 + t
        decode = AttentionBatch(
            batch.kv, np.array([0, 1]), np.array([n]), [np.arange(38)], batch.slots[t : t + 1]
        )
        at = slice(t, t + 1)
        alone = attend(decode, positions[at].copy(), q[at], k[at], v[at], *geometry)
        assert np.array_equal(alone, together[at])


# A prefill step of tiles and tokens alone: 29 tokens at 241..269 (across the first CHUNK
# edge: 15 and 14 tokens, a tile and the rest alone on each side), a whole 21-token prompt,
# a decode token and a 9-token prompt; on 8 pages of 16 each but the decode's.
TILED = [
    ([*range(0, 17)], 270, 29),
    ([17, 18], 21, 21),
    ([19, 20, 21], 40, 1),
    ([22], 9, 9),
]


def test_work_order_puts_whole_tiles_after_the_tokens_alone():
    from dynalm.core.attention import work_order
    from dynalm.kernel.attention_program import TILE

    _, batch, positions, *_ = ragged_step("f16", TILED, n_pages=24)
    seq_of = batch.kernel_tables[1]
    order, singles, tiles = work_order(batch.query_start, seq_of, positions)
    assert TILE == 8 and (singles, tiles) == (20, 5)
    assert sorted(order) == list(range(len(seq_of)))
    runs = order[singles:].reshape(tiles, TILE)
    assert (np.diff(runs, axis=1) == 1).all()  # consecutive tokens, of one sequence,
    assert (seq_of[runs] == seq_of[runs[:, :1]]).all()
    at = positions[runs]  # at consecutive positions within one chunk of keys
    assert (np.diff(at, axis=1) == 1).all() and (at // 256 == at[:, :1] // 256).all()
    assert [int(positions[t]) for t in runs[:, 0]] == [241, 256, 0, 8, 0]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 32), (9, 3, 64), (4, 2, 128)]
)
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks", "window", "wide window"])
def test_tiled_prefill_gives_each_token_what_it_gets_alone(
    dtype: str, heads: int, kv_heads: int, head_dim: int, variant: str
):
    """A prefill's tiles (a work item of several consecutive query tokens, each key and
    value loaded once for all of them, each query masking the keys past its own) give each
    token bitwise what a step of that token alone gives (its chunks split over 2
    threads): MHA, groups of 4 (a tile's item of 4 tokens x 2 heads) and of 3 (8 tokens x 1
    head), f32 and f16 pages, with a score cap or sinks; a window that cuts the step's
    keys runs each token alone, one the step's positions (0..269) all lie inside runs tiles
    and gives bitwise what no window gives. All within the numpy reference's budget."""
    scale, window = 0.3, {"window": 37, "wide window": 270}.get(variant, 0)
    cap = 2.0 if variant == "softcap" else 0.0
    sinks = np.linspace(-3.0, 3.0, heads).astype(np.float32) if variant == "sinks" else None
    geometry = (heads, kv_heads, head_dim, scale, window)
    how = {"softcap": cap, "sinks": sinks}
    pool, batch, positions, q, k, v = ragged_step(
        dtype, TILED, 3, heads, kv_heads, head_dim, n_pages=24
    )
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry, **how)
    together = attend(batch, positions, q, k, v, *geometry, 2, **how)
    bound = attention_bound(pool, *tables(batch), q, heads, head_dim, scale, cap, sinks)
    assert_close(together, ref, bound)
    if variant == "wide window":  # (the step's keys stored again: the same values)
        unwindowed = attend(batch, positions, q, k, v, *geometry[:4], 0, 2, **how)
        assert np.array_equal(together, unwindowed)
    starts = np.cumsum([0] + [n for *_, n in TILED])
    for s, (pages, n_ctx, n_new) in enumerate(TILED):  # the pool now holds every key
        for t in range(starts[s], starts[s + 1]):
            n = n_ctx - n_new + t - starts[s] + 1
            alone = AttentionBatch(
                batch.kv, np.array([0, 1]), np.array([n]), [np.array(pages)], batch.slots[t : t + 1]
            )
            at = slice(t, t + 1)
            got = attend(alone, positions[at].copy(), q[at], k[at], v[at], *geometry, 2, **how)
            assert np.array_equal(got, together[at]), t


def test_values_past_the_f16_range_saturate():
    """A value past f16's range is stored in f16 pages as +-65504, by the kernel as by
    numpy, not as inf: the queries of its tile before it (which weigh it by 0: 0 x inf
    would be NaN) stay finite and get what they get alone, and all within the numpy
    reference's budget."""
    seqs = [([0, 1], 24, 16)]  # 8 earlier keys, then two tiles of 8 at positions 8..23
    geometry = (4, 4, 64, 0.125, 0)
    pool, batch, positions, q, k, v = ragged_step("f16", seqs, 5, *geometry[:3], n_pages=4)
    v[7, :64], v[7, 64:] = 1e5, -1e6  # the first tile's last token (position 15)
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry)
    stored = pool.storage.v[0][batch.slots[7]].copy()
    together = attend(batch, positions, q, k, v, *geometry, 2)
    assert np.array_equal(pool.storage.v[0][batch.slots[7]], stored)
    assert set(np.abs(stored.astype(np.float32)).ravel()) == {65504.0}
    assert np.isfinite(together).all()
    assert_close(together, ref, attention_bound(pool, *tables(batch), q, 4, 64, 0.125))
    for t in range(7):
        table, slot = [np.array([0, 1])], batch.slots[t : t + 1]
        alone = AttentionBatch(batch.kv, np.array([0, 1]), np.array([9 + t]), table, slot)
        at = slice(t, t + 1)
        got = attend(alone, positions[at].copy(), q[at], k[at], v[at], *geometry, 2)
        assert np.array_equal(got, together[at]), t


def test_a_nan_key_or_value_reaches_the_queries_that_attend_it():
    """A NaN in a step's key and in a later token's value (q8_0 pages): the kernel stores
    them as numpy's ``PagePool.write`` does (the block's scale NaN), and the queries that
    attend them get NaN, as the reference's do, where the kernel's block maximum and its
    exp's clamp once dropped a NaN (finite answers, so the engine's check of the logits
    never saw it); a query before both, and the other sequence, get the bits they get
    without them. (The reference also turns the first query's heads of the
    value's group NaN: it weighs a key past a query by 0, and 0 x NaN is NaN.)"""
    seqs = [([3, 7, 1], 40, 5), ([5, 9], 17, 1)]  # seq 0's step: positions 35..39
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0)
    group = HEADS // KV_HEADS
    _, batch, positions, q, k, v = ragged_step("q8_0", seqs)
    clean = attend(batch, positions, q, k, v, *geometry, 2)
    pool, batch, positions, q, k, v = ragged_step("q8_0", seqs)
    k[1, 3], v[4, HEAD_DIM + 10] = np.nan, np.nan  # position 36's kv head 0; 39's head 1
    ref = np.zeros_like(q)
    cpu_ops.attention(ref, q, k, v, positions, batch, 0, *geometry)
    ours, batch, *_ = ragged_step("q8_0", seqs)
    batch.kv = ours.storage
    out = attend(batch, positions, q, k, v, *geometry, 2)
    for a, b in zip(*[(*p.storage.k, *p.storage.v, *p.storage.k_scale, *p.storage.v_scale)
                      for p in (ours, pool)], strict=True):  # fmt: skip
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    heads = out.reshape(len(out), HEADS, HEAD_DIM)
    key_group, value_group = slice(0, group), slice(group, 2 * group)
    assert np.isnan(heads[1:5, key_group]).all()  # positions 36..39 attend the NaN key
    assert np.isnan(ref.reshape(heads.shape)[1:5, key_group]).all()
    assert np.isnan(heads[4, value_group]).any(axis=-1).all()  # 39 weighs the NaN value
    assert np.array_equal(out[0], clean[0])  # position 35 attends neither
    assert np.array_equal(out[5], clean[5])  # nor does the other sequence


@pytest.mark.parametrize("backend", VECTOR_BACKENDS, ids=lambda b: b.name)
def test_tiles_on_every_backend_compute_the_same(backend: backends.Backend):
    """The tiles' walk, like the rest of the program, lowers to the same float order on
    every backend and twin: a step of tiles bitwise the selected backend's, on one thread
    (``run``) and on two (``items`` and ``tiles`` split over the pool)."""
    geometry = (8, 2, 32, 0.3, 0)
    _, batch, positions, q, k, v = ragged_step("f16", TILED, 4, 8, 2, 32, n_pages=24)
    expected = attend(batch, positions, q, k, v, *geometry, 2)
    for threads in (1, 2):
        _, batch, *_ = ragged_step("f16", TILED, 4, 8, 2, 32, n_pages=24)
        out = attend(batch, positions, q, k, v, *geometry, threads, backend=runnable(backend))
        assert np.array_equal(out, expected)


def test_a_plan_kept_for_a_token_count_runs_any_step_of_that_count():
    """The executor keeps a step's native records while its token count stays: a plan made
    for a prompt of 16 (two tiles) runs a step of 16 other tokens (a tile and 8 alone)
    exactly as that step's own plan does, the kernels taking each step's work from its
    block."""
    from dynalm.core import pool as native

    seqs = [([0], 16, 16), ([1, 2, 3], 40, 11), ([4], 5, 5)]
    kv_pool, batch, positions, q, k, v = ragged_step("f16", seqs, 6)
    geometry = (HEADS, KV_HEADS, HEAD_DIM, 0.125, 0, 2)

    def part(rows: slice, at: slice) -> tuple:
        starts = batch.query_start[at.start : at.stop + 1] - rows.start
        sub = AttentionBatch(
            kv_pool.storage, starts, batch.seq_lens[at], batch.page_tables[at], batch.slots[rows]
        )
        return sub, positions[rows].copy(), q[rows], k[rows], v[rows]

    steps = [part(slice(0, 16), slice(0, 1)), part(slice(16, 32), slice(1, 3))]
    expected = [attend(*step, *geometry) for step in steps]
    layout = StepLayout()
    buffers = [
        np.zeros((16, w), np.float32) for w in (q.shape[1], q.shape[1], k.shape[1], k.shape[1])
    ]
    out, *qkv = buffers
    att = PagedAttention(layout, 0, *geometry, out, *qkv)
    program = None
    for (sub, at, *values), want in zip(steps, expected, strict=True):
        layout.set(sub, at)
        for buffer, x in zip(qkv, values, strict=True):
            buffer[:] = x
        program = program or native.Program(att.records(), 2)
        program()
        assert np.array_equal(out, want)
