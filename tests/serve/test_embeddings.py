"""``POST /v1/embeddings`` on a server holding a tiny random BERT (``models.tiny_bert``)
beside a tiny generation model: every input form, both encodings, usage, the vectors against
transformers, and each bad input a 400 naming the problem while the server keeps serving."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from serving import live_models, server_process

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime import embed as embed_module
from dynalm.runtime.embed import Embedder
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve.embeddings import EmbeddingService
from dynalm.runtime.serve.models import ModelManager, ModelService
from dynalm.runtime.serve.server import OpenAIServer
from models import tiny_bert, tiny_models

URL = "/v1/embeddings"


@pytest.fixture(scope="module")
def bert() -> tiny_bert.BertModel:
    return tiny_bert.reference_model()


@pytest.fixture(scope="module")
def client(bert, tmp_path_factory) -> Iterator[TestClient]:
    d: Path = tmp_path_factory.mktemp("embed-serve")
    encoder = load_model(tiny_bert.write_gguf(bert, d / "bert.gguf", "mean"))
    spec = tiny_models.SPECS["qwen3"]
    decoder = load_model(
        tiny_models.write_gguf(tiny_models.reference_model(spec), spec, d / "qwen3.gguf")
    )
    services = [
        EmbeddingService(Embedder(encoder, backend="cpu", mode="exact"), ["tiny-bert"], 0),
        ModelService(Engine(decoder, CpuDevice(), EngineConfig(ctx=64)), decoder, ["tiny-qwen3"]),
    ]
    api = OpenAIServer(ModelManager.of(services))
    with TestClient(api.app) as c:
        yield c


def _error(client: TestClient, body: dict, status: int = 400) -> str:
    r = client.post(URL, json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    ok = client.post(URL, json={"model": "tiny-bert", "input": "still serving"})
    assert ok.status_code == 200  # the server keeps serving
    return message


def test_strings_match_transformers(client: TestClient, bert, tmp_path: Path) -> None:
    texts = ["Hello world!", "the cat sat on the mat.", "dog"]
    r = client.post(URL, json={"model": "tiny-bert", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny-bert"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]])
    ref_tok = tiny_bert.reference_tokenizer(tmp_path)
    ids = [ref_tok(t)["input_ids"] for t in texts]
    ref = tiny_bert.reference_embeddings(bert, ids, "mean")
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999
    n = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_every_input_form_gives_the_same_vector(client: TestClient) -> None:
    def vectors(inp: object) -> np.ndarray:
        r = client.post(URL, json={"input": inp})  # no model: the default (the encoder)
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]])

    one = vectors("hello world")
    ids = [2, 5, 6, 3]  # [CLS] hello world [SEP]
    np.testing.assert_array_equal(vectors(["hello world"]), one)
    np.testing.assert_array_equal(vectors(ids), one)
    np.testing.assert_array_equal(vectors([ids, ids])[1], one[0])


def test_base64_is_little_endian_float32(client: TestClient) -> None:
    body = {"model": "tiny-bert", "input": ["hello", "cat"]}
    floats = client.post(URL, json=body).json()["data"]
    encoded = client.post(URL, json={**body, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], np.float32))


def test_dimensions_only_the_models_own(client: TestClient) -> None:
    ok = client.post(URL, json={"input": "cat", "dimensions": 32})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 32
    message = _error(client, {"input": "cat", "dimensions": 8})
    assert message.startswith("dimensions is 8, but the model 'tiny-bert' gives 32-dimensional")
    assert "Matryoshka" in message


def test_empty_list_is_refused(client: TestClient) -> None:
    assert _error(client, {"input": []}) == "input is an empty list: there is nothing to embed"


def test_empty_string_is_refused(client: TestClient) -> None:
    message = _error(client, {"input": ["cat", ""]})
    assert message == "input[1] is an empty string: there is no text to embed"


def test_token_id_outside_the_vocabulary_is_refused(client: TestClient) -> None:
    n = len(tiny_bert.VOCAB)
    message = _error(client, {"input": [[2, 3], [2, n, 3]]})
    assert message == f"input[1]: token id {n} is outside the vocabulary [0, {n - 1}]"
    assert "token id -5" in _error(client, {"input": [-5]})
    assert "input[0] is empty" in _error(client, {"input": [[]]})


def test_too_long_is_refused_naming_the_input_unless_truncate(client: TestClient) -> None:
    long = " ".join(["cat"] * 40)
    message = _error(client, {"input": ["cat", long]})
    assert message.startswith("input[1] has 42 tokens, more than the model's maximum length 32")
    r = client.post(URL, json={"input": ["cat", long], "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3 + 32


def test_a_generation_model_asked_to_embed(client: TestClient) -> None:
    message = _error(client, {"model": "tiny-qwen3", "input": "cat"})
    assert (
        message == "the model 'tiny-qwen3' is a generation model (qwen3); this endpoint needs an "
        "embedding model"
    )


def test_an_embedding_model_asked_to_generate(client: TestClient) -> None:
    for url, body in (
        ("/v1/completions", {"model": "tiny-bert", "prompt": "hi"}),
        (
            "/v1/chat/completions",
            {"model": "tiny-bert", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ):
        r = client.post(url, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            "the model 'tiny-bert' is an embedding model (bert); this endpoint needs a "
            "generation model"
        )
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [
        ("tiny-bert", 32),
        ("tiny-qwen3", 64),
    ]


def test_wrong_types_and_unknown_model(client: TestClient) -> None:
    assert "input" in _error(client, {"input": [1, "a"]})
    assert "encoding_format" in _error(client, {"input": "a", "encoding_format": "int8"})
    assert "does not exist" in _error(client, {"model": "nope", "input": "a"}, status=404)


def test_dynalm_serve_serves_an_embedding_model(bert, tmp_path: Path) -> None:
    """``dynalm serve`` of an encoder: /v1/embeddings answers, /v1/completions is a 400."""
    path = tiny_bert.write_gguf(bert, tmp_path / "tiny-bert.gguf", "cls")
    args = ["-m", "dynalm.cli", "serve", str(path), "--port", "0", "--cpu"]
    with (
        server_process(args, tmp_path / "serve.log") as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        r = http.post(URL, json={"model": "tiny-bert", "input": ["hello", "cat"]})
        assert r.status_code == 200, r.text
        assert [len(d["embedding"]) for d in r.json()["data"]] == [32, 32]
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "is an embedding model" in r.text


def test_ollamas_embed_endpoints(client: TestClient) -> None:
    texts = ["hello world", "the cat sat on the mat."]
    openai = client.post(URL, json={"model": "tiny-bert", "input": texts}).json()
    r = client.post("/api/embed", json={"model": "tiny-bert", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-bert"
    assert body["embeddings"] == [d["embedding"] for d in openai["data"]]
    assert body["prompt_eval_count"] == openai["usage"]["prompt_tokens"]
    assert isinstance(body["total_duration"], int) and body["total_duration"] > 0
    legacy = client.post("/api/embeddings", json={"model": "tiny-bert", "prompt": texts[0]})
    assert legacy.status_code == 200 and list(legacy.json()) == ["embedding"]
    # one text alone, not packed with another: the matmuls' tile (and fp32 summation order)
    # follow the step's row count, so the last bits may differ
    np.testing.assert_allclose(legacy.json()["embedding"], body["embeddings"][0], atol=1e-6)
    long = " ".join(["cat"] * 40)  # past the tiny model's 32 positions: Ollama cuts it
    assert client.post("/api/embed", json={"model": "tiny-bert", "input": long}).status_code == 200
    cut = client.post("/api/embed", json={"model": "tiny-bert", "input": long, "truncate": False})
    assert cut.status_code == 400 and "input[0]" in cut.json()["error"]
    gone = client.post("/api/embed", json={"model": "nope", "input": "a"})
    assert gone.status_code == 404 and gone.json()["error"].startswith("model 'nope' not found")
    generator = client.post("/api/embed", json={"model": "tiny-qwen3", "input": "a"})
    assert generator.status_code == 400 and "needs an embedding model" in generator.json()["error"]


def test_the_official_ollama_client_embeds(client: TestClient, bert, tmp_path: Path) -> None:
    import ollama

    path = tiny_bert.write_gguf(bert, tmp_path / "tiny-bert.gguf", "mean")
    service = EmbeddingService(
        Embedder(load_model(path), backend="cpu", mode="exact"), ["tiny-bert"], 0
    )
    with live_models(ModelManager.of([service])) as server:
        got = ollama.Client(host=server.url).embed(model="tiny-bert", input=["hello", "cat"])
    want = client.post(URL, json={"model": "tiny-bert", "input": ["hello", "cat"]}).json()
    assert [list(v) for v in got.embeddings] == [d["embedding"] for d in want["data"]]


def _qwen3(tmp_path: Path, **config) -> tuple[Engine, ModelManager]:
    """A tiny generation model's engine and a manager holding it alone."""
    spec = tiny_models.SPECS["qwen3"]
    decoder = load_model(
        tiny_models.write_gguf(tiny_models.reference_model(spec), spec, tmp_path / "qwen3.gguf")
    )
    engine = Engine(decoder, CpuDevice(), EngineConfig(ctx=64, **config))
    return engine, ModelManager.of([ModelService(engine, decoder, ["tiny-qwen3"])])


