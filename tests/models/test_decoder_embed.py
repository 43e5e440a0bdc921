"""Decoder models embed (Qwen3-Embedding style): a tiny random-weight decoder written as
llama.cpp writes it (`tiny_models.write_gguf`) with ``{arch}.pooling_type`` is an embedding
model; its vectors are the final norm's hidden states pooled (last token or mean) and
L2-normalised, against transformers' ``last_hidden_state`` (which the final norm ends).
The same family file serves both kinds (``pooling_type == 0``: logits), and ``--pooling``
makes any decoder embed."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tiny_models
from gguf import PoolingType
from tiny_models import reference_embeddings
from transformers import PreTrainedModel

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import QueueFull, UnsupportedModel
from dynalm.ir.lumen.tree import LumenError
from dynalm.models.loader import load_model
from dynalm.runtime import embed as embed_module
from dynalm.runtime.embed import Embedder
from dynalm.runtime.engine.engine import Engine

TEXTS = ["Hello world!", "the cat sat on the mat.", "x", "Embeddings, dog? " * 4, "tail"]
MIN_COSINE = {"exact": 0.99999, "auto": 0.999}  # the bounds
CASES = [("qwen3", PoolingType.LAST), ("llama", PoolingType.MEAN)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1].name.lower()}")
def case(request, tmp_path_factory) -> tuple[PreTrainedModel, Path, PoolingType]:
    family, pooling = request.param
    spec = tiny_models.SPECS[family]
    reference = tiny_models.reference_model(spec)
    path = tmp_path_factory.mktemp("dec") / f"{family}-embed.gguf"
    tiny_models.write_gguf(reference, spec, path, pooling_type=pooling)
    return reference, path, pooling


@pytest.mark.parametrize("mode", sorted(MIN_COSINE))
def test_decoder_embeddings_match_transformers(case, mode: str) -> None:
    reference, path, pooling = case
    model = load_model(path)
    assert list(model.graph.outputs) == ["embeddings"]  # no head: no logits
    embedder = Embedder(model, backend="cpu", mode=mode)
    ids = [embedder.tokenize(t, i) for i, t in enumerate(TEXTS)]
    got = embedder.embed(ids)
    want = reference_embeddings(reference, ids, pooling)
    assert got.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosines = (got * want).sum(1)
    assert cosines.min() >= MIN_COSINE[mode], cosines


def test_packed_steps_equal_one_at_a_time(case) -> None:
    """Inputs packed into one step (their KV in one scratch pool, each attending to its own
    rows only), or split across steps, give the vectors each gives alone (to rounding: a
    step's size picks the matmul kernel, hence the summation order)."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact", max_tokens=40)
    ids = [embedder.tokenize(t, i) for i, t in enumerate(TEXTS)]  # 68 tokens: two steps
    alone = np.concatenate([embedder.embed([s]) for s in ids])
    np.testing.assert_allclose(embedder.embed(ids), alone, atol=1e-6)
    np.testing.assert_allclose(embedder.embed(ids[::-1]), alone[::-1], atol=1e-6)


def test_pooling_flag_makes_a_generation_model_embed(case, tmp_path: Path) -> None:
    """``--pooling`` (load_model's ``pooling``) on the plain file gives the vectors of the
    file that carries the key; without it the plain file is a generation model."""
    reference, path, pooling = case
    family = tiny_models.SPECS[path.stem.split("-")[0]]
    plain = tiny_models.write_gguf(reference, family, tmp_path / "plain.gguf")
    with pytest.raises(UnsupportedModel, match=r"is a generation model .*--pooling last"):
        Embedder(load_model(plain), backend="cpu")
    ids = [[5, 6, 7], [256, 40, 41, 42, 43]]
    flagged = Embedder(load_model(plain, int(pooling)), backend="cpu", mode="exact")
    keyed = Embedder(load_model(path), backend="cpu", mode="exact")
    np.testing.assert_array_equal(flagged.embed(ids), keyed.embed(ids))


def test_the_engine_refuses_a_decoder_embedding_model(case) -> None:
    _, path, _ = case
    with pytest.raises(UnsupportedModel, match=r"is an embedding model .*cannot generate"):
        Engine(load_model(path), CpuDevice("exact"))


def test_rank_pooling_is_refused_in_the_decoder_file(tmp_path: Path) -> None:
    """llama.cpp's 4 (rank) needs a classifier head a decoder file has not: located error."""
    spec = tiny_models.SPECS["qwen3"]
    path = tiny_models.write_gguf(
        tiny_models.reference_model(spec), spec, tmp_path / "r.gguf", pooling_type=PoolingType.RANK
    )
    with pytest.raises(LumenError, match=r"qwen3\.lum:\d+:\d+: pool\(x, logit_rows, mode = "
                       r"pooling_type\): pooling mode 4 is not one of 1 \(mean\), 2 \(cls\), "
                       r"3 \(last\)"):  # fmt: skip
        load_model(path)


def _gated(embedder: Embedder) -> tuple[list[int], threading.Event]:
    """``embedder``'s steps recorded (inputs per step); the first step waits for ``go``."""
    sizes: list[int] = []
    go, step = threading.Event(), embedder._step

    def gated_step(
        seqs: list[list[int]], types: list[list[int]] | None, first: int = 0
    ) -> np.ndarray:
        go.wait(30)
        sizes.append(len(seqs))
        return step(seqs, types, first)

    embedder._step = gated_step  # type: ignore[method-assign]
    return sizes, go


def _in_gated_step(embedder: Embedder, ids: list[list[int]]):
    """``ids`` submitted and taken by the worker into its first step, which waits for
    ``go``: (their future, the steps' sizes, go)."""
    sizes, go = _gated(embedder)
    future = embedder.submit(ids)
    while embedder._queue:
        threading.Event().wait(0.01)
    return future, sizes, go


def test_requests_waiting_share_a_step(case) -> None:
    """The inputs of requests submitted while a step runs are packed into the next step
    together (not one step each), and get what they get one at a time."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact")
    ids = [embedder.tokenize(t, i) for i, t in enumerate(TEXTS * 3)]
    alone = np.concatenate([embedder.embed([s]) for s in ids])
    sizes, go = _gated(embedder)
    futures = [embedder.submit([s]) for s in ids]  # the first step waits for all of them
    go.set()
    got = np.concatenate([f.result(60) for f in futures])
    # the first step took what was queued when the worker woke (1 or more), the next the rest
    assert len(sizes) <= 2 and sum(sizes) == len(ids), sizes
    np.testing.assert_allclose(got, alone, atol=1e-6)
    embedder.close()


def test_a_failed_step_fails_its_requests_and_the_next_ones_run(case) -> None:
    """A step that raises fails its requests (a long input's other chunks never run) and
    the worker goes on with the next."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact", max_tokens=8)
    step, calls = embedder._step, []

    def failing_once(
        seqs: list[list[int]], types: list[list[int]] | None, first: int = 0
    ) -> np.ndarray:
        calls.append(len(seqs))
        if len(calls) == 1:
            raise MemoryError("out of memory in the step")
        return step(seqs, types, first)

    embedder._step = failing_once  # type: ignore[method-assign]
    with pytest.raises(MemoryError, match="out of memory in the step"):
        embedder.embed([list(range(5, 25))])  # 20 tokens: a chunk of 8, or whole
    alone = Embedder(load_model(path), backend="cpu", mode="exact").embed([[5, 6, 7]])
    np.testing.assert_allclose(embedder.embed([[5, 6, 7]]), alone, atol=1e-6)
    assert calls == [1, 1] and embedder.waiting == 0, calls
    embedder.close()
    with pytest.raises(QueueFull, match="the embedding model .* is shutting down"):
        embedder.submit([[5]])


def test_closing_without_drain_fails_the_waiting_requests(case) -> None:
    """``close(drain=False)`` (a server's shutdown): the step running ends and its request
    gets its vectors; the requests still queued get QueueFull (a 503) at once."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact")
    running, sizes, go = _in_gated_step(embedder, [[5, 6]])
    waiting = embedder.submit([[7, 8]])
    closing = threading.Thread(target=embedder.close, kwargs={"drain": False})
    closing.start()
    with pytest.raises(QueueFull, match="is shutting down"):
        waiting.result(60)
    go.set()
    closing.join(60)
    assert running.result(60).shape == (1, 64) and sizes == [1], sizes


def test_a_cancelled_request_is_not_embedded(case) -> None:
    """A request whose caller went away (its future cancelled: a client that disconnected)
    leaves the queue without a step."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact")
    sizes, go = _gated(embedder)
    go.set()
    with embedder._wake:  # the worker takes none of them before the cancel
        first = embedder.submit([[5, 6]])
        gone = embedder.submit([[7, 8], [9, 10]])
        kept = embedder.submit([[11]])
        assert gone.cancel()
    first.result(60), kept.result(60)
    assert sizes == [2], sizes  # [5, 6] and [11], in one step
    embedder.close()


