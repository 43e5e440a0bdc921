"""Sentence embeddings from an embedding model (a family whose graph's output is
``embeddings``: ``bert.lum``, or a decoder family's file with a pooling type), for
``dynalm embed`` and ``POST /v1/embeddings``.

An encoder step needs no KV cache: its attention sees only the step's own tokens, each
sequence attending within itself. A decoder's causal attention reads its keys and values
from a KV pool: a scratch pool of one step's tokens, overwritten by the next step (nothing
is kept after a request). The inputs are packed whole, one after another, into steps of at
most ``max_tokens`` tokens (no padding; a longer input is a step alone); ``logit_rows``
holds each sequence's last row, where the graph's attention and pooling find the
sequences' bounds.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np

from dynalm.core.device import Device
from dynalm.core.devices import select_device
from dynalm.core.kv_storage import AttentionBatch, KVGeometry
from dynalm.errors import InvalidRequest, QueueFull, UnsupportedModel
from dynalm.ir.executor import Executor
from dynalm.ir.lower import unsupported
from dynalm.models.loader import LoadedModel

OUTPUT = "embeddings"  # the graph output an embedding model has
# The longest input embedded: a step holds a whole input, so the buffers are sized by it
# (encoders are trained for 512 to 8192 positions; a file claiming millions is not believed).
MAX_LENGTH = 8192
# A step's token budget while generation runs beside (``beside``): a step holds the kernels'
# worker pool, which the generation steps share, for its whole length, so a decode step
# waits for at most one such step (SmolLM2-135M on 2 shared cores: ~0.1-0.2 s for 64 tokens,
# ~1 s for 512; benchmarks/embed_concurrency.py --beside-generation).
BESIDE_TOKENS = 64


def is_embedding_model(model: LoadedModel) -> bool:
    return OUTPUT in model.graph.outputs


def _scratch_kv(model: LoadedModel, tokens: int) -> KVGeometry:
    """A step's KV pool: none for an encoder; for a decoder, f32 (as exact as the
    activations) slots for the step's ``tokens``, one slot a page."""
    if not any(n.op == "attention" for n in model.graph.nodes):
        return KVGeometry(0, 1, 1, 1, tokens, "f32")
    hp = model.hparams
    return KVGeometry(hp.n_layers, hp.n_kv_heads, hp.head_dim, tokens, 1, "f32")


def _capacity(model: LoadedModel, max_tokens: int) -> int:
    """The tokens a step's buffers hold: the budget, or one input of the maximum length."""
    return max(max_tokens, min(model.hparams.n_ctx_train, MAX_LENGTH))


def scratch_bytes(model: LoadedModel, max_tokens: int = 512) -> int:
    """The bytes of the scratch KV pool an ``Embedder(model, max_tokens=...)`` allocates
    (none for an encoder; a decoder's f32 slots for a step of the maximum length: ~380 MB for
    SmolLM2-135M's 8192), which a server's memory budget counts beside the weights."""
    kv = _scratch_kv(model, _capacity(model, max_tokens))
    return sum(
        layers * math.prod(shape) * np.dtype(dtype).itemsize
        for layers, shape, dtype in kv.arrays().values()
    )


class _Job:
    """One request's inputs, its vectors as they come and the future that hands them over."""

    def __init__(self, inputs: list[Sequence[int]], out: np.ndarray) -> None:
        self.inputs, self.out, self.left = inputs, out, len(inputs)
        self.future: Future[np.ndarray] = Future()


