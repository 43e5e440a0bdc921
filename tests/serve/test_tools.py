"""Tool calls against a real server with the official ``openai`` client: ``required`` and a
named function generate calls under a grammar (``message.tool_calls`` with ids, arguments
valid against the function's parameters, ``finish_reason: "tool_calls"``), streamed as
``tool_calls`` deltas equal to the whole answer; ``parallel_tool_calls``; ``none``; tool
results going back through the template; refusals as 400s. (SmolLM2's template takes no
tools: the fallback prompt shows them.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from serving import MODEL, SERVERS, LiveServer, served

from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.tools import FALLBACK_PROMPT

CITY = {"type": "string", "minLength": 1, "maxLength": 20}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, smollm2: LoadedModel) -> Iterator[LiveServer]:
    with served(request, smollm2, ctx=2048) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[str, list[dict], str | None]:
    """Content, calls accumulated from ``tool_calls`` deltas, and the finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_required_and_named_calls_streamed_and_not(client: openai.OpenAI, choice: Any) -> None:
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    # one call: allowed more, SmolLM2 goes on calling until max_tokens (see the test below)
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, **GREEDY)
    r = client.chat.completions.create(model=MODEL, **kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    check_calls(message.tool_calls, names)
    content, calls, reason = streamed_calls(client, **kw)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_calls(client: openai.OpenAI, parallel: bool) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        n=2,
        temperature=0.5,
        seed=5,
        max_tokens=100,
    )
    for choice in r.choices:
        calls = choice.message.tool_calls
        check_calls(calls, {"get_weather", "get_time"})
        if parallel:  # every whole call is kept, even when max_tokens cut a later one
            assert len(calls) > 1 and choice.finish_reason in ("tool_calls", "length")
        else:
            assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_auto_streamed_equals_whole(client: openai.OpenAI) -> None:
    """The model chooses; whatever it wrote, the stream says the same as the whole answer."""
    for question in ("What is the weather in Paris?", "Say hello."):
        kw = dict(messages=[{"role": "user", "content": question}], tools=TOOLS, **GREEDY)
        whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
        content, calls, reason = streamed_calls(client, **kw)
        # (the stream sends the text before a call as written, the whole answer stripped)
        assert content.strip() == (whole.message.content or "").strip()
        assert reason == whole.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()
        ]
        if calls:
            check_calls(whole.message.tool_calls, {"get_weather", "get_time"})


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_go_back_through_the_template(
    server: LiveServer, client: openai.OpenAI
) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the model read: the tools, its own call and the result
    request = p.ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    plan = tools.plan(request, server.service.model.chat_template.source)
    ids = server.service.chat_ids(request.messages, True, plan)
    prompt = server.service.tokenizer.decode(ids, skip_special=False)
    assert FALLBACK_PROMPT in prompt
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"tool_choice": "required"}, "no tools are given"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"$ref": "#/missing"}},
                    }
                ],
                "tool_choice": "required",
            },
            "parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ],
)
def test_bad_tools_are_400(server: LiveServer, body: dict[str, Any], named: str) -> None:
    r = server.http().post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"], r.json()
