"""Hostile input, round 2, on the serving surfaces: structured output, tool calls, log-probs
and /v1/completions' smaller corners. Output that does not match its constraint never comes
back as ``finish_reason: "stop"`` (a limit known up front is a 400 naming the field and the
limit; a grammar that gives up while generating is an error), every log-prob is finite, the
event loop never parses model output, and the server keeps serving after each case."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serving import MODEL, SERVERS, LiveServer, served
from test_hostile import assert_error

from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.engine import _token_logprob
from dynalm.runtime.serve import structured, tools
from dynalm.runtime.serve.protocol import MAX_SEED, MAX_STOP_CHARS
from dynalm.runtime.serve.structured import MAX_CHOICES, MAX_REGEX_EXPANSION, MAX_SCHEMA_DEPTH

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    with served(
        request, smollm2, ctx=1024, max_num_seqs=4, max_queue=32, body_timeout_s=BODY_TIMEOUT_S
    ) as s:
        yield s


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    return server.http().post(CHAT, json={"messages": HI, "max_tokens": 8, **body})


def events(r: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, up to ``[DONE]``."""
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text[-500:]
    return [json.loads(ln) for ln in lines[:-1]]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# ---------------------------------------------------------------- tool-call parsing


def test_tool_call_parse_of_100k_adversarial_characters_is_linear() -> None:
    # `<tool_call>` then spaces once backtracked quadratically on the event loop (218 s)
    plan = tools.ToolPlan([tools.Tool.model_validate(WEATHER)], "auto", True, False, False)
    for text in (
        "<tool_call>" + " " * 100_000,
        "<tool_call>" * 9_000,
        "<tool_call>\n" + "{" * 50_000 + "\n</tool_call>" + " " * 40_000,
    ):
        t0 = time.perf_counter()
        content, calls = plan.parse(text)
        assert plan.looping(text) is False
        assert time.perf_counter() - t0 < 0.1
        assert calls == [] and content == text


def test_repeated_tool_calls_are_one_call_and_a_loop() -> None:
    plan = tools.ToolPlan([tools.Tool.model_validate(WEATHER)], "required", True, False, False)
    paris = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rome = paris.replace("Paris", "Rome")
    assert not plan.looping(paris) and not plan.looping(f"{paris}\n{rome}")
    assert plan.looping(f"{paris}\n{rome}\n{paris}")
    _, calls = plan.parse(f"{paris}\n{rome}\n{paris}\n{paris}")
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def _get(url: str, path: str) -> float:
    t0 = time.perf_counter()
    assert httpx.get(f"{url}{path}", timeout=60).status_code == 200
    return time.perf_counter() - t0


def test_health_answers_while_a_tool_call_of_spaces_is_generated(server: LiveServer) -> None:
    body = {
        "messages": HI,
        "tools": [WEATHER],
        "guided_regex": "<tool_call> +x",  # (spaces until "x": past max_tokens)
        "max_tokens": 300,
        "temperature": 0,
    }
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.update(r=server.http().post(CHAT, json=body)))
    worker.start()
    waits = []
    while worker.is_alive():
        waits.append(_get(server.url, "/health"))
        time.sleep(0.05)
    worker.join()
    r = result["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"].startswith("<tool_call>   ")
    assert waits and max(waits) < 5, waits  # (once minutes: the parse held the event loop)


# ---------------------------------------------------------------- log-probs under constraints


def _finite_chat_logprobs(content: list[dict[str, Any]], top: int) -> None:
    assert content
    for entry in content:
        assert isinstance(entry["logprob"], float) and math.isfinite(entry["logprob"])
        assert 1 <= len(entry["top_logprobs"]) <= top
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), values
        assert values == sorted(values, reverse=True)


