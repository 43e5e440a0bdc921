"""Sentence embeddings from an embedding model (a family whose graph's output is
``embeddings``: ``bert.lum``, or a decoder family's file with a pooling type), for
``dynalm embed`` and ``POST /v1/embeddings``; and relevance scores from a reranker (a
cross-encoder: an encoder family with a classification head, whose output is ``scores``),
for ``dynalm rerank`` and ``POST /v1/rerank``.

An encoder step needs no KV cache: its attention sees only the step's own tokens, each
sequence attending within itself. A decoder's causal attention reads its keys and values
from a KV pool: a scratch pool of one step's tokens, overwritten by the next step (nothing
is kept after a request). The inputs are packed whole, one after another, into steps of at
most ``max_tokens`` tokens (no padding; a longer input is a step alone, or, for a decoder
that pools its last token, steps of chunks of it, its keys and values kept); ``logit_rows``
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
from typing import Protocol

import numpy as np

from dynalm.core.device import Device
from dynalm.core.devices import select_device
from dynalm.core.kv_storage import AttentionBatch, KVGeometry
from dynalm.errors import InvalidRequest, QueueFull, UnsupportedModel
from dynalm.ir.executor import Executor
from dynalm.ir.lower import unsupported
from dynalm.models.hf_dir import MAX_LENGTH_KEY
from dynalm.models.loader import LoadedModel
from dynalm.models.metadata import integer

OUTPUT = "embeddings"  # the graph output an embedding model has
LAST = 3  # the pool op's mode (llama.cpp's pooling type) that reads a sequence's last row
SCORES = "scores"  # a reranker's: one logit per label for each [CLS] query [SEP] doc [SEP]
# The longest input embedded: a step holds a whole input, so the buffers are sized by it
# (encoders are trained for 512 to 8192 positions; a file claiming millions is not believed).
MAX_LENGTH = 8192
# A step's token budget while a generation model is served beside (``Generation``): a step
# holds the kernels' worker pool, which the generation steps share, for its whole length, so
# a decode step, or a new request's first, waits for at most one such step (SmolLM2-135M on 2
# shared cores: ~0.1-0.2 s for 64 tokens, 1-2.6 s for 512; benchmarks/embed_concurrency.py
# --beside-generation and --ttft).
BESIDE_TOKENS = 64
# The longest a step waits for generation's prompts (``prefilling``) to be computed first:
# a stream of new prompts delays embeddings, never stops them.
PREFILL_WAIT_S = 1.0


class Generation(Protocol):
    """The generation models served beside an embedder (a server's `ModelManager`), which its
    steps yield to; asked from the worker thread before each step."""

    def generation_loaded(self) -> bool:
        """Whether one is loaded: steps pack at most ``BESIDE_TOKENS``."""
        ...

    def generating(self) -> bool:
        """Whether one has requests: each step is followed by a pause as long as itself."""
        ...

    def wait_prefilled(self, timeout: float) -> bool:
        """Block until no prompt waits to be computed (the next step waits for them first),
        at most ``timeout`` seconds, woken when their steps have run; whether it happened."""
        ...


class _Alone:
    """No generation beside."""

    def generation_loaded(self) -> bool:
        return False

    generating = generation_loaded

    def wait_prefilled(self, timeout: float) -> bool:
        return True


def is_embedding_model(model: LoadedModel) -> bool:
    return OUTPUT in model.graph.outputs


def is_reranker(model: LoadedModel) -> bool:
    return SCORES in model.graph.outputs


def model_kind(model: LoadedModel) -> str:
    """What a model is, as a refusal names it."""
    if is_reranker(model):
        return "a reranker"
    return "an embedding model" if is_embedding_model(model) else "a generation model"


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
    """One request's inputs (and their token types, if given), its vectors as they come, the
    future that hands them over, and how many of its inputs are still queued."""

    def __init__(
        self, inputs: list[Sequence[int]], types: list[Sequence[int]] | None, out: np.ndarray
    ) -> None:
        self.inputs, self.types, self.out, self.left = inputs, types, out, len(inputs)
        self.queued = len(inputs)
        self.future: Future[np.ndarray] = Future()

    def type_ids(self, i: int) -> Sequence[int]:
        return [0] * len(self.inputs[i]) if self.types is None else self.types[i]


class Embedder:
    """One embedding model bound to a device; ``embed`` and ``submit`` are safe to call
    from many threads: one worker thread runs the steps, packing the inputs of all the
    requests waiting into each."""

    output = OUTPUT  # the graph output it reads
    needs = "embedding output"

    def __init__(
        self,
        model: LoadedModel,
        device: Device | None = None,
        *,
        backend: str = "auto",
        mode: str = "auto",
        threads: int | None = None,
        max_tokens: int = 512,
        max_queue: int = 256,
        beside: Generation | None = None,
    ) -> None:
        if self.output not in model.graph.outputs:
            kind = model_kind(model)
            hint = (  # a decoder embeds with its hidden states when asked to
                " (--pooling last or mean embeds with its hidden states)"
                if self.output == OUTPUT and kind == "a generation model"
                else ""
            )
            raise UnsupportedModel(
                f"{model.name} is {kind} ({model.hparams.arch}); it has no {self.needs}{hint}"
            )
        self.model = model
        # the position table's rows, or less where the model was trained shorter
        # (sentence-transformers' max_seq_length)
        limit = min(model.hparams.n_ctx_train, MAX_LENGTH)
        self.max_length = integer(model.gguf.metadata, MAX_LENGTH_KEY, limit, lo=1, hi=limit)
        self.dimensions = model.graph.outputs[self.output].type.shape[1]
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
        # a decoder that pools the last token embeds an input longer than a step's budget in
        # chunks of it, as the engine's prefill: its keys and values stay in the scratch pool
        # (an encoder, or a mean, needs the whole input in one step)
        self._chunks = _scratch_kv(model, 1).n_layers > 0 and any(
            n.op == "pool" and n.attrs["mode"] == LAST for n in model.graph.nodes
        )
        self._at = 0  # the queue's head input's tokens computed by earlier chunks
        self.beside = beside or _Alone()  # generation on the same device, yielded to
        self.max_queue = max_queue  # most requests waiting (as the engine's --max-queue)
        self.waiting = 0  # requests with inputs in the queue
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

    def embed(
        self, inputs: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None = None
    ) -> np.ndarray:
        """One vector per input of checked ids (``check``): ``[len(inputs), dimensions]``,
        float32, L2-normalised as the model's graph does (a reranker's: its scores).
        ``types``: each input's token types (sentence A 0, B 1), else all 0."""
        return self.submit(inputs, types).result()

    def submit(
        self, inputs: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None = None
    ) -> Future[np.ndarray]:
        """``embed``'s vectors, later: the inputs join the queue that the worker thread packs
        into steps of at most ``max_tokens`` tokens, with those of every other request
        waiting, first come first served (as the engine's scheduler drains its queue).
        Raises QueueFull (a 503) when ``max_queue`` requests are waiting already."""
        out = np.empty((len(inputs), self.dimensions), np.float32)
        job = _Job(list(inputs), None if types is None else list(types), out)
        if not inputs:
            job.future.set_result(job.out)
            return job.future
        with self._wake:
            if self._closed:
                raise QueueFull(f"the embedding model {self.model.name} is shutting down")
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting; retry later")
            self.waiting += 1
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
                self.waiting, self._at = 0, 0
            self._wake.notify()
        if self._worker is not None:
            self._worker.join()

    def _work(self) -> None:
        """Steps while inputs wait. While generation runs beside (``beside.generating()``),
        a step is followed by a pause as long as itself: the generation steps get the device
        at least half the time, and wait for at most one short embedding step, instead of an
        embedding request's steps back to back. A step's first input may go on from
        ``first`` (its earlier chunks), and end at ``end`` (a chunk: no vector yet)."""
        while (taken := self._next_step()) is not None:
            step, first, end = taken
            started = time.perf_counter()
            cut = [slice(first, end)] + [slice(None)] * (len(step) - 1)
            try:
                vectors = self._step(
                    [list(job.inputs[i][c]) for (job, i), c in zip(step, cut, strict=True)],
                    None  # all 0, unless an input of the step has types
                    if all(job.types is None for job, _ in step)
                    else [job.type_ids(i)[c] for (job, i), c in zip(step, cut, strict=True)],
                    first,
                )
            except BaseException as e:  # noqa: BLE001 - handed to each waiting request
                for job, _ in step:
                    _settle(job.future, Future.set_exception, e)
                continue
            done = step if end is None else []  # a chunk's input: its vector with the last
            for (job, i), v in zip(done, vectors[: len(done)], strict=True):
                job.out[i] = v
                job.left -= 1
                if job.left == 0:
                    _settle(job.future, Future.set_result, job.out)
            if self.beside.generating():
                time.sleep(time.perf_counter() - started)

    def _next_step(self) -> tuple[list[tuple[_Job, int]], int, int | None] | None:
        """The inputs of the next step from the queue's head, once no generation prompt
        waits to be computed (``beside.wait_prefilled``, at most ``PREFILL_WAIT_S``): as many
        as fit in the budget (``max_tokens``, or ``BESIDE_TOKENS`` beside a generation model;
        at least one; one longer, alone, or in chunks of the budget where ``_chunks``), those
        of requests already failed or cancelled dropped; and where the first input goes on
        from and ends (None: its end). None once closed with the queue empty."""
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return None
            # outside the queue's lock: submits still come in meanwhile
            self.beside.wait_prefilled(PREFILL_WAIT_S)
            with self._wake:
                step: list[tuple[_Job, int]] = []
                total = first = 0
                short = self.beside.generation_loaded()
                budget = min(self.max_tokens, BESIDE_TOKENS) if short else self.max_tokens
                while self._queue:
                    job, i = self._queue[0]
                    at = self._at  # (the head's alone)
                    n = len(job.inputs[i]) - at
                    if step and (first or total + n > budget):  # a last chunk is alone
                        break
                    if self._chunks and n > budget and not job.future.done():
                        self._at += budget  # a chunk, alone: the input stays at the head
                        return [(job, i)], at, self._at
                    self._queue.popleft()
                    self._at = 0
                    job.queued -= 1
                    if job.queued == 0:
                        self.waiting -= 1
                    if not job.future.done():
                        first = first if step else at
                        step.append((job, i))
                        total += n
                if step:
                    return step, first, None

    def _step(
        self, seqs: list[list[int]], types: Sequence[Sequence[int]] | None, first: int = 0
    ) -> np.ndarray:
        """The vectors of ``seqs``; ``first``: the position a step of one input goes on from
        (a decoder's input in chunks: the keys and values of the earlier ones in slots
        0..first)."""
        lengths = np.array([len(s) for s in seqs], np.int64)
        tokens = np.concatenate([np.asarray(s, np.int64) for s in seqs])
        extra = {} if types is None else {"token_types": np.concatenate(types, dtype=np.int64)}
        positions = first + np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        batch = AttentionBatch(
            self._kv,
            query_start=starts,
            seq_lens=first + lengths,
            # pages of one slot: sequence s owns the step's rows starts[s]:starts[s + 1]
            page_tables=[np.arange(starts[s], first + starts[s + 1]) for s in range(len(seqs))],
            slots=np.arange(first, first + len(tokens), dtype=np.int64),
        )
        return self._executor.run(tokens, positions, starts[1:] - 1, batch, extra).copy()


