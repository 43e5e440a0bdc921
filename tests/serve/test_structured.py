"""Structured output against a real server, with the official ``openai`` client: every
answer under ``response_format`` (or vLLM's guided fields) parses and validates against its
schema (`jsonschema`), streamed and not, with n > 1, while unconstrained requests share the
batch; a schema, regex or grammar llguidance rejects is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import MODEL, SERVERS, LiveServer, served

from dynalm.models.loader import LoadedModel

ASK = "Answer in JSON."

# Schemas of every kind llguidance compiles: objects, arrays, enums, consts, numbers with
# ranges, patterns, nesting, anyOf, $ref/$defs, optional properties. Strings are bounded so
# that a small model's answer ends within max_tokens.
NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "Describe a person.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "List three colours.",
        {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3},
    ),
    (
        "Is the sky blue?",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "certainty": {"enum": ["low", "high"]}},
            "required": ["answer", "certainty"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a temperature reading.",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "number", "minimum": -50, "maximum": 60},
                "unit": {"const": "C"},
            },
            "required": ["celsius", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a date.",
        {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    ),
    (
        "Describe a city with its country.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "country": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    },
                    "required": ["name", "code"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a shape.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["circle"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["square"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    (
        "List two pets.",
        {
            "$defs": {
                "pet": {
                    "type": "object",
                    "properties": {"name": NAME, "kind": {"enum": ["cat", "dog", "fish"]}},
                    "required": ["name", "kind"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}
            },
            "required": ["pets"],
            "additionalProperties": False,
        },
    ),
    (
        "Rate a film.",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "review": {"type": "string", "maxLength": 40},
            },
            "required": ["title", "stars"],
            "additionalProperties": False,
        },
    ),
    ("Pick a number.", {"type": "integer", "minimum": 0, "maximum": 1000}),
    (
        "Give coordinates.",
        {"type": "array", "prefixItems": [{"type": "number"}] * 2, "items": False, "minItems": 2},
    ),
    (
        "Give a status.",
        {"type": ["string", "null"], "enum": ["ok", "failed", None]},
    ),
]


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    with served(request, smollm2, ctx=1024, max_num_seqs=16) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {ASK}"}]


def constrained(client: openai.OpenAI, index: int, stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) of each of n=2 sampled answers to schema ``index``."""
    question, schema = SCHEMAS[index]
    kw = dict(
        model=MODEL,
        messages=chat(question),
        response_format=schema_format(schema),
        n=2,
        temperature=0.8,
        seed=index,
        max_tokens=120,
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        return [(c.message.content or "", c.finish_reason) for c in r.choices]
    texts, reasons = ["", ""], ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons, strict=True))


def unconstrained(client: openai.OpenAI, index: int) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=chat(SCHEMAS[index][0]), temperature=0.8, seed=index, max_tokens=40
    )
    return r.choices[0].message.content or ""


def test_every_answer_validates_streamed_and_not_batched_with_free_requests(
    client: openai.OpenAI,
) -> None:
    alone = [unconstrained(client, i) for i in range(4)]
    jobs = [(i, stream) for i in range(len(SCHEMAS)) for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs) + 4) as pool:
        free = [pool.submit(unconstrained, client, i) for i in range(4)]
        answers = {job: pool.submit(constrained, client, *job) for job in jobs}
        results = {job: f.result() for job, f in answers.items()}
        # the unconstrained rows of the same steps: the same text as alone (seeded)
        assert [f.result() for f in free] == alone
    for (index, stream), pair in results.items():
        schema = SCHEMAS[index][1]
        for text, reason in pair:
            where = f"schema {index} ({'streamed' if stream else 'whole'}): {text!r}"
            assert reason == "stop", where
            jsonschema.validate(json.loads(text), schema)


def test_json_object_and_completions_guided_json(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat('Reply with {"ok": true}.'),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    schema = SCHEMAS[0][1]
    c = client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_json": schema},
    )
    jsonschema.validate(json.loads(c.choices[0].text), schema)


class Colour(BaseModel):
    name: str = Field(max_length=12)
    warm: bool


class Palette(BaseModel):
    theme: Literal["sea", "forest", "desert"]
    colours: list[Colour] = Field(min_length=2, max_length=3)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        r = parse(
            model=MODEL,
            messages=chat("Make a palette of colours."),
            response_format=Palette,
            temperature=0,
            max_tokens=120,
        )
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Palette) and 2 <= len(parsed.colours) <= 3


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        (
            {"structured_outputs": {"regex": r"(red|blue) [a-z]{2,6}"}},
            lambda t: t.split()[0] in ("red", "blue"),
        ),
        ({"structured_outputs": {"json": SCHEMAS[1][1]}}, lambda t: len(json.loads(t)) == 3),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"guided_grammar": 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'},
            lambda t: t.startswith("The answer is ") and t.endswith("."),
        ),
    ],
)
def test_vllm_extensions(client: openai.OpenAI, extra: dict[str, Any], check: Any) -> None:
    for stream in (False, True):
        kw = dict(
            model=MODEL, messages=chat('Reply with {"ok": true}.'), temperature=0, max_tokens=60
        )
        if stream:
            chunks = client.chat.completions.create(**kw, extra_body=extra, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
        assert check(text), text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {
                "response_format": schema_format(
                    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
                )
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": schema_format({"type": "integer", "minimum": 5, "maximum": 1})},
            "schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"structured_outputs": {}}, "structured_outputs"),
    ],
)
def test_rejected_constraints_are_400_naming_the_problem(
    server: LiveServer, body: dict[str, Any], named: str
) -> None:
    r = server.http().post(
        "/v1/chat/completions", json={"messages": chat("Hi."), "max_tokens": 4, **body}
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert named in message and "\n" not in message, message
    assert server.http().get("/health").status_code == 200
