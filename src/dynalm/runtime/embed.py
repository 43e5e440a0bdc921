"""Sentence embeddings from an embedding model (a family whose graph's output is
``embeddings``: ``bert.lum``, or a decoder family's file with a pooling type), for
``dynalm embed`` and ``POST /v1/embeddings``.

An encoder step needs no KV cache: its attention sees only the step's own tokens, each
sequence attending within itself. A decoder's causal attention reads its keys and values
from a KV pool: a scratch pool of one step's tokens, overwritten by the next step (nothing
is kept after a request). The inputs are packed whole, one after another, into
steps of at most ``max_tokens`` tokens (no padding); ``logit_rows`` holds each sequence's
last row, where the graph's attention and pooling find the sequences' bounds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from dynalm.core.device import Device
from dynalm.core.devices import select_device
from dynalm.core.kv_storage import AttentionBatch, KVGeometry
from dynalm.errors import InvalidRequest, UnsupportedModel
from dynalm.ir.executor import Executor
from dynalm.ir.lower import unsupported
from dynalm.models.loader import LoadedModel

OUTPUT = "embeddings"  # the graph output an embedding model has
# The longest input embedded: a step holds a whole input, so the buffers are sized by it
# (encoders are trained for 512 to 8192 positions; a file claiming millions is not believed).
MAX_LENGTH = 8192


def is_embedding_model(model: LoadedModel) -> bool:
    return OUTPUT in model.graph.outputs


def _scratch_kv(model: LoadedModel, tokens: int) -> KVGeometry:
    """A step's KV pool: none for an encoder; for a decoder, f32 (as exact as the
    activations) slots for the step's ``tokens``, one slot a page."""
    if not any(n.op == "attention" for n in model.graph.nodes):
        return KVGeometry(0, 1, 1, 1, tokens, "f32")
    hp = model.hparams
    return KVGeometry(hp.n_layers, hp.n_kv_heads, hp.head_dim, tokens, 1, "f32")


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
                "embedding output (--pooling last or mean embeds with its hidden states)"
            )
        self.model = model
        self.max_length = min(model.hparams.n_ctx_train, MAX_LENGTH)  # position table's rows
        self.dimensions = model.graph.outputs[OUTPUT].type.shape[1]
        self.device = device or select_device(
            backend, mode, threads, unsupported=lambda d: unsupported(d, model.graph)
        )
        self.max_tokens = max(max_tokens, self.max_length)
        self._executor = Executor(model.graph, self.device, model.weights, self.max_tokens)
        self._kv = self.device.kv_storage(_scratch_kv(model, self.max_tokens))
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
            # pages of one slot: sequence s owns the step's rows starts[s]:starts[s + 1]
            page_tables=[np.arange(starts[s], starts[s + 1]) for s in range(len(seqs))],
            slots=np.arange(len(tokens), dtype=np.int64),
        )
        return self._executor.run(tokens, positions, starts[1:] - 1, batch).copy()