def test_the_manager_says_when_generation_runs(bert, tmp_path: Path) -> None:
    """What ``dynalm serve`` gives an embedder as ``beside`` (``ModelManager``): a generation
    model is loaded; its engine holds a request (until it is done); a prompt waits to be
    computed (until the steps that compute it, chunked by the step budget, have run)."""
    engine, manager = _qwen3(tmp_path, max_num_batched_tokens=4)
    assert manager.generation_loaded() and not manager.generating()
    assert not manager.prefilling()
    engine.add_request("beside", list(range(5, 15)), SamplingParams(max_tokens=2))
    assert manager.generating() and manager.prefilling()
    assert not manager.wait_prefilled(0.01)  # no step runs: the wait gives up
    woken: list[bool] = []  # a wait the steps wake (no polling), once the prompt is done
    waiter = threading.Thread(target=lambda: woken.append(manager.wait_prefilled(60)))
    waiter.start()
    engine.step(), engine.step()  # 8 of its 10 prompt tokens
    assert manager.prefilling()
    engine.step()  # the last 2, and its first token
    assert manager.generating() and not manager.prefilling()
    waiter.join(60)
    assert woken == [True] and manager.wait_prefilled(0)
    while engine.has_unfinished():
        engine.step()
    assert not manager.generating()
    encoder = load_model(tiny_bert.write_gguf(bert, tmp_path / "bert.gguf", "mean"))
    alone = EmbeddingService(Embedder(encoder, backend="cpu"), ["tiny-bert"], 0)
    assert not ModelManager.of([alone]).generation_loaded()