CONSTRAINED = {
    "json_schema": {
        "response_format": schema_format(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        )
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "tool_choice required": {"tools": [WEATHER], "tool_choice": "required"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
}


@pytest.mark.parametrize("case", CONSTRAINED)
@pytest.mark.parametrize("stream", [False, True])
def test_constraint_with_top_logprobs_20_is_finite(
    server: LiveServer, case: str, stream: bool
) -> None:
    r = chat(
        server,
        **CONSTRAINED[case],
        logprobs=True,
        top_logprobs=20,
        max_tokens=12,
        temperature=0,
        stream=stream,
    )
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c["choices"][0] for c in events(r) if c["choices"]]
        content = [e for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    _finite_chat_logprobs(content, 20)


def test_masked_row_logprobs_are_the_allowed_tokens_only() -> None:
    row = np.full(100, -np.inf, np.float32)
    row[[3, 7]] = [1.0, 2.0]
    lp = _token_logprob(row, 7, 20)
    assert [t for t, _ in lp.top_logprobs] == [7, 3]
    assert math.isclose(sum(math.exp(v) for _, v in lp.top_logprobs), 1.0)
    assert all(math.isfinite(v) for _, v in lp.top_logprobs) and math.isfinite(lp.logprob)


def test_completions_guided_json_with_logprobs_is_finite(server: LiveServer) -> None:
    body = {"prompt": "JSON:", "max_tokens": 8, "logprobs": 5, "guided_json": {"type": "object"}}
    r = server.http().post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert all(math.isfinite(v) for v in lp["token_logprobs"])
    assert all(math.isfinite(v) for top in lp["top_logprobs"] for v in top.values())


# ---------------------------------------------------------------- constraints that cannot hold

INT_4000 = "9" * 4000  # read (Python's limit is 4,300 digits), then refused by the schema check
INT_5000 = "9" * 5000
# name: (body, words the 400 names)
REFUSED: dict[str, tuple[dict[str, Any] | str, tuple[str, ...]]] = {
    "guided_choice of 10,000 options": (
        {"guided_choice": [f"opt{i}" for i in range(10_000)]},
        ("guided_choice", f"at most {MAX_CHOICES}"),
    ),
    "structured_outputs.choice of 10,000 options": (
        {"structured_outputs": {"choice": [f"opt{i}" for i in range(10_000)]}},
        ("structured_outputs.choice", f"at most {MAX_CHOICES}"),
    ),
    "schema whose root $refs itself": (
        {"response_format": schema_format({"$ref": "#"})},
        ("response_format.json_schema.schema", "$ref", "leads back to itself"),
    ),
    "schema whose $refs loop": (
        {
            "guided_json": {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            }
        },
        ("guided_json", "leads back to itself", "#/$defs/b"),
    ),
    "integer schema with 5,000-digit bounds": (
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": '
        '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", '
        f'"minimum": -{INT_4000}, "maximum": {INT_4000}}}}}}}}}',
        ("response_format.json_schema.schema", "/maximum (4000 digits)", "out of range", "2**63"),
    ),
    "tool parameters with a 5,000-digit bound": (
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "tools": [{"type": '
        '"function", "function": {"name": "f", "parameters": {"type": "object", "properties": '
        f'{{"n": {{"type": "integer", "maximum": {INT_4000}}}}}}}}}}}]}}',
        ("tools.0.function.parameters", "/properties/n/maximum", "out of range"),
    ),
    "integer schema with 5,000-digit bounds in the body": (
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "guided_json": '
        f'{{"type": "integer", "minimum": {INT_5000}}}}}',
        ("not valid JSON", "number out of range", "at most 4300 digits"),
    ),
    "schema nested deeper than the limit": (
        {"guided_json": json.loads('{"items": ' * 150 + "{}" + "}" * 150)},
        ("guided_json", f"nested deeper than {MAX_SCHEMA_DEPTH}"),
    ),
    "three stop strings of 200,000 characters": (
        {"stop": ["a" * 200_000, "b" * 200_000, "c" * 200_000]},
        ("stop.0", f"at most {MAX_STOP_CHARS} characters"),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_constraint_over_a_limit_is_a_400_before_generation(server: LiveServer, case: str) -> None:
    body, fragments = REFUSED[case]
    if isinstance(body, dict):
        body = json.dumps({"messages": HI, "max_tokens": 4, **body})
    r = server.http().post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, *fragments)
    assert server.http().get("/health").status_code == 200


# llguidance compiles these, then gives up on the first token ("too many expressions"): its
# mask then allows only the end token, and the answer used to end "stop" with invalid text.
# (A regex or a schema's pattern of such repeats is refused before: `REPEATS` below.)
GIVES_UP = {
    "Lark grammar with a huge repeat": (
        {"guided_grammar": "start: /(a{1000}){1000}/"},
        "guided_grammar",
    ),
}


LIMIT = f"more than the limit of {MAX_REGEX_EXPANSION}"
# Issue 25: counted repeats were accepted, and each cost the mask of every step (a{100000}:
# ~45 ms on an idle core, 1 s on a busy one, against 0.7 ms for a{1000}); or llguidance gave
# up on them. Refused before generation, naming the field and the limit.
REPEATS = {
    "guided_regex a{100000}": (
        {"guided_regex": "a{100000}"},
        f"guided_regex: its counted repeats expand the regex to 100000 characters, {LIMIT}",
    ),
    "guided_regex (a{1000}){1000}": (
        {"guided_regex": "(a{1000}){1000}"},
        f"guided_regex: its counted repeats expand the regex to 1000000 characters, {LIMIT}",
    ),
    "structured_outputs.regex a{5000}": (
        {"structured_outputs": {"regex": "x: a{5000}"}},
        f"structured_outputs.regex: its counted repeats expand the regex to 5003 characters, "
        f"{LIMIT}",
    ),
    "guided_regex with a 5,000-digit count": (
        {"guided_regex": "a{" + "9" * 5000 + "}"},
        f"guided_regex: its counted repeats expand the regex to 1000000000 characters, {LIMIT}",
    ),
    "schema string pattern (a{1000}){1000}": (
        {
            "response_format": schema_format(
                {
                    "type": "object",
                    "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                    "required": ["a"],
                }
            )
        },
        "response_format.json_schema.schema: the pattern at /properties/a/pattern: its counted "
        f"repeats expand the regex to 1000000 characters, {LIMIT}",
    ),
}


@pytest.mark.parametrize("case", REPEATS)
def test_a_huge_counted_repeat_is_a_400_naming_the_field_and_the_limit(
    server: LiveServer, case: str
) -> None:
    body, message = REPEATS[case]
    for stream in (False, True):
        r = chat(server, **body, max_tokens=8, stream=stream)
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
    ok = chat(server, guided_regex="(ab){500}", max_tokens=8, temperature=0)  # at the limit
    assert ok.status_code == 200, ok.text
    content = ok.json()["choices"][0]["message"]["content"]
    assert content.startswith("ab") and not content.replace("ab", ""), content


# A possessive quantifier (Python's re and PCRE: x?+ is x? that never gives back) read by
# llguidance as a repeat of a repeat, (x?)+: the structured fuzz's seed 3205089014 got
# 'xxxxxx   ' for x?+ {1,3}. Refused, naming the quantifier; a lazy one (x??) is the
# same language as its greedy twin and is served.
POSSESSIVE = {
    "x?+ {1,3}": ("guided_regex", "guided_regex: the possessive quantifier '?+' at character 2"),
    "a{2}+b": ("guided_regex", "guided_regex: the possessive quantifier '}+' at character 4"),
    "start: /x*+y/": (
        "guided_grammar",
        "guided_grammar: the regex /x*+y/: the possessive quantifier '*+' at character 2",
    ),
}


@pytest.mark.parametrize("pattern", POSSESSIVE)
def test_a_possessive_quantifier_is_a_400_naming_it(server: LiveServer, pattern: str) -> None:
    field, message = POSSESSIVE[pattern]
    r = chat(server, **{field: pattern}, max_tokens=8)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
    ok = chat(server, guided_regex="x?? {1,3}", max_tokens=8, temperature=1.5, seed=9)
    assert ok.status_code == 200, ok.text
    assert re.fullmatch("x? {1,3}", ok.json()["choices"][0]["message"]["content"]), ok.text


# Issue 25: the regexes and counted repeats of a Lark or GBNF grammar were not checked (the
# same costs as a regex's: each step's mask). Counted the same way, through the rules a rule
# uses (nested repeats multiply), and refused past the same limit, naming the rule.
GRAMMAR_REPEATS = {
    "Lark regex a{20000}": (
        {"guided_grammar": "start: /a{20000}/"},
        f"guided_grammar: the rule 'start' expands to 20000 characters, {LIMIT}",
    ),
    "Lark literal repeated 2000 times": (
        {"guided_grammar": 'start: "a"{2000}'},
        f"guided_grammar: the rule 'start' expands to 2000 characters, {LIMIT}",
    ),
    "Lark x ~ 5..2000": (
        {"guided_grammar": 'start: x ~ 5..2000\nx: "a"'},
        f"guided_grammar: the rule 'start' expands to 2000 characters, {LIMIT}",
    ),
    "repeats nested through rules": (
        {"guided_grammar": 'start: x{150}\nx: y{150}\ny: "a"'},
        f"guided_grammar: the rule 'start' expands to 22500 characters, {LIMIT}",
    ),
    "terminals nested through terminals": (
        {"structured_outputs": {"grammar": 'start: X\nX: Y{150}\nY: "ab"{150}'}},
        f"structured_outputs.grammar: the rule 'X' expands to 45000 characters, {LIMIT}",
    ),
    "rules used ten times, four deep": (
        {
            "guided_grammar": "start: a\n"
            + "".join(f"{r}: {' '.join([n] * 10)}\n" for r, n in zip("abcd", "bcde", strict=True))
            + 'e: "x"'
        },
        f"guided_grammar: the rule 'a' expands to 10000 characters, {LIMIT}",
    ),
    "GBNF [a-z]{5000}": (
        {"guided_grammar": "root ::= [a-z]{5000}"},
        f"guided_grammar: the rule 'start' expands to 5000 characters, {LIMIT}",
    ),
    "a %ignore regex": (
        {"guided_grammar": '%ignore /[ ]{9999}/\nstart: "a"'},
        f"guided_grammar: the rule '%ignore' expands to 9999 characters, {LIMIT}",
    ),
    "a 5,000-digit count": (
        {"guided_grammar": 'start: "a"{' + "9" * 5000 + "}"},
        f"guided_grammar: the rule 'start' expands to 1000000000 characters, {LIMIT}",
    ),
    "a %json schema's pattern": (
        {"guided_grammar": 'start: "x" %json {"type": "string", "pattern": "a{5000}"}'},
        "guided_grammar: %json: the pattern at /pattern: its counted repeats expand the regex "
        f"to 5000 characters, {LIMIT}",
    ),
}


@pytest.mark.parametrize("case", GRAMMAR_REPEATS)
def test_a_grammar_whose_repeats_expand_past_the_limit_is_a_400_naming_the_rule(
    server: LiveServer, case: str
) -> None:
    body, message = GRAMMAR_REPEATS[case]
    for stream in (False, True):
        r = chat(server, **body, max_tokens=8, stream=stream)
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
    # just under the limit (997), through two rules and a recursive one,, a grammar still generates
    grammar = 'start: x{2} "." | y\nx: "ab"{248}\ny: "[" y "]" | "0"'
    ok = chat(server, guided_grammar=grammar, max_tokens=8, temperature=0)
    assert ok.status_code == 200, ok.text
    content = ok.json()["choices"][0]["message"]["content"]
    assert content.startswith(("ab", "[", "0")), content


@pytest.mark.parametrize("case", GIVES_UP)
def test_grammar_that_gives_up_is_an_error_never_stop(
    server: LiveServer, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the expansion limit now refuses this before llguidance sees it: lifted here, so that
    # llguidance's own giving up is still what is tested)
    monkeypatch.setattr(structured, "MAX_REGEX_EXPANSION", 10**12)
    body, field = GIVES_UP[case]
    r = chat(server, **body, max_tokens=64)
    assert_error(r, 400, field, "gave up")
    r = chat(server, **body, max_tokens=64, stream=True)
    assert r.status_code == 200
    sent = events(r)
    assert (
        sent[-1]["error"]["message"].startswith(field) and "gave up" in sent[-1]["error"]["message"]
    )
    assert not [c for c in sent[:-1] for ch in c["choices"] if ch.get("finish_reason")]
    assert server.http().get("/health").status_code == 200


def test_24_concurrent_hostile_constraints_are_4xx_or_valid(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    bodies = [
        *(v[0] for v in REFUSED.values() if isinstance(v[0], dict) and "stop" not in v[0]),
        *(v[0] for v in GIVES_UP.values()),
        {"response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 20},
        {"guided_choice": ["red", "green"]},
        {"guided_regex": "[0-9]{3}"},
    ]
    jobs = [bodies[i % len(bodies)] for i in range(24)]
    results: list[httpx.Response | None] = [None] * len(jobs)

    def send(i: int) -> None:
        results[i] = chat(server, **jobs[i], max_tokens=16, temperature=0)

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    for body, r in zip(jobs, results, strict=True):
        assert r is not None
        assert r.status_code in (200, 400), r.text[:300]
        if r.status_code == 200 and (choice := body.get("guided_choice")):
            assert r.json()["choices"][0]["message"]["content"] in choice
        if r.status_code == 200 and "guided_regex" in body:
            assert re.fullmatch(body["guided_regex"], r.json()["choices"][0]["message"]["content"])
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0


def test_cli_json_schema_deeply_nested_or_5000_digits_is_a_clear_error(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    cases = {
        "deep.json": ('{"items": ' * 5000 + "{}" + "}" * 5000, "cannot read a JSON schema"),
        "digits.json": (f'{{"type": "integer", "minimum": {INT_5000}}}', "out of range"),
    }
    for name, (text, words) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        run = subprocess.run(
            [sys.executable, "-m", "dynalm.cli", "run", str(smollm2_gguf), "hi"]
            + ["--json-schema", str(path), "--max-tokens", "4"],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ),
        )
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
        errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "--json-schema" in errors[0] and words in errors[0], errors


# ---------------------------------------------------------------- tool loops


def test_required_tool_call_repeated_ends_as_tool_calls(server: LiveServer) -> None:
    # SmolLM2 writes this call again and again until max_tokens: the answer ends after the
    # first repeat, each distinct call once
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 300,
        "temperature": 0,
    }
    r = server.http().post(CHAT, json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    assert calls and len(set(calls)) == len(calls)
    assert answer["usage"]["completion_tokens"] < 300
    streamed = events(server.http().post(CHAT, json={**body, "stream": True}))
    finishes = [ch["finish_reason"] for c in streamed for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"]
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0


# ---------------------------------------------------------------- /v1/completions corners


def _offsets_ok(choice: dict[str, Any]) -> list[int]:
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets), offsets
    assert all(0 <= o <= len(choice["text"]) for o in offsets)
    return offsets


def test_echo_text_offset_never_goes_backwards_for_multibyte_and_special_tokens(
    server: LiveServer,
) -> None:
    prompt = "<|im_start|>user\n日本語 🙂🙂 é<|im_end|>\n"
    body = {"prompt": prompt, "max_tokens": 12, "echo": True, "logprobs": 1, "temperature": 0}
    r = server.http().post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    offsets = _offsets_ok(choice)
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert offsets[n_prompt] == len(prompt)  # the answer's first token starts after the echo
    streamed = [
        c["choices"][0]
        for c in events(server.http().post(COMPLETIONS, json={**body, "stream": True}))
    ]
    offsets = [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets)
    assert "".join(c["text"] for c in streamed) == choice["text"]


def test_half_sent_request_is_408_and_the_server_keeps_serving(server: LiveServer) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        t0 = time.monotonic()
        reply = sock.recv(65536).decode()
        waited = time.monotonic() - t0
    assert reply.startswith("HTTP/1.1 408"), reply
    assert f"within {BODY_TIMEOUT_S:g} s" in reply
    assert BODY_TIMEOUT_S * 0.5 < waited < BODY_TIMEOUT_S + 10
    assert server.http().get("/health").status_code == 200


def test_largest_seed_with_n_2_gives_two_choices(server: LiveServer) -> None:
    body = {"prompt": "Once", "max_tokens": 4, "seed": MAX_SEED, "n": 2}
    r = server.http().post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    again = server.http().post(COMPLETIONS, json=body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r.json()["choices"]]


def test_still_serving(server: LiveServer) -> None:
    r = chat(server, model=MODEL, temperature=0)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
