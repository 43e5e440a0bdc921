"""Where OpenAI's API (and vLLM's) define the behaviour: max_tokens past the context is a
400, not a silent clamp; presence and frequency penalties count generated tokens only; a
stream's status and headers come at once, while the request still waits for a slot."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from serving import MODEL, SERVERS, LiveServer, on_cluster, served

from dynalm.models.loader import LoadedModel

CTX = 256
REPEATING = "one two one two one two one two one"


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    # one running sequence: a second request has to wait in the queue
    with served(request, smollm2, ctx=CTX, max_num_seqs=1) as s:
        yield s


def _prompt_tokens(server: LiveServer, text: str) -> int:
    return server.http().post("/tokenize", json={"prompt": text}).json()["count"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_beyond_the_context_left_is_400(server: LiveServer, endpoint: str) -> None:
    http = server.http()
    if endpoint == "/v1/completions":
        body = {"model": MODEL, "prompt": "Once upon a time"}
        used = _prompt_tokens(server, body["prompt"])
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        used = http.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
    room = CTX - used
    refused = http.post(endpoint, json={**body, "max_tokens": room + 1})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"leaves {room} after the prompt's {used}" in error["message"]
    # exactly what is left is fine; streamed, the refusal is a status too, not an event
    ok = http.post(endpoint, json={**body, "max_tokens": room, "temperature": 0})
    assert ok.status_code == 200, ok.text
    streamed = http.post(endpoint, json={**body, "max_tokens": room + 1, "stream": True})
    assert streamed.status_code == 400


def _first_token_logprobs(server: LiveServer, **penalties: float) -> dict[str, float]:
    body = {
        "model": MODEL,
        # the prompt is full of the words the answer would repeat
        "prompt": REPEATING,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 5,
        **penalties,
    }
    answer = server.http().post("/v1/completions", json=body).json()
    return answer["choices"][0]["logprobs"]["top_logprobs"][0]


def test_presence_and_frequency_penalties_count_generated_tokens_only(
    server: LiveServer,
) -> None:
    plain = _first_token_logprobs(server)
    assert max(plain, key=plain.get) == " two", plain  # the model goes on repeating
    # nothing is generated before the first token: OpenAI's penalties change nothing yet
    assert _first_token_logprobs(server, presence_penalty=2, frequency_penalty=2) == plain
    # the repetition penalty (vLLM's) does count the prompt: the check can see a change
    assert _first_token_logprobs(server, repetition_penalty=2.0) != plain

    # once generated, a token is penalised: at the second step, the first token's logit is
    # 2 lower than unpenalised (relative to any other token: normalisation cancels out)
    def second_step(**penalties: float) -> tuple[str, dict[str, float]]:
        body = {
            "model": MODEL,
            "prompt": REPEATING,
            "max_tokens": 2,
            "temperature": 0,
            "logprobs": 20,
            "ignore_eos": True,
            **penalties,
        }
        answer = server.http().post("/v1/completions", json=body).json()
        logprobs = answer["choices"][0]["logprobs"]
        return logprobs["tokens"][0], logprobs["top_logprobs"][1]

    first, plain = second_step()
    first_penalised, penalised = second_step(presence_penalty=2)
    assert first == first_penalised == " two"
    other = next(t for t in plain if t != first and t in penalised)
    shift = (penalised[first] - penalised[other]) - (plain[first] - plain[other])
    assert shift == pytest.approx(-2, abs=1e-3)


def test_a_stream_opens_while_its_request_waits(server: LiveServer) -> None:
    if on_cluster(server):  # the other replica has a free slot: nothing waits
        pytest.skip("one engine's queue: on a cluster the second request runs on the other replica")
    http = server.http()
    never_stop = {str(t): -100 for t in server.service.model.stop_token_ids}
    busy = {
        "model": MODEL,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 200,
        "stream": True,
        "logit_bias": never_stop,
    }
    with http.stream("POST", "/v1/completions", json=busy) as running:
        lines = running.iter_lines()
        next(lines)  # generating: the only slot is taken
        waiting = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        t0 = time.monotonic()
        with server.http().stream(
            "POST", "/v1/chat/completions", json={**waiting, "stream": True, "max_tokens": 4}
        ) as queued:
            opened = time.monotonic() - t0
            # the headers are here, and the request has not started: it is still queued
            assert queued.status_code == 200
            assert queued.headers["content-type"].startswith("text/event-stream")
            assert server.engine.stats.num_waiting == 1, server.engine.stats
            assert opened < 5
            # its opening chunk (the assistant's role) is there at once too
            assert '"role":"assistant"' in next(queued.iter_lines())
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
