"""The OpenAI-compatible API against a real server, spoken to with the official
``openai`` client (and httpx where the client hides the wire): chat and completions,
streamed and not, usage, n, logprobs, stop strings, the side endpoints, metrics, bad
input and a client that disconnects mid-stream."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import MODEL, SERVERS, LiveServer, served

from dynalm.models.loader import LoadedModel

API_KEY = "test-key"
CTX = 512
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    with served(request, smollm2, api_key=API_KEY, ctx=CTX) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def metrics(server: LiveServer) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name): value}; a
    cluster's replicas' rows (a ``replica`` label each) summed."""
    server.settle()
    text = server.http().get("/metrics").text
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "replica")))  # fmt: skip
            out[(s.name, labels)] = out.get((s.name, labels), 0) + s.value
    return out


def test_chat_stream_equals_non_stream(server: LiveServer, client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    n_prompt = server.http().post("/tokenize", json={"messages": CHAT}).json()["count"]
    usage = full.usage
    assert usage.prompt_tokens == n_prompt
    assert 0 < usage.completion_tokens <= GREEDY["max_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and {c.model for c in chunks} == {MODEL}
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, last, usage_chunk = chunks
    assert last.choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == choice.message.content
    # the usage chunk: no choices; the same prompt again hits the prefix cache
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    streamed = usage_chunk.usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert 16 <= streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens


def test_completions_prompt_forms(server: LiveServer, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    one = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    text = one.choices[0].text
    assert text and one.usage.completion_tokens > 0

    streamed = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == one.choices[0].finish_reason

    ids = server.http().post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == text

    batch = client.completions.create(model=MODEL, prompt=[prompt, "1, 2, 3,"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text
    assert batch.usage.prompt_tokens == len(ids) + len(
        server.http().post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    )


def test_n_choices(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, temperature=1.0, seed=7, max_tokens=6
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.message.content for c in out.choices)
    assert out.usage.completion_tokens <= 12

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True, **GREEDY)
    )
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] != ""  # greedy: both choices alike


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, temperature=0, max_tokens=5
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and entry.logprob <= 0
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token  # greedy picks the most likely token
        assert bytes(entry.bytes).decode() == entry.token
    if chat.choices[0].finish_reason == "length":
        assert "".join(e.token for e in content) == chat.choices[0].message.content

    legacy = client.completions.create(
        model=MODEL, prompt="Once upon a time", logprobs=2, temperature=0, max_tokens=5
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "The days of the week are Monday, Tuesday,"
    free = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10)
    text = free.choices[0].text
    stop = text.strip().split()[1]  # a word in the middle of the answer
    cut = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=10, stop=[stop, "never seen"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=10, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_models_health_tokenize(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    http = server.http()
    assert http.get("/health").status_code == 200
    text = "Hello, world!"
    tokens = http.post("/tokenize", json={"prompt": text, "model": MODEL}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == CTX
    back = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    # the file's stem names the model too
    stem = server.service.model.path.stem
    assert http.post("/tokenize", json={"prompt": text, "model": stem}).status_code == 200


def test_metrics_after_requests(server: LiveServer, client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    m = metrics(server)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m[(f"dynalm:{gauge}", ())] == 0
    assert m[("dynalm:prefix_cache_queries_total", ())] > m[("dynalm:prefix_cache_hits_total", ())]
    assert m[("dynalm:prefix_cache_hits_total", ())] >= 16  # the repeated prompt
    assert m[("dynalm:request_success_total", (("finished_reason", "length"),))] >= 2
    assert m[("dynalm:prompt_tokens_total", ())] > 0 and m[("dynalm:generation_tokens_total", ())]
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert m[(f"dynalm:{hist}_seconds_count", ())] >= 2


TOO_LONG = "hello " * (CTX + 10)
BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"model": "smollm2:135m", "messages": [', 400),
    "unknown model": ("/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, 404),
    "negative max_tokens": ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400),
    "temperature not a number": ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400),
    "no messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 10**9]}, 400),
    "prompt over the context": ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 4}, 400),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_an_openai_error(server: LiveServer, case: str) -> None:
    path, body, status = BAD_REQUESTS[case]
    http = server.http()
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in r.text


def test_errors_through_the_official_client(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=1)
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong-key"})
    missing = httpx.get(f"{server.url}/v1/models")
    for r in (wrong, missing):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    # the server keeps serving
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_client_disconnect_aborts_the_request(server: LiveServer, stream: bool) -> None:
    aborted = ("dynalm:request_success_total", (("finished_reason", "abort"),))
    before = metrics(server).get(aborted, 0)
    # end-of-turn tokens banned, so the answer runs until the client leaves
    no_eos = {str(i): -100 for i in server.engine.model.stop_token_ids}
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 400,  # (the context's 512 allow ~470) 1.5 s at 300 tokens/s
        "stream": stream,
        "logit_bias": no_eos,
    }
    with server.http() as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                contents = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        contents += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                    if contents == 2:
                        break  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while it generates
                http.post("/v1/chat/completions", json=body, timeout=0.5)
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0  # no page held by a request (the cache may keep some)
    assert metrics(server)[aborted] == before + 1


def test_ignore_eos_runs_past_end_of_turn_tokens(server: LiveServer) -> None:
    """vLLM's ``ignore_eos``: an end-of-turn token pushed to the top by logit_bias ends the
    answer at once, unless ignore_eos asks to run to max_tokens."""
    end = {str(min(server.engine.model.stop_token_ids)): 100}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "logit_bias": end}
    with server.http() as http:
        stopped = http.post("/v1/completions", json=body).json()
        ignored = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 12


def test_a_json_body_sent_as_curl_sends_it(server: LiveServer) -> None:
    """`curl -d '{...}'` (the README's example) labels the body a form; it is read as JSON."""
    body = json.dumps({"model": MODEL, "messages": CHAT, **GREEDY})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with server.http() as http:
        answer = http.post("/v1/chat/completions", content=body, headers=form)
        broken = http.post("/v1/chat/completions", content=body[:-1], headers=form)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    assert broken.status_code == 400 and broken.json()["error"]["message"]