class Reranker(Embedder):
    """A cross-encoder: each (query, document) pair read as ``[CLS] query [SEP] document
    [SEP]`` (token types 0 then 1, as transformers' BERT tokenizer gives a pair), scored by
    the model's classification head."""

    output = SCORES
    needs = "classification head (it is no reranker)"

    def __init__(self, model: LoadedModel, device: Device | None = None, **kwargs) -> None:
        super().__init__(model, device, **kwargs)
        if self.dimensions != 1:
            raise UnsupportedModel(
                f"{model.name}'s classification head has {self.dimensions} labels; a reranker "
                "gives one score (1 label)"
            )
        # a table of one row (type_vocab_size 1, as XLM-RoBERTa's) has no sentence B
        shape = model.gguf.tensors.get("token_types.weight")
        self.type_b = 1 if shape is not None and shape.shape[0] >= 2 else 0

    def pairs(
        self, query: str, documents: Sequence[str], truncate: bool = False
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Each document paired with ``query``: the ids and token types of each pair. A pair
        longer than the maximum length: its document is cut to fit when ``truncate``, else
        an ``InvalidRequest`` naming the document's index."""
        if not query:
            raise InvalidRequest("query is an empty string: there is nothing to rank against")
        tok = self.model.tokenizer
        head = tok.encode(query)  # [CLS] query [SEP]
        sep = [] if tok.eos_id is None else [tok.eos_id]
        room = self.max_length - len(head) - len(sep)  # for a document's own tokens
        if room < 1:
            raise InvalidRequest(
                f"query has {len(head)} tokens, which leaves no room for a document within "
                f"the model's maximum length {self.max_length}"
            )
        ids, types = [], []
        for i, doc in enumerate(documents):
            if not doc:
                raise InvalidRequest(f"documents[{i}] is an empty string: there is no text to rank")
            body = tok.encode(doc, add_special=False)
            if len(body) > room:
                if not truncate:
                    raise InvalidRequest(
                        f"documents[{i}] with the query has {len(head) + len(body) + len(sep)} "
                        f"tokens, more than the model's maximum length {self.max_length} (ask "
                        "for truncate to cut the document)"
                    )
                body = body[:room]
            tail = body + sep
            ids.append(head + tail)  # the tokenizer's ids: in the vocabulary
            types.append([0] * len(head) + [self.type_b] * len(tail))
        return ids, types

    def score(self, query: str, documents: Sequence[str], truncate: bool = False) -> np.ndarray:
        """The head's logit for each document (float32 ``[len(documents)]``)."""
        ids, types = self.pairs(query, documents, truncate)
        return self.embed(ids, types)[:, 0]


def relevance(logit: float) -> float:
    """A reranker's relevance score: the sigmoid of its logit, in [0, 1] (as vLLM,
    sentence-transformers' CrossEncoder, Cohere and Jina give it; llama-server gives the
    logit). It saturates at 1 for logits past ~37, so results are ordered by the logit."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    e = math.exp(logit)  # no overflow for a very negative logit
    return e / (1.0 + e)


def _settle(future: Future[np.ndarray], how: Callable[..., None], value: object) -> None:
    """``how(future, value)`` unless the future is done already: failed by an earlier step,
    or cancelled meanwhile by its caller (``asyncio.wrap_future`` cancels it from the event
    loop's thread when the client goes away), which must not end the worker thread."""
    with contextlib.suppress(InvalidStateError):
        how(future, value)