def test_a_request_cancelled_during_its_step_leaves_the_worker_running(case) -> None:
    """A caller that goes away while its inputs are in a step (the future cancelled from
    another thread): the step's end does not hand it vectors, and the next request is
    answered (the worker thread lives on)."""
    _, path, _ = case
    embedder = Embedder(load_model(path), backend="cpu", mode="exact")
    gone, sizes, go = _in_gated_step(embedder, [[5, 6]])
    assert gone.cancel()
    go.set()
    assert embedder.embed([[7, 8]]).shape == (1, 64)
    assert sizes == [1, 1], sizes
    embedder.close()


def test_the_step_budget_packs_short_inputs_and_runs_a_longer_one_alone(case) -> None:
    """``max_tokens`` is what a step packs, not the longest input: an input longer than it
    (up to the model's maximum length, which the buffers hold) is a step alone - in chunks
    of the budget where the decoder pools its last token, as the engine prefills (causal: a
    chunk's keys and values stay in the scratch pool for the next), so no step is longer;
    mean pooling needs every row in one step - and the short ones after it share one. The
    vectors are those of the whole inputs either way."""
    _, path, pooling = case
    ids = [[5 + i for i in range(n)] for n in (17, 12)] + [[5, 6, 7], [8, 9, 10, 11]]
    alone = np.concatenate([
        Embedder(load_model(path), backend="cpu", mode="exact").embed([s]) for s in ids
    ])  # fmt: skip
    embedder = Embedder(load_model(path), backend="cpu", mode="exact", max_tokens=8)
    assert embedder.max_length > 17
    sizes, go = _gated(embedder)
    go.set()
    np.testing.assert_allclose(embedder.embed(ids), alone, atol=1e-6)
    chunked = [1] * 3 + [1] * 2  # 17 tokens: 8 + 8 + 1; 12: 8 + 4
    assert sizes == (chunked if pooling == PoolingType.LAST else [1, 1]) + [2], sizes
    assert embedder.waiting == 0
    embedder.close()


