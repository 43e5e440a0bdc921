"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over an encoder model
(``runtime.embed.Embedder``), and the `EmbeddingService` that stands for such a model in the
server's `ModelManager` beside the generation models.

A request's ``input`` is a string, a list of strings, a list of token ids or a list of such
lists; each becomes ``[CLS] text [SEP]`` ids (token ids are taken as given), checked (not
empty, in the vocabulary, at most the model's maximum length unless ``truncate``) and
embedded in packed steps off the event loop. ``encoding_format`` ``base64`` gives each vector
as the base64 of its little-endian float32 bytes, as OpenAI's clients decode it.
``dimensions`` asks for shorter vectors, which only models trained for it (Matryoshka) give:
none of the families here says so, so any other number than the model's own is a 400.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from dynalm.errors import InvalidRequest
from dynalm.runtime.embed import Embedder
from dynalm.runtime.serve.asgi import APIError, error_responses
from dynalm.runtime.serve.protocol import _Request, clip

if TYPE_CHECKING:
    from dynalm.runtime.serve.server import OpenAIServer

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


class _Counters:
    """What ``/metrics`` shows of an embedding model (it has no engine)."""

    def __init__(self, name: str) -> None:
        self.name, self.requests, self.inputs, self.tokens = name, 0, 0, 0

    def render(self) -> str:
        label = f'{{model_name="{self.name}"}}'
        return "".join(
            f"# TYPE dynalm:embedding_{what}_total counter\n"
            f"dynalm:embedding_{what}_total{label} {value}\n"
            for what, value in (
                ("requests", self.requests),
                ("inputs", self.inputs),
                ("tokens", self.tokens),
            )
        )


class EmbeddingService:
    """An encoder model as the server's `ModelManager` holds it: named, started and shut
    down like a `ModelService`; the generation endpoints get a 400 saying it cannot
    generate, and ``/tokenize`` its ids."""

    def __init__(self, embedder: Embedder, names: Sequence[str]) -> None:
        self.embedder = embedder
        self.model = embedder.model
        self.tokenizer = embedder.model.tokenizer
        self.names = list(dict.fromkeys(names))
        self.ctx = embedder.max_length
        self.metrics = _Counters(self.names[0])
        self.async_engine = None  # no engine thread: steps run in the request's thread
        self.active = 0

    @property
    def name(self) -> str:
        return self.names[0]

    def start(self) -> None:
        pass

    def shutdown(self, drain: bool = False) -> None:
        pass

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        n = self.tokenizer.vocab_size
        if bad := [t for t in ids if not 0 <= t < n]:
            raise InvalidRequest(
                f"{what}: token id {bad[0]} is outside the vocabulary (0..{n - 1})"
            )

    def encode(self, text: str, add_special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def _cannot_generate(self, *_: Any, **__: Any) -> Any:
        raise InvalidRequest(
            f"the model '{self.name}' is an embedding model: it cannot generate text "
            "(use /v1/embeddings)"
        )

    # what the generation endpoints call first
    chat_ids = prompt_ids = guide = params = _cannot_generate

    # --- embeddings (blocking: called through asyncio.to_thread)

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

    def respond(self, req: EmbeddingRequest) -> dict[str, Any]:
        dims = self.embedder.dimensions
        if req.dimensions is not None and req.dimensions != dims:
            raise APIError(
                400,
                f"dimensions is {req.dimensions}, but the model '{self.name}' gives "
                f"{dims}-dimensional vectors and was not trained to be shortened (Matryoshka); "
                f"leave dimensions out or ask for {dims}",
                param="dimensions",
            )
        ids = self.inputs(req)
        vectors = self.embedder.embed(ids)
        tokens = sum(map(len, ids))
        self.metrics.requests += 1
        self.metrics.inputs += len(ids)
        self.metrics.tokens += tokens
        data = [
            Embedding(index=i, embedding=_encode(v, req.encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=self.name, usage=usage).model_dump(mode="json")


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def install_embeddings(app: FastAPI, server: OpenAIServer) -> None:
    """Add ``POST /v1/embeddings`` to ``server``'s application."""

    async def embeddings(body: EmbeddingRequest) -> Response:
        """OpenAI's embeddings: one vector per input, of an embedding model."""

        async def work(service: Any) -> Response:
            if not isinstance(service, EmbeddingService):
                raise InvalidRequest(
                    f"the model '{clip(service.name, 100)}' is a generation model "
                    f"({service.model.hparams.arch}): it has no embedding output"
                )
            return JSONResponse(await asyncio.to_thread(service.respond, body))

        return await server.serving(body.model, work)

    app.post(
        "/v1/embeddings",
        dependencies=[Depends(server._authorize)],
        response_model=None,
        responses={
            200: {"model": EmbeddingResponse},
            **error_responses(400, 401, 404, 408, 413, 503),
        },
    )(embeddings)
