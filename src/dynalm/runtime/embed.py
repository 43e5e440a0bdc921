"""Sentence embeddings from an encoder model (a family whose graph's output is
``embeddings``: ``bert.lum``), for ``dynalm embed`` and ``POST /v1/embeddings``; and
relevance scores from a reranker (a cross-encoder: the same family with a classification
head, whose output is ``scores``), for ``dynalm rerank`` and ``POST /v1/rerank``.

An encoder step needs no KV cache: its attention sees only the step's own tokens, each
sequence attending within itself. The inputs are packed whole, one after another, into
steps of at most ``max_tokens`` tokens (no padding); ``logit_rows`` holds each sequence's
last row, where the graph's attention and pooling find the sequences' bounds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from dynalm.core.device import Device
from dynalm.core.devices import select_device
from dynalm.core.kv_storage import AttentionBatch, HostKVStorage, KVGeometry
from dynalm.errors import InvalidRequest, UnsupportedModel
from dynalm.ir.executor import Executor
from dynalm.ir.lower import unsupported
from dynalm.models.hf_dir import MAX_LENGTH_KEY
from dynalm.models.loader import LoadedModel
from dynalm.models.metadata import integer

OUTPUT = "embeddings"  # the graph output an embedding model has
SCORES = "scores"  # a reranker's: one logit per label for each [CLS] query [SEP] doc [SEP]
# The longest input embedded: a step holds a whole input, so the buffers are sized by it
# (encoders are trained for 512 to 8192 positions; a file claiming millions is not believed).
MAX_LENGTH = 8192


def is_embedding_model(model: LoadedModel) -> bool:
    return OUTPUT in model.graph.outputs


def is_reranker(model: LoadedModel) -> bool:
    return SCORES in model.graph.outputs


def model_kind(model: LoadedModel) -> str:
    """What a model is, as a refusal names it."""
    if is_reranker(model):
        return "a reranker"
    return "an embedding model" if is_embedding_model(model) else "a generation model"


class Embedder:
    """One encoder model bound to a device; ``embed`` is safe to call from many threads
    (the steps run one at a time)."""

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
    ) -> None:
        if self.output not in model.graph.outputs:
            raise UnsupportedModel(
                f"{model.name} is {model_kind(model)} ({model.hparams.arch}); it has no "
                f"{self.needs}"
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
        self.max_tokens = max(max_tokens, self.max_length)
        self._executor = Executor(model.graph, self.device, model.weights, self.max_tokens)
        self._kv = HostKVStorage(KVGeometry(0, 1, 1, 1, self.max_tokens, "f32"))
        self._lock = threading.Lock()

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
        out = np.empty((len(inputs), self.dimensions), np.float32)
        start = 0
        with self._lock:
            while start < len(inputs):
                end, total = start, 0
                while end < len(inputs) and total + len(inputs[end]) <= self.max_tokens:
                    total += len(inputs[end])
                    end += 1
                out[start:end] = self._step(
                    [list(s) for s in inputs[start:end]],
                    None if types is None else types[start:end],
                )
                start = end
        return out

    def _step(self, seqs: list[list[int]], types: Sequence[Sequence[int]] | None) -> np.ndarray:
        lengths = np.array([len(s) for s in seqs], np.int64)
        tokens = np.concatenate([np.asarray(s, np.int64) for s in seqs])
        extra = {} if types is None else {"token_types": np.concatenate(types, dtype=np.int64)}
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        batch = AttentionBatch(
            self._kv,
            query_start=starts,
            seq_lens=lengths,
            page_tables=[np.zeros(1, np.int64)] * len(seqs),
            slots=np.arange(len(tokens), dtype=np.int64),
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
