"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over an embedding model
(``runtime.embed.Embedder``: an encoder, or a decoder with a pooling type), and the
`EmbeddingService` that stands for such a model in the server's `ModelManager` beside the
generation models.

A request's ``input`` is a string, a list of strings, a list of token ids or a list of such
lists; each becomes ``[CLS] text [SEP]`` ids (token ids are taken as given), checked (not
empty, in the vocabulary, at most the model's maximum length unless ``truncate``) and
embedded off the event loop, packed into steps with the inputs of every other request
waiting (the embedder's one worker thread drains its queue up to a token budget a step).
``encoding_format`` ``base64`` gives each vector as the base64 of its little-endian float32
bytes, as OpenAI's clients decode it.
``dimensions`` asks for shorter vectors, which only models trained for it (Matryoshka) give:
none of the families here says so, so any other number than the model's own is a 400.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, Field

from dynalm.errors import InvalidRequest
from dynalm.runtime.embed import Embedder
from dynalm.runtime.serve.asgi import APIError, error_responses
from dynalm.runtime.serve.models import ServedModel
from dynalm.runtime.serve.protocol import _Request

MAX_INPUTS = 2048  # OpenAI's own limit of inputs per request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = False  # cut an input longer than the model's maximum length to it


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class EmbeddingMetrics:
    """What ``/metrics`` shows of an embedding model (it has no engine): its own registry,
    labelled by model name, as the generation models' `ServerMetrics`; ``embedder``'s
    requests waiting (what ``--max-queue`` bounds) as generation's num_requests_waiting."""

    def __init__(self, name: str, embedder: Embedder, kind: str = "embedding") -> None:
        self.registry = CollectorRegistry()
        Gauge(
            f"dynalm:{kind}_requests_waiting",
            f"{kind.capitalize()} requests waiting for a step.",
            ["model_name"],
            registry=self.registry,
        ).labels(name).set_function(lambda: embedder.waiting)

        def counter(what: str, doc: str) -> Any:
            return Counter(
                f"dynalm:{kind}_{what}", doc, ["model_name"], registry=self.registry
            ).labels(name)

        # a reranker's (kind "rerank"): requests, documents and their pairs' tokens
        self.requests = counter("requests", f"{kind.capitalize()} requests answered.")
        self.inputs = counter("inputs", f"Inputs of {kind} requests.")
        self.tokens = counter("tokens", f"Tokens of {kind} requests.")


class EmbeddingService(ServedModel):
    """An encoder model as the server's `ModelManager` holds it, beside the generation
    models: ``/v1/embeddings`` asks it for vectors; the generation endpoints get a 400."""

    serves = "an embedding model"

    def __init__(self, embedder: Embedder, names: Sequence[str], size_bytes: int) -> None:
        super().__init__(
            embedder.model,
            names,
            device=embedder.device.name,
            size_bytes=size_bytes,
            ctx=embedder.max_length,
        )
        self.embedder = embedder
        self.metrics = EmbeddingMetrics(self.name, embedder)

    # --- embeddings (`inputs` blocks: called through asyncio.to_thread)

    def inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """The request's inputs as checked ids, one list per input."""
        items: Sequence[str | int | list[int]] = (
            [req.input] if isinstance(req.input, str) else req.input
        )
        if not items:
            raise InvalidRequest("input is an empty list: there is nothing to embed")
        if all(isinstance(x, int) for x in items):  # one input of token ids
            items = [list(items)]  # type: ignore[arg-type]
        if len(items) > MAX_INPUTS:
            raise InvalidRequest(
                f"input has {len(items)} items; at most {MAX_INPUTS} are embedded in a request"
            )
        e, cut = self.embedder, req.truncate
        return [
            e.tokenize(x, i, cut) if isinstance(x, str) else e.check(list(x), i, cut)  # type: ignore[arg-type]
            for i, x in enumerate(items)
        ]

    def shutdown(self, drain: bool = False) -> None:
        """Stop the embedder's worker; without ``drain`` the requests waiting get a 503."""
        self.embedder.close(drain=drain)

    async def respond(self, req: EmbeddingRequest) -> dict[str, Any]:
        """The answer to ``req``: its inputs join the embedder's queue, where they share
        steps with the other requests' (``Embedder.submit``)."""
        dims = self.embedder.dimensions
        if req.dimensions is not None and req.dimensions != dims:
            raise APIError(
                400,
                f"dimensions is {req.dimensions}, but the model '{self.name}' gives "
                f"{dims}-dimensional vectors and was not trained to be shortened (Matryoshka); "
                f"leave dimensions out or ask for {dims}",
                param="dimensions",
            )
        ids = await asyncio.to_thread(self.inputs, req)
        vectors = await asyncio.wrap_future(self.embedder.submit(ids))
        tokens = sum(map(len, ids))
        self.metrics.requests.inc()
        self.metrics.inputs.inc(len(ids))
        self.metrics.tokens.inc(tokens)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return await asyncio.to_thread(_answer, vectors, req.encoding_format, self.name, usage)


def _answer(vectors: np.ndarray, fmt: str, model: str, usage: EmbeddingUsage) -> dict[str, Any]:
    data = [Embedding(index=i, embedding=_encode(v, fmt)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=model, usage=usage).model_dump(mode="json")


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def install_embeddings(
    app: FastAPI,
    serving: Callable[..., Awaitable[Response]],
    guarded: list[Any],
) -> None:
    """Add ``POST /v1/embeddings`` to a server's application; ``serving`` is its
    `OpenAIServer.serving` (named, not imported: the server imports this module)."""

    async def embeddings(body: EmbeddingRequest) -> Response:
        """OpenAI's embeddings: one vector per input, of an embedding model."""

        async def work(service: EmbeddingService) -> Response:
            return JSONResponse(await service.respond(body))

        return await serving(body.model, work, kind=EmbeddingService)

    app.post(
        "/v1/embeddings",
        dependencies=guarded,
        response_model=None,
        responses={
            200: {"model": EmbeddingResponse},
            **error_responses(400, 401, 404, 408, 413, 503),
        },
    )(embeddings)
