"""Log-probs of the prompt on /v1/completions: OpenAI's legacy ``echo`` with ``logprobs``
(the prompt's tokens first, the very first one null) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from serving import MODEL, SERVERS, LiveServer, served

from dynalm.models.loader import LoadedModel

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    # a small step budget: a longer prompt is scored over several chunks
    with served(request, smollm2, ctx=512, max_num_batched_tokens=16) as s:
        yield s


def complete(server: LiveServer, **body: object) -> dict:
    r = server.http().post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(server: LiveServer, text: str) -> list[int]:
    return server.http().post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_returns_the_prompt_and_its_logprobs_first_null(server: LiveServer) -> None:
    ids = prompt_ids(server, PROMPT)
    answer = complete(server, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 3
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:])
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    # offsets run over the whole text: the answer's tokens come after the prompt's
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    spans = zip(lp["text_offset"], lp["tokens"], strict=True)
    assert [choice["text"][o : o + len(t)] for o, t in spans] == lp["tokens"]
    # echo without logprobs: the text only; without echo, no prompt
    assert (
        complete(server, prompt=PROMPT, max_tokens=3, echo=True)["choices"][0]["text"]
        == (choice["text"])
    )
    plain = complete(server, prompt=PROMPT, max_tokens=3)["choices"][0]
    assert PROMPT + plain["text"] == choice["text"]
    # the official client reads it, vLLM's extension through extra_body
    official = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 1},
    )
    assert official.choices[0].text == choice["text"]
    assert official.choices[0].logprobs.token_logprobs == lp["token_logprobs"]
    assert len(official.choices[0].model_extra["prompt_logprobs"]) == len(ids)


def test_a_prompt_token_scores_as_it_was_generated(server: LiveServer) -> None:
    """The greedy answer's first token, appended to the prompt, gets the same log-prob as a
    prompt token (one forward pass over the same tokens) as it had as the answer's."""
    first = complete(server, prompt=PROMPT, max_tokens=1, logprobs=0)["choices"][0]
    generated = first["logprobs"]["token_logprobs"][0]
    ids = prompt_ids(server, PROMPT + first["text"])
    assert ids[: len(prompt_ids(server, PROMPT))] == prompt_ids(server, PROMPT)
    echoed = complete(server, prompt=ids, max_tokens=1, echo=True, logprobs=0)["choices"][0]
    assert echoed["logprobs"]["token_logprobs"][len(ids) - 1] == pytest.approx(generated, abs=1e-3)


def test_scoring_skips_the_prefix_cache_and_chunks_agree(server: LiveServer) -> None:
    long = PROMPT + " Paris. " + "The capital of Germany is Berlin. " * 6  # several chunks
    once = complete(server, prompt=long, max_tokens=1, echo=True, logprobs=1)
    twice = complete(server, prompt=long, max_tokens=1, echo=True, logprobs=1)  # cached now
    assert twice["choices"][0]["logprobs"] == once["choices"][0]["logprobs"]
    assert len(once["choices"][0]["logprobs"]["tokens"]) == len(prompt_ids(server, long)) + 1


def test_vllm_prompt_logprobs(server: LiveServer) -> None:
    ids = prompt_ids(server, PROMPT)
    answer = complete(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=3, echo=True, logprobs=0)
    choice = answer["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    echoed = choice["logprobs"]["token_logprobs"]
    for i, entry in enumerate(scored[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echoed[i]) and own["rank"] >= 1
        assert 3 <= len(entry) <= 4  # the three best, and the prompt's own if not among them
        best = sorted(entry.values(), key=lambda e: -e["logprob"])[0]
        assert best["rank"] == 1
    assert complete(server, prompt=PROMPT, max_tokens=1)["choices"][0]["prompt_logprobs"] is None


def test_streamed_echo_equals_the_collected_one(server: LiveServer) -> None:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 4, "echo": True, "logprobs": 1}
    prompts = [PROMPT, "Water boils at"]
    collected = complete(server, prompt=prompts, n=2, max_tokens=4, echo=True, logprobs=1)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    with server.http().stream(
        "POST", "/v1/completions", json={**body, "prompt": prompts, "n": 2, "stream": True}
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["logprobs"]:
                    tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
    for c in collected["choices"]:
        assert c["text"].startswith(prompts[c["index"] // 2])
        assert texts[c["index"]] == c["text"]
        assert tokens[c["index"]] == c["logprobs"]["tokens"]
