"""``POST /v1/rerank`` and ``/rerank`` on a live HTTP server holding a tiny random reranker
(``models.tiny_bert``: a BertForSequenceClassification written as llama.cpp writes it) beside
a tiny BERT encoder and a tiny generation model: llama-server's and vLLM's request shapes,
the scores against transformers, ``top_n`` and ``return_documents``, and each bad input a
400 naming the problem while the server keeps serving."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving import live_models, server_process

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.embed import Embedder, Reranker
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.serve.embeddings import EmbeddingService
from dynalm.runtime.serve.models import ModelManager, ModelService
from dynalm.runtime.serve.rerank import RerankService
from models import tiny_bert, tiny_models

QUERY = "the cat sat"
DOCS = ["hello world!", "the cat sat on the mat.", "dog", "embedding xyz"]
PATHS = ["/v1/rerank", "/rerank"]


@pytest.fixture(scope="module")
def reranker_model() -> tiny_bert.BertForSequenceClassification:
    return tiny_bert.reference_reranker()


@pytest.fixture(scope="module")
def http(reranker_model, tmp_path_factory) -> Iterator[httpx.Client]:
    d: Path = tmp_path_factory.mktemp("rerank-serve")
    cross = load_model(tiny_bert.write_gguf(reranker_model, d / "rr.gguf", pooler=True))
    encoder = load_model(tiny_bert.write_gguf(tiny_bert.reference_model(), d / "e.gguf"))
    spec = tiny_models.SPECS["qwen3"]
    decoder = load_model(
        tiny_models.write_gguf(tiny_models.reference_model(spec), spec, d / "qwen3.gguf")
    )
    services = [
        RerankService(Reranker(cross, backend="cpu", mode="exact"), ["tiny-rerank"], 0),
        EmbeddingService(Embedder(encoder, backend="cpu", mode="exact"), ["tiny-bert"], 0),
        ModelService(Engine(decoder, CpuDevice(), EngineConfig(ctx=64)), decoder, ["tiny-qwen3"]),
    ]
    with live_models(ModelManager.of(services)) as server, server.http() as client:
        yield client


def _error(http: httpx.Client, body: dict, path: str = "/v1/rerank") -> str:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    ok = http.post(path, json={"model": "tiny-rerank", "query": "cat", "documents": ["dog"]})
    assert ok.status_code == 200  # the server keeps serving
    return message


def _reference(reranker_model, tmp_path: Path, docs: list[str]) -> list[float]:
    """transformers' relevance (sigmoid of the logit) of each pair, BertTokenizer's pair."""
    tok = tiny_bert.reference_tokenizer(tmp_path)
    pairs = [(e["input_ids"], e["token_type_ids"]) for e in (tok(QUERY, d) for d in docs)]
    return [1 / (1 + math.exp(-x)) for x in tiny_bert.reference_scores(reranker_model, pairs)]


@pytest.mark.parametrize("path", PATHS)
def test_scores_match_transformers_best_first(http, reranker_model, tmp_path, path) -> None:
    """llama-server's shape (strings); every document, best first, with its text."""
    r = http.post(path, json={"model": "tiny-rerank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-rerank" and body["id"].startswith("rerank-")
    ref = _reference(reranker_model, tmp_path, DOCS)
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for x in results:
        assert abs(x["relevance_score"] - ref[x["index"]]) <= 1e-4
        assert x["document"] == {"text": DOCS[x["index"]]}
    tok = tiny_bert.reference_tokenizer(tmp_path)
    n = sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_vllm_shape_top_n_and_no_documents(http) -> None:
    """vLLM's documents as objects with a text; top_n the best n; return_documents false."""
    full = http.post("/rerank", json={"model": "tiny-rerank", "query": QUERY, "documents": DOCS})
    r = http.post("/rerank", json={"model": "tiny-rerank", "query": QUERY, "top_n": 2,
                                   "return_documents": False,
                                   "documents": [{"text": d} for d in DOCS]})  # fmt: skip
    assert r.status_code == 200, r.text
    best = full.json()["results"][:2]
    assert r.json()["results"] == [
        {"index": x["index"], "relevance_score": x["relevance_score"]} for x in best
    ]
    many = http.post("/rerank", json={"model": "tiny-rerank", "query": QUERY, "top_n": 99,
                                      "documents": DOCS})  # fmt: skip
    assert many.json()["results"] == full.json()["results"]


def test_empty_documents_list_is_refused(http) -> None:
    body = {"model": "tiny-rerank", "query": QUERY, "documents": []}
    assert _error(http, body) == "documents is an empty list: there is nothing to rank"


def test_empty_query_is_refused(http) -> None:
    body = {"model": "tiny-rerank", "query": "", "documents": DOCS}
    assert _error(http, body, "/rerank") == (
        "query is an empty string: there is nothing to rank against"
    )


def test_empty_document_is_refused_naming_it(http) -> None:
    body = {"model": "tiny-rerank", "query": QUERY, "documents": ["dog", {"text": ""}]}
    assert _error(http, body) == "documents[1] is an empty string: there is no text to rank"


@pytest.mark.parametrize("top_n", [0, -3])
def test_top_n_below_one_is_refused(http, top_n: int) -> None:
    body = {"model": "tiny-rerank", "query": QUERY, "documents": DOCS, "top_n": top_n}
    assert _error(http, body) == (
        f"top_n is {top_n}; it must be at least 1 (leave it out for every document)"
    )


def test_too_long_is_refused_naming_the_document_unless_truncate(http) -> None:
    long = " ".join(["cat"] * 40)
    body = {"model": "tiny-rerank", "query": QUERY, "documents": ["dog", long]}
    assert _error(http, body) == (
        "documents[1] with the query has 46 tokens, more than the model's maximum length 32 "
        "(ask for truncate to cut the document)"
    )
    r = http.post("/v1/rerank", json=body | {"truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7 + 32


@pytest.mark.parametrize("path", PATHS)
def test_an_embedding_or_generation_model_asked_to_rerank(http, path: str) -> None:
    body = {"query": QUERY, "documents": DOCS}
    assert _error(http, body | {"model": "tiny-bert"}, path) == (
        "the model 'tiny-bert' is an embedding model (bert); this endpoint needs a reranker"
    )
    assert _error(http, body | {"model": "tiny-qwen3"}, path) == (
        "the model 'tiny-qwen3' is a generation model (qwen3); this endpoint needs a reranker"
    )


def test_a_reranker_asked_to_embed_or_generate(http) -> None:
    r = http.post("/v1/embeddings", json={"model": "tiny-rerank", "input": "cat"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "the model 'tiny-rerank' is a reranker (bert); this endpoint needs an embedding model"
    )
    r = http.post("/v1/completions", json={"model": "tiny-rerank", "prompt": "hi"})
    assert r.status_code == 400 and "is a reranker (bert)" in r.text
    assert "tiny-rerank" in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_wrong_types_and_unknown_model(http) -> None:
    for body in ({"model": "tiny-rerank", "query": 3, "documents": DOCS},
                 {"model": "tiny-rerank", "query": QUERY, "documents": "dog"},
                 {"model": "tiny-rerank", "query": QUERY, "documents": [{"txt": "dog"}]},
                 {"model": "tiny-rerank", "documents": DOCS}):  # fmt: skip
        assert http.post("/v1/rerank", json=body).status_code == 400, body
    r = http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404


def test_dynalm_serve_serves_a_reranker(reranker_model, tmp_path: Path) -> None:
    """``dynalm serve`` of a reranker file picks the reranker's service: /rerank answers,
    /v1/embeddings is a 400."""
    path = tiny_bert.write_gguf(reranker_model, tmp_path / "tiny-rerank.gguf")
    args = ["-m", "dynalm.cli", "serve", str(path), "--port", "0", "--cpu"]
    with (
        server_process(args, tmp_path / "serve.log") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        r = client.post("/rerank", json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == len(DOCS)
        r = client.post("/v1/embeddings", json={"input": "cat"})
        assert r.status_code == 400 and "is a reranker (bert)" in r.text


def test_too_many_documents_are_refused(http) -> None:
    body = {"model": "tiny-rerank", "query": QUERY, "documents": ["a"] * 2049}
    assert _error(http, body) == "documents has 2049 items; at most 2048 are ranked in a request"


def test_metrics_count_rerank_requests(http) -> None:
    before = _counter(http, "dynalm:rerank_inputs_total")
    r = http.post("/rerank", json={"model": "tiny-rerank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200
    assert _counter(http, "dynalm:rerank_inputs_total") == before + len(DOCS)


def _counter(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(f'{name}{{model_name="tiny-rerank"}}'))
    return float(line.split()[-1])


def test_requests_waiting_on_the_reranker_hold_no_thread(reranker_model, tmp_path: Path) -> None:
    """Rerank requests in flight wait on the event loop, not in a thread each: with the
    reranker's step held, N requests are all in it or its queue at once while the process has
    hardly more threads than before (asyncio's executor would run at most 32 waits, and
    tokenizing needs none of them for long); then each gets its own documents' scores."""
    n = 40  # more requests than asyncio's default executor has threads (at most 32)
    cross = load_model(tiny_bert.write_gguf(reranker_model, tmp_path / "rr.gguf", pooler=True))
    reranker = Reranker(cross, backend="cpu", mode="exact")
    entered, go, step = threading.Event(), threading.Event(), reranker._step
    held = [0]  # inputs in the held step: the requests that came before it formed
    go.set()

    def gated(seqs: list[list[int]], types: list[list[int]] | None, first: int = 0) -> np.ndarray:
        held[0] = len(seqs)
        entered.set()
        go.wait(60)
        return step(seqs, types, first)

    reranker._step = gated  # type: ignore[method-assign]
    bodies = [{"query": QUERY, "documents": [DOCS[i % 4], DOCS[(i + 1) % 4]]} for i in range(n)]

    async def burst(http: httpx.AsyncClient, waited: bool) -> tuple[int, list[dict]]:
        posts = [asyncio.create_task(http.post("/v1/rerank", json=b)) for b in bodies]
        deadline = time.monotonic() + 60
        # every request's 2 inputs in the held step or queued (the step may have taken
        # several requests, all that had come when it formed)
        while waited and not (entered.is_set() and held[0] + len(reranker._queue) == 2 * n):
            where = f"{held[0]} inputs in the step, {len(reranker._queue)} queued"
            assert time.monotonic() < deadline, f"{where}, of {2 * n}"
            await asyncio.sleep(0.02)
        threads = threading.active_count()
        go.set()
        replies = await asyncio.gather(*posts)
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return threads, [r.json() for r in replies]

    async def main(url: str) -> tuple[int, int, list[dict]]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            await burst(http, False)  # the executor's threads started, idle
            before = threading.active_count()
            entered.clear(), go.clear()
            during, answers = await burst(http, True)
        return before, during, answers

    with live_models(ModelManager.of([RerankService(reranker, ["tiny-rerank"], 0)])) as server:
        before, during, answers = asyncio.run(main(server.url))
    assert during - before < 8, (before, during)  # not one thread per request
    ref = dict(zip(DOCS, _reference(reranker_model, tmp_path, DOCS), strict=True))
    for body, answer in zip(bodies, answers, strict=True):
        docs = body["documents"]
        got = [(docs[r["index"]], r["relevance_score"]) for r in answer["results"]]
        assert [d for d, _ in got] == sorted(docs, key=lambda d: -ref[d]), got
        assert all(abs(score - ref[d]) <= 1e-4 for d, score in got), got  # as one request