class Prompt:
    """Whether a prompt waits to be computed: set and cleared by the test; a wait for it to
    clear is woken by ``clear`` (as an engine's step wakes ``wait_prefilled``)."""

    def __init__(self) -> None:
        self._waiting, self._changed = False, threading.Condition()

    def set(self) -> None:
        with self._changed:
            self._waiting = True

    def clear(self) -> None:
        with self._changed:
            self._waiting = False
            self._changed.notify_all()

    def wait_clear(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._waiting, timeout)


class Beside:
    """What the generation models beside an embedder say (``runtime.embed.Generation``, a
    server's ModelManager), set by the test."""

    def __init__(self) -> None:
        self.loaded, self.running, self.prompt = threading.Event(), threading.Event(), Prompt()

    def generation_loaded(self) -> bool:
        return self.loaded.is_set()

    def generating(self) -> bool:
        return self.running.is_set()

    def wait_prefilled(self, timeout: float) -> bool:
        return self.prompt.wait_clear(timeout)


def test_beside_generation_steps_are_short_and_pause(case, monkeypatch) -> None:
    """Beside a generation model, a step packs at most BESIDE_TOKENS (a new request's first
    step waits for one short step at most); while it generates, the worker also pauses as
    long as each step took (the generation steps get the worker pool); alone, the same
    inputs share one step and nothing pauses."""
    _, path, _ = case
    ids = [[5 + (i + k) % 50 for i in range(40)] for k in range(3)]  # 3 x 40 tokens
    beside = Beside()
    embedder = Embedder(load_model(path), backend="cpu", mode="exact", beside=beside)
    sizes, go = _gated(embedder)
    go.set()
    pauses: list[float] = []
    monkeypatch.setattr(embed_module.time, "sleep", pauses.append)
    alone = embedder.embed(ids)
    assert sizes == [3] and pauses == [], (sizes, pauses)
    beside.loaded.set()
    np.testing.assert_allclose(embedder.embed(ids), alone, atol=1e-6)
    assert embed_module.BESIDE_TOKENS < 80
    assert sizes == [3, 1, 1, 1] and pauses == [], (sizes, pauses)
    beside.running.set()
    np.testing.assert_allclose(embedder.embed(ids), alone, atol=1e-6)
    assert sizes == [3, 1, 1, 1, 1, 1, 1] and len(pauses) == 3 and min(pauses) > 0, pauses
    embedder.close()


def test_a_waiting_prompt_delays_the_next_step_not_forever(case, monkeypatch) -> None:
    """While generation has a prompt to compute, no step starts (the request waits, still
    queued); after ``PREFILL_WAIT_S`` a step runs even so: a stream of prompts delays
    embeddings, never stops them."""
    _, path, _ = case
    beside = Beside()
    beside.prompt.set()
    monkeypatch.setattr(embed_module, "PREFILL_WAIT_S", 60.0)
    embedder = Embedder(load_model(path), backend="cpu", mode="exact", beside=beside)
    sizes, go = _gated(embedder)
    go.set()
    future = embedder.submit([[5, 6, 7]])
    assert not future.done() and sizes == [] and embedder.waiting == 1
    beside.prompt.clear()  # computed: the step runs
    assert future.result(60).shape == (1, 64) and sizes == [1]
    monkeypatch.setattr(embed_module, "PREFILL_WAIT_S", 0.05)
    beside.prompt.set()  # never computed: the step runs after the wait
    assert embedder.embed([[8, 9]]).shape == (1, 64) and sizes == [1, 1]
    embedder.close()


def test_scratch_bytes_are_what_the_embedder_allocates(case) -> None:
    """``scratch_bytes`` (what dynalm serve adds to an embedding model's size) is the KV
    pool the Embedder holds: f32 K and V of every layer for a step of the maximum length."""
    _, path, _ = case
    model = load_model(path)
    embedder = Embedder(model, backend="cpu", mode="exact", max_tokens=40)
    hp = model.hparams
    want = hp.n_layers * 2 * hp.n_kv_heads * hp.head_dim * 4 * max(40, embedder.max_length)
    assert embed_module.scratch_bytes(model, 40) == embedder._kv.nbytes == want
