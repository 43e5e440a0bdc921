"""``POST /v1/rerank`` and ``/rerank``: a reranker (``runtime.embed.Reranker``, a
cross-encoder) scores each document against the query, as llama-server, vLLM, Jina and Cohere
serve it, and the `RerankService` that stands for such a model in the server's
`ModelManager` beside the generation and embedding models.

A request is ``{model, query, documents, top_n?, return_documents?, truncate?}``: documents
are strings, or objects with a ``text`` (vLLM's form). The answer lists the documents best
first, each ``{index, relevance_score, document: {text}}`` (``document`` unless
``return_documents`` is false), the first ``top_n`` of them. ``relevance_score`` is the
sigmoid of the model's logit, in [0, 1] (vLLM's, Jina's and Cohere's scale; llama-server
reports the logit itself); the order is the logits'.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from dynalm.errors import InvalidRequest
from dynalm.runtime.embed import Reranker, relevance
from dynalm.runtime.serve.asgi import error_responses
from dynalm.runtime.serve.embeddings import MAX_INPUTS, EmbeddingMetrics, EmbeddingUsage
from dynalm.runtime.serve.models import ServedModel
from dynalm.runtime.serve.protocol import _Request


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # the best n; absent: every document
    return_documents: bool = True
    truncate: bool = False  # cut a document whose pair is past the maximum length


class RerankedDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankedDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class RerankService(ServedModel):
    """A reranker as the server's `ModelManager` holds it: ``/v1/rerank`` asks it for
    scores; the generation and embedding endpoints get a 400."""

    serves = "a reranker"

    def __init__(self, reranker: Reranker, names: Sequence[str], size_bytes: int) -> None:
        super().__init__(
            reranker.model,
            names,
            device=reranker.device.name,
            size_bytes=size_bytes,
            ctx=reranker.max_length,
        )
        self.reranker = reranker
        self.metrics = EmbeddingMetrics(self.name, reranker, "rerank")

    def shutdown(self, drain: bool = False) -> None:
        """Stop the reranker's worker; without ``drain`` the requests waiting get a 503."""
        self.reranker.close(drain=drain)

    def pairs(self, req: RerankRequest, docs: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """The request's (query, document) pairs as ids and token types, checked (blocking:
        called through asyncio.to_thread)."""
        if not docs:
            raise InvalidRequest("documents is an empty list: there is nothing to rank")
        if len(docs) > MAX_INPUTS:
            raise InvalidRequest(
                f"documents has {len(docs)} items; at most {MAX_INPUTS} are ranked in a request"
            )
        if req.top_n is not None and req.top_n < 1:
            raise InvalidRequest(
                f"top_n is {req.top_n}; it must be at least 1 (leave it out for every document)"
            )
        return self.reranker.pairs(req.query, docs, req.truncate)

    async def respond(self, req: RerankRequest) -> dict[str, Any]:
        """The answer to ``req``: its pairs join the reranker's queue, where they share
        steps with the other requests' (``Embedder.submit``), awaited on the event loop (no
        thread waits for them)."""
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        ids, types = await asyncio.to_thread(self.pairs, req, docs)
        logits = (await asyncio.wrap_future(self.reranker.submit(ids, types)))[:, 0]
        order = sorted(range(len(docs)), key=lambda i: -float(logits[i]))[: req.top_n]
        tokens = sum(map(len, ids))
        self.metrics.requests.inc()
        self.metrics.inputs.inc(len(docs))
        self.metrics.tokens.inc(tokens)
        results = [
            RerankResult(
                index=i,
                relevance_score=relevance(float(logits[i])),
                document=RerankedDocument(text=docs[i]) if req.return_documents else None,
            )
            for i in order
        ]
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=self.name,
            results=results,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        ).model_dump(mode="json", exclude_none=True)


def install_rerank(
    app: FastAPI,
    serving: Callable[..., Awaitable[Response]],
    guarded: list[Any],
) -> None:
    """Add ``POST /v1/rerank`` and ``/rerank`` (llama-server's and vLLM's paths) to a
    server's application; ``serving`` is its `OpenAIServer.serving`."""

    async def rerank(body: RerankRequest) -> Response:
        """Rank documents by their relevance to a query, with a reranker (cross-encoder)."""

        async def work(service: RerankService) -> Response:
            return JSONResponse(await service.respond(body))

        return await serving(body.model, work, kind=RerankService)

    for path in ("/v1/rerank", "/rerank"):
        app.post(
            path,
            dependencies=guarded,
            response_model=None,
            responses={
                200: {"model": RerankResponse},
                **error_responses(400, 401, 404, 408, 413, 503),
            },
        )(rerank)