class Embedder:
    """One embedding model bound to a device; ``embed`` and ``submit`` are safe to call
    from many threads: one worker thread runs the steps, packing the inputs of all the
    requests waiting into each."""

    def __init__(
        self,
        model: LoadedModel,
        device: Device | None = None,
        *,
        backend: str = "auto",
        mode: str = "auto",
        threads: int | None = None,
        max_tokens: int = 512,
        beside: Callable[[], bool] | None = None,
    ) -> None:
        if not is_embedding_model(model):
            raise UnsupportedModel(
                f"{model.name} is a generation model ({model.hparams.arch}); it has no "
                "embedding output (--pooling last or mean embeds with its hidden states)"
            )
        self.model = model
        self.max_length = min(model.hparams.n_ctx_train, MAX_LENGTH)  # position table's rows
        self.dimensions = model.graph.outputs[OUTPUT].type.shape[1]
        self.device = device or select_device(
            backend, mode, threads, unsupported=lambda d: unsupported(d, model.graph)
        )
        # A step's token budget: what it packs, as the engine's max_num_batched_tokens (a
        # step holds the kernels' worker pool, which a generation model's steps share, for
        # its whole length); the buffers hold one input of the maximum length, run alone.
        self.max_tokens = max_tokens
        capacity = _capacity(model, max_tokens)
        self._executor = Executor(model.graph, self.device, model.weights, capacity)
        self._kv = self.device.kv_storage(_scratch_kv(model, capacity))
        # whether generation runs on the same device now: the steps then yield to it
        self.beside = beside or (lambda: False)
        self._queue: deque[tuple[_Job, int]] = deque()  # inputs waiting: (request, index)
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def tokenize(self, text: str, index: int = 0, truncate: bool = False) -> list[int]:
        """``[CLS] text [SEP]`` as ids; longer than the model's maximum length: cut to it
        (keeping ``[SEP]``) when ``truncate``, else an ``InvalidRequest`` naming ``index``."""
        if not text:  # [CLS] [SEP] alone: a vector of no text, which no caller means
            raise InvalidRequest(f"input[{index}] is an empty string: there is no text to embed")
        return self.check(self.model.tokenizer.encode(text), index, truncate)

    def check(self, ids: list[int], index: int = 0, truncate: bool = False) -> list[int]:
        """``ids`` checked as one input (``index``-th of a request): not empty, every id in
        the vocabulary, at most the maximum length (or cut to it when ``truncate``)."""
        n_vocab = self.model.hparams.n_vocab
        if not ids:
            raise InvalidRequest(f"input[{index}] is empty: it has no tokens to embed")
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"input[{index}]: token id {bad} is outside the vocabulary [0, {n_vocab - 1}]"
            )
        if len(ids) > self.max_length:
            if not truncate:
                raise InvalidRequest(
                    f"input[{index}] has {len(ids)} tokens, more than the model's maximum "
                    f"length {self.max_length} (ask for truncate to cut it)"
                )
            tail = [ids[-1]] if ids[-1] == self.model.tokenizer.eos_id else []
            ids = ids[: self.max_length - len(tail)] + tail
        return ids

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One vector per input of checked ids (``check``): ``[len(inputs), dimensions]``,
        float32, L2-normalised as the model's graph does."""
        return self.submit(inputs).result()

    def submit(self, inputs: Sequence[Sequence[int]]) -> Future[np.ndarray]:
        """``embed``'s vectors, later: the inputs join the queue that the worker thread packs
        into steps of at most ``max_tokens`` tokens, with those of every other request
        waiting, first come first served (as the engine's scheduler drains its queue)."""
        job = _Job(list(inputs), np.empty((len(inputs), self.dimensions), np.float32))
        if not inputs:
            job.future.set_result(job.out)
            return job.future
        with self._wake:
            if self._closed:
                raise QueueFull(f"the embedding model {self.model.name} is shutting down")
            self._queue.extend((job, i) for i in range(len(inputs)))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="embedder", daemon=True)
                self._worker.start()
            self._wake.notify()
        return job.future

    def close(self, drain: bool = True) -> None:
        """Stop the worker thread: once the queue is empty (``drain``), else after the step
        running now, the inputs still waiting failing their requests with ``QueueFull``
        (a 503: a server shutting down, its clients may retry elsewhere)."""
        with self._wake:
            self._closed = True
            if not drain:
                gone = QueueFull(f"the embedding model {self.model.name} is shutting down")
                for job, _ in self._queue:
                    _settle(job.future, Future.set_exception, gone)
                self._queue.clear()
            self._wake.notify()
        if self._worker is not None:
            self._worker.join()

    def _work(self) -> None:
        """Steps while inputs wait. While generation runs beside (``beside()``), a step
        packs at most ``BESIDE_TOKENS`` and is followed by a pause as long as itself: the
        generation steps get the device at least half the time, and wait for at most one
        short embedding step, instead of an embedding request's steps back to back."""
        while (step := self._next_step()) is not None:
            started = time.perf_counter()
            try:
                vectors = self._step([list(job.inputs[i]) for job, i in step])
            except BaseException as e:  # noqa: BLE001 - handed to each waiting request
                for job, _ in step:
                    _settle(job.future, Future.set_exception, e)
                continue
            for (job, i), v in zip(step, vectors, strict=True):
                job.out[i] = v
                job.left -= 1
                if job.left == 0:
                    _settle(job.future, Future.set_result, job.out)
            if self.beside():
                time.sleep(time.perf_counter() - started)

    def _next_step(self) -> list[tuple[_Job, int]] | None:
        """The inputs of the next step from the queue's head: as many as fit in the budget
        (``max_tokens``, or ``BESIDE_TOKENS`` beside generation; at least one, however
        long), those of requests already failed or cancelled dropped; None once closed with
        the queue empty."""
        with self._wake:
            while True:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return None
                step: list[tuple[_Job, int]] = []
                total = 0
                budget = min(self.max_tokens, BESIDE_TOKENS) if self.beside() else self.max_tokens
                while self._queue:
                    job, i = self._queue[0]
                    n = len(job.inputs[i])
                    if step and total + n > budget:
                        break
                    self._queue.popleft()
                    if not job.future.done():
                        step.append((job, i))
                        total += n
                if step:
                    return step

    def _step(self, seqs: list[list[int]]) -> np.ndarray:
        lengths = np.array([len(s) for s in seqs], np.int64)
        tokens = np.concatenate([np.asarray(s, np.int64) for s in seqs])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        batch = AttentionBatch(
            self._kv,
            query_start=starts,
            seq_lens=lengths,
            # pages of one slot: sequence s owns the step's rows starts[s]:starts[s + 1]
            page_tables=[np.arange(starts[s], starts[s + 1]) for s in range(len(seqs))],
            slots=np.arange(len(tokens), dtype=np.int64),
        )
        return self._executor.run(tokens, positions, starts[1:] - 1, batch).copy()


def _settle(future: Future[np.ndarray], how: Callable[..., None], value: object) -> None:
    """``how(future, value)`` unless the future is done already: failed by an earlier step,
    or cancelled meanwhile by its caller (``asyncio.wrap_future`` cancels it from the event
    loop's thread when the client goes away), which must not end the worker thread."""
    with contextlib.suppress(InvalidStateError):
        how(future, value)
