"""Hostile requests against a real server: each is a 4xx naming what was wrong, in OpenAI's
error JSON, with a bounded message that shows no internals, and the server keeps serving.
Every case that once was a 500 (or silently accepted) is here; bodies are sent as raw bytes,
so JSON escapes such as a lone surrogate reach the server exactly as written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from serving import MODEL, SERVERS, LiveServer, served

from dynalm.errors import EngineFailure
from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve.asgi import APIError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMIT = 1 << 20  # the body limit of this module's server


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    with served(request, smollm2, ctx=256, max_num_seqs=4, max_queue=16, max_body_bytes=LIMIT) as s:
        yield s


def chat(content: str = '"Hi"', extra: str = "") -> str:
    return f'{{"messages": [{{"role": "user", "content": {content}}}], "max_tokens": 2{extra}}}'


def completion(extra: str = "", prompt: str = '"Hi"') -> str:
    return f'{{"prompt": {prompt}, "max_tokens": 2{", " if extra else ""}{extra}}}'


def post(server: LiveServer, path: str, body: str | bytes, **kw: object) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": "application/json"}
    return server.http().post(path, content=data, headers=headers, **kw)  # type: ignore[arg-type]


def assert_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    """An OpenAI error JSON with ``status``, naming ``fragments``, short, without internals."""
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    message = error["message"]
    assert len(message) <= 1000
    for fragment in fragments:
        assert fragment in message, message
    assert not re.search(r"Error\b|Exception|Traceback", message), message
    return error


SURROGATE = '"\\ud800"'  # JSON text: a lone high surrogate escape
# name: (path, body, status, words the message must contain)
HOSTILE: dict[str, tuple[str, str | bytes, int, tuple[str, ...]]] = {
    # a lone surrogate anywhere: once a 500 (the tokenizer or the 404 body failed to encode it)
    "surrogate in chat content": (CHAT, chat(SURROGATE), 400, ("surrogate",)),
    "surrogate in a content part": (
        CHAT,
        chat(f'[{{"type": "text", "text": {SURROGATE}}}]'),
        400,
        ("surrogate",),
    ),
    "surrogate in a prompt": (COMPLETIONS, completion(prompt=SURROGATE), 400, ("surrogate",)),
    "surrogate in /tokenize": ("/tokenize", f'{{"prompt": {SURROGATE}}}', 400, ("surrogate",)),
    "surrogate as the model": (CHAT, chat(extra=f', "model": {SURROGATE}'), 400, ("surrogate",)),
    "low surrogate in a stop": (COMPLETIONS, completion('"stop": "\\udc00"'), 400, ("surrogate",)),
    # numbers out of range: seeds numpy refuses, non-finite or absurd floats
    "seed -1": (COMPLETIONS, completion('"seed": -1'), 400, ("seed", "greater than")),
    "seed 2**64": (COMPLETIONS, completion(f'"seed": {2**64}'), 400, ("seed", "less than")),
    "repetition_penalty Infinity": (
        COMPLETIONS,
        completion('"repetition_penalty": Infinity'),
        400,
        ("repetition_penalty", "finite"),
    ),
    "repetition_penalty 1e300": (
        COMPLETIONS,
        completion('"repetition_penalty": 1e300'),
        400,
        ("repetition_penalty", "less than or equal to 10"),
    ),
    "repetition_penalty 1e-320": (
        COMPLETIONS,
        completion('"repetition_penalty": 1e-320'),
        400,
        ("repetition_penalty",),
    ),
    "temperature NaN": (COMPLETIONS, completion('"temperature": NaN'), 400, ("temperature",)),
    "top_p Infinity": (COMPLETIONS, completion('"top_p": Infinity'), 400, ("top_p",)),
    "presence_penalty -Infinity": (
        COMPLETIONS,
        completion('"presence_penalty": -Infinity'),
        400,
        ("presence_penalty",),
    ),
    "logit_bias value NaN": (COMPLETIONS, completion('"logit_bias": {"5": NaN}'), 400, ("5",)),
    "max_tokens 1e400": (COMPLETIONS, completion('"max_tokens": 1e400'), 400, ("max_tokens",)),
    # logit_bias keys that `lstrip("-").isdigit()` let through to a failing int()
    "logit_bias key ²": (COMPLETIONS, completion('"logit_bias": {"²": 1}'), 400, ("logit_bias",)),
    "logit_bias key --5": (COMPLETIONS, completion('"logit_bias": {"--5": 1}'), 400, ("--5",)),
    "logit_bias key of 5,000 digits": (
        COMPLETIONS,
        completion(f'"logit_bias": {{"{"9" * 5000}": 1}}'),
        400,
        ("logit_bias", "token ids"),
    ),
    "logit_bias of 1,025 entries": (
        COMPLETIONS,
        completion(f'"logit_bias": {json.dumps({str(i): 1 for i in range(1025)})}'),
        400,
        ("logit_bias", "at most 1024"),
    ),
    "logit_bias key outside the vocabulary": (
        COMPLETIONS,
        completion('"logit_bias": {"999999": 1}'),
        400,
        ("logit_bias", "outside the vocabulary"),
    ),
    # prompts of every wrong shape
    "prompt []": (COMPLETIONS, completion(prompt="[]"), 400, ("prompt",)),
    "prompt [[]]": (COMPLETIONS, completion(prompt="[[]]"), 400, ("prompt",)),
    'prompt [""]': (COMPLETIONS, completion(prompt='[""]'), 400, ("empty",)),
    "prompt of mixed types": (COMPLETIONS, completion(prompt='[1, "a"]'), 400, ("prompt",)),
    "prompt token id 10**30": (COMPLETIONS, completion(prompt=f"[{10**30}]"), 400, ("prompt",)),
    "more prompts than the queue": (
        COMPLETIONS,
        completion('"n": 2', json.dumps(["Hi"] * 9)),
        400,
        ("18 completions", "at most 16"),
    ),
    # wrong types and shapes
    "content a number": (CHAT, chat("5"), 400, ("messages.0.content",)),
    "content parts nested": (
        CHAT,
        chat('[{"type": "text", "text": [{"a": 1}]}]'),
        400,
        ("messages.0.content",),
    ),
    "an image part": (
        CHAT,
        chat('[{"type": "image_url", "image_url": {"url": "x"}}]'),
        400,
        ("image_url", "not supported"),
    ),
    "messages an object": (CHAT, '{"messages": {"role": "user"}}', 400, ("messages",)),
    "a body that is a list": (CHAT, "[1, 2]", 400, ("body",)),
    "JSON nested 100,000 deep": (CHAT, "[" * 100_000 + "]" * 100_000, 400, ("not valid JSON",)),
    "a body that is not UTF-8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, ("UTF-8",)),
    "stream_options a number": (COMPLETIONS, completion('"stream_options": 5'), 400, ("stream",)),
    "n 17": (COMPLETIONS, completion('"n": 17'), 400, ("n:",)),
    "top_logprobs without logprobs": (CHAT, chat(extra=', "top_logprobs": 2'), 400, ("logprobs",)),
    "detokenize -1": ("/detokenize", '{"tokens": [-1]}', 400, ("tokens",)),
    "detokenize outside the vocabulary": (
        "/detokenize",
        '{"tokens": [60000]}',
        400,
        ("outside the vocabulary",),
    ),
    "tokenize without input": ("/tokenize", "{}", 400, ("prompt or messages",)),
    "a model name of 10,000 characters": (
        CHAT,
        chat(extra=f', "model": "{"m" * 10_000}"'),
        404,
        ("does not exist",),
    ),
    # no type is coerced into another: the OpenAPI document says what is accepted
    "n a string": (COMPLETIONS, completion('"n": "2"'), 400, ("n:", "integer")),
    "stream a word": (COMPLETIONS, completion('"stream": "yes"'), 400, ("stream:", "boolean")),
    "token ids that are booleans": (COMPLETIONS, completion(prompt="[[false]]"), 400, ("prompt",)),
    "best_of true": (COMPLETIONS, completion('"best_of": true'), 400, ("best_of",)),
    # OpenAI fields DynaLM does not implement: refused, naming the field
    "suffix": (COMPLETIONS, completion('"suffix": "x"'), 400, ("suffix", "not supported")),
    "best_of 3": (COMPLETIONS, completion('"best_of": 3'), 400, ("best_of", "not supported")),
    "echo a number": (COMPLETIONS, completion('"echo": 1'), 400, ("echo", "boolean")),
    "prompt_logprobs 21": (COMPLETIONS, completion('"prompt_logprobs": 21'), 400, ("prompt_logp",)),
    "chat prompt_logprobs": (CHAT, chat(extra=', "prompt_logprobs": 1'), 400, ("prompt_logp",)),
    "functions": (CHAT, chat(extra=', "functions": [{"name": "f"}]'), 400, ("functions",)),
    "function_call": (CHAT, chat(extra=', "function_call": "auto"'), 400, ("function_call",)),
    "audio": (CHAT, chat(extra=', "audio": {"voice": "x"}'), 400, ("audio",)),
    "modalities audio": (CHAT, chat(extra=', "modalities": ["audio"]'), 400, ("modalities",)),
    "prediction": (CHAT, chat(extra=', "prediction": {"type": "content"}'), 400, ("prediction",)),
    "web_search_options": (CHAT, chat(extra=', "web_search_options": {}'), 400, ("web_search",)),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_request_is_a_4xx_naming_it(server: LiveServer, case: str) -> None:
    path, body, status, fragments = HOSTILE[case]
    assert_error(post(server, path, body), status, *fragments)
    assert server.http().get("/health").status_code == 200


ACCEPTED = {
    "unknown fields are ignored, as OpenAI does": ', "store": false, "frobnicate": [1]',
    "response_format text, no tools and tool_choice none ask for nothing": (
        ', "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"'
    ),
    "unsupported fields at the value that asks for nothing": (
        ', "functions": [], "modalities": ["text"], "audio": null'
    ),
    "the largest seed": f', "seed": {2**64 - 1}',
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_accepted(server: LiveServer, case: str) -> None:
    r = post(server, CHAT, chat(extra=ACCEPTED[case]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_neutral_legacy_fields_and_a_tiny_temperature(server: LiveServer) -> None:
    # a subnormal temperature once overflowed the logits into NaN probabilities (a 500, and
    # every request in that engine step failed); it now samples greedily, like 0
    body = {"prompt": "The capital of France is", "max_tokens": 6}
    greedy = post(server, COMPLETIONS, json.dumps({**body, "temperature": 0}))
    tiny = {**body, "temperature": 5e-324, "best_of": 1, "suffix": "", "echo": False}
    r = post(server, COMPLETIONS, json.dumps(tiny))
    assert r.status_code == greedy.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_body_over_the_limit_is_413(server: LiveServer) -> None:
    big = chat(json.dumps("x" * LIMIT))
    assert_error(post(server, CHAT, big), 413, f"limit of {LIMIT} bytes")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield big.encode()

    assert_error(post(server, CHAT, chunks()), 413, "limit")  # type: ignore[arg-type]
    r = post(server, CHAT, chat(extra=', "temperature": 0'))
    assert r.status_code == 200, r.text


def test_text_that_cannot_fit_is_refused_before_tokenising(server: LiveServer) -> None:
    text = "word " * (server.service.max_text_chars // 5 + 1)
    for path, body in [
        (COMPLETIONS, completion(prompt=json.dumps(text))),
        ("/tokenize", json.dumps({"prompt": text})),
    ]:
        error = assert_error(post(server, path, body), 400, "characters", "context of 256 tokens")
        assert error["code"] == "prompt_too_long"


def test_405_names_the_allowed_methods(server: LiveServer) -> None:
    r = server.http().delete("/v1/models")
    assert_error(r, 405, "DELETE /v1/models")
    assert r.headers["Allow"] == "GET"
    assert_error(server.http().get("/v1/nothing"), 404, "/v1/nothing")


def test_openapi_documents_400_and_the_error_schema(server: LiveServer) -> None:
    doc = server.http().get("/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"])
    assert "ErrorResponse" in doc["components"]["schemas"]
    for path, operation in [(p, o) for p, ops in doc["paths"].items() for o in ops.values()]:
        responses = operation["responses"]
        # Ollama's API (/api/*) has its own error JSON
        schema = "OllamaError" if path.startswith("/api/") else "ErrorResponse"
        error_ref = {"$ref": f"#/components/schemas/{schema}"}
        if "requestBody" in operation:
            assert responses["400"]["content"]["application/json"]["schema"] == error_ref, path
            assert "413" in responses, path
        if "503" in responses:
            assert "Retry-After" in responses["503"]["headers"]
    chat_200 = doc["paths"][CHAT]["post"]["responses"]["200"]["content"]
    assert set(chat_200) == {"application/json", "text/event-stream"}


def test_internal_errors_show_no_internals() -> None:
    # what reaches a client of an unexpected exception, and of a failed engine step
    leak = APIError.of(ValueError("Probabilities contain NaN"))
    assert (leak.status, leak.message) == (500, "internal server error (see the server log)")
    failed = APIError.of(EngineFailure("the engine failed on this request (see the server log)"))
    assert failed.status == 500 and failed.body()["error"]["code"] == "engine_failure"
    assert len(APIError(400, "x" * 10**6).message) == 1000


def test_still_serving(server: LiveServer) -> None:
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
