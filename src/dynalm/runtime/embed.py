"""Sentence embeddings from an encoder model (a family whose graph's output is
``embeddings``: ``bert.lum``), for ``dynalm embed`` and ``POST /v1/embeddings``.

An encoder step needs no KV cache: its attention sees only the step's own tokens, each
sequence attending within itself. The inputs are packed whole, one after another, into
steps of at most ``max_tokens`` tokens (no padding); ``logit_rows`` holds each sequence's
last row, where the graph's attention and pooling find the sequences' bounds.
"""

from __future__ import annotations

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
# The longest input embedded: a step holds a whole input, so the buffers are sized by it
# (encoders are trained for 512 to 8192 positions; a file claiming millions is not believed).
MAX_LENGTH = 8192


def is_embedding_model(model: LoadedModel) -> bool:
    return OUTPUT in model.graph.outputs


class Embedder:
    """One encoder model bound to a device; ``embed`` is safe to call from many threads
    (the steps run one at a time)."""

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
        if not is_embedding_model(model):
            raise UnsupportedModel(
                f"{model.name} is a generation model ({model.hparams.arch}); it has no "
                "embedding output"
            )
        self.model = model
        # the position table's rows, or less where the model was trained shorter
        # (sentence-transformers' max_seq_length)
        limit = min(model.hparams.n_ctx_train, MAX_LENGTH)
        self.max_length = integer(model.gguf.metadata, MAX_LENGTH_KEY, limit, lo=1, hi=limit)
        self.dimensions = model.graph.outputs[OUTPUT].type.shape[1]
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

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One vector per input of checked ids (``check``): ``[len(inputs), dimensions]``,
        float32, L2-normalised as the model's graph does."""
        out = np.empty((len(inputs), self.dimensions), np.float32)
        start = 0
        with self._lock:
            while start < len(inputs):
                end, total = start, 0
                while end < len(inputs) and total + len(inputs[end]) <= self.max_tokens:
                    total += len(inputs[end])
                    end += 1
                out[start:end] = self._step([list(s) for s in inputs[start:end]])
                start = end
        return out

    def _step(self, seqs: list[list[int]]) -> np.ndarray:
        lengths = np.array([len(s) for s in seqs], np.int64)
        tokens = np.concatenate([np.asarray(s, np.int64) for s in seqs])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        batch = AttentionBatch(
            self._kv,
            query_start=starts,
            seq_lens=lengths,
            page_tables=[np.zeros(1, np.int64)] * len(seqs),
            slots=np.arange(len(tokens), dtype=np.int64),
        )
        return self._executor.run(tokens, positions, starts[1:] - 1, batch).copy()