def test_a_waiting_prompt_is_computed_before_the_next_embedding_step(
    bert, tmp_path: Path, monkeypatch
) -> None:
    """Generation's prefill goes first: an embedding request submitted while a prompt waits
    in a generation model's engine gets its step only after the engine's steps that computed
    the prompt (three chunks of the step budget), not between them."""
    monkeypatch.setattr(embed_module, "PREFILL_WAIT_S", 60.0)  # the order, not the cap
    engine, manager = _qwen3(tmp_path, max_num_batched_tokens=8)
    encoder = load_model(tiny_bert.write_gguf(bert, tmp_path / "bert.gguf", "mean"))
    embedder = Embedder(encoder, backend="cpu", mode="exact", beside=manager)
    log: list[str] = []
    step = embedder._step

    def logged(seqs: list[list[int]], types: list[list[int]] | None, first: int = 0) -> np.ndarray:
        log.append("embed")
        return step(seqs, types, first)

    embedder._step = logged  # type: ignore[method-assign]
    engine.add_request("first", list(range(5, 25)), SamplingParams(max_tokens=3))
    future = embedder.submit([[5, 6, 7]])
    while engine.has_unfinished():
        prefill = engine.prefilling()
        engine.step()
        log.append("prefill" if prefill else "decode")
    assert future.result(60).shape == (1, 32)
    assert log[:3] == ["prefill"] * 3 and log.count("embed") == 1, log
    embedder.close()


def test_a_full_queue_is_503_with_retry_after_and_serving_goes_on(bert, tmp_path: Path) -> None:
    """``--max-queue`` bounds an embedding model's waiting requests as the engine's: past it a
    503 at once, with Retry-After and the ``queue_full`` code (generation's answer), counted
    in /metrics; the requests waiting then get their vectors and new ones are served."""
    encoder = load_model(tiny_bert.write_gguf(bert, tmp_path / "bert.gguf", "mean"))
    embedder = Embedder(encoder, backend="cpu", mode="exact", max_queue=2)
    entered, go, step = threading.Event(), threading.Event(), embedder._step

    def gated(seqs: list[list[int]], types: list[list[int]] | None, first: int = 0) -> np.ndarray:
        entered.set()
        go.wait(60)
        return step(seqs, types, first)

    embedder._step = gated  # type: ignore[method-assign]
    service = EmbeddingService(embedder, ["tiny-bert"], 0)
    with live_models(ModelManager.of([service])) as server, server.http() as http:
        statuses: list[int] = []

        def post(text: str) -> None:
            with server.http() as own:
                statuses.append(own.post(URL, json={"input": text}).status_code)

        posts = [threading.Thread(target=post, args=(t,)) for t in ("one", "two", "three")]
        posts[0].start()  # its step runs (held): it waits no more
        assert entered.wait(60)
        for t in posts[1:]:
            t.start()
        deadline = time.monotonic() + 60
        while embedder.waiting < 2:  # the other two wait
            assert time.monotonic() < deadline, embedder.waiting
            time.sleep(0.02)
        refused = http.post(URL, json={"input": "four"})
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "queue_full", error
        assert error["message"] == "2 requests are waiting; retry later"
        waiting = 'dynalm:embedding_requests_waiting{model_name="tiny-bert"} 2.0'
        assert waiting in http.get("/metrics").text.splitlines()
        go.set()
        for t in posts:
            t.join(60)
        assert statuses == [200] * 3 and embedder.waiting == 0
        assert http.post(URL, json={"input": "five"}).status_code == 200
