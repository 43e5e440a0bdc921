"""gpt-oss's chat format ("harmony") through the real server: SmolLM2 served with gpt-oss's
own chat template (tests/models/data), its answers made harmony by constrained decoding (the
grammar of ``tool_choice: required``, a ``guided_regex`` of an analysis and a final message),
read back as OpenAI's ``reasoning_content``, ``content`` and ``tool_calls``, streamed and
whole, with no control token reaching the client; Ollama's ``think`` and shapes. (SmolLM2's
vocabulary has no harmony tokens, so here they are text; gpt-oss's are control tokens, which
the server reads from the token ids.)"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import openai
import pytest
from serving import MODEL, LiveServer, live_server
from test_tools import WEATHER

from dynalm.models.chat_template import ChatTemplate
from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.generation import Choice
from dynalm.runtime.serve.harmony import MARKERS
from dynalm.runtime.serve.ollama import _OllamaChat

GPT_OSS = Path(__file__).parents[1] / "models" / "data" / "openai-gpt-oss-120b.jinja"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WORDS = r"[a-z]{1,10}( [a-z]{1,10}){1,3}"
THEN_ANSWER = (  # an analysis message, then the final one
    rf"<\|channel\|>analysis<\|message\|>{WORDS}<\|end\|>"
    rf"<\|start\|>assistant<\|channel\|>final<\|message\|>{WORDS}\."
)


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    template = ChatTemplate.for_family(
        GPT_OSS.read_text(), "gpt-oss's template", "llama", smollm2.tokenizer
    )
    with live_server(dataclasses.replace(smollm2, chat_template=template), ctx=2048) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str, list[dict], str | None]:
    """Reasoning, content, calls (from ``tool_calls`` deltas) and the finish reason."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return reasoning, content, [calls[i] for i in sorted(calls)], reason


def no_markers(*texts: str | None) -> bool:
    return not any(m in (t or "") for m in MARKERS for t in texts)


def prompt_of(server: LiveServer, body: dict[str, Any]) -> str:
    request = p.ChatCompletionRequest.model_validate(body)
    plan = tools.plan(request, server.service.model.chat_template.source)
    ids = server.service.chat_ids(request.messages, True, plan, request.reasoning_effort)
    return server.service.tokenizer.decode(ids, skip_special=False)


def test_required_call_is_a_commentary_message(server: LiveServer, client: openai.OpenAI) -> None:
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    r = client.chat.completions.create(model=MODEL, **kw)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    assert reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    reasoning, content, calls, reason = streamed(client, **kw)
    assert (reasoning, content, reason) == ("", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    prompt = prompt_of(server, {"messages": ASK, "tools": [WEATHER]})
    assert "type get_weather = (_: {\ncity: string,\nunit: any,\n}) => any;" in prompt
    assert prompt.endswith(
        "<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant"
    )  # noqa: E501


def test_reasoning_and_answer_come_apart(client: openai.OpenAI) -> None:
    kw = dict(
        messages=ASK,
        temperature=0,
        max_tokens=80,
        reasoning_effort="low",
        extra_body={"guided_regex": THEN_ANSWER},
    )
    r = client.chat.completions.create(model=MODEL, **kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not message.tool_calls
    assert re.fullmatch(WORDS, message.reasoning_content), message
    assert re.fullmatch(rf"{WORDS}\.", message.content), message
    reasoning, content, calls, reason = streamed(client, **kw)
    assert (reasoning, content, calls, reason) == (
        message.reasoning_content,
        message.content,
        [],
        "stop",
    )


def test_history_goes_back_as_the_template_wants(server: LiveServer, client: openai.OpenAI) -> None:
    """The call, its reasoning (kept: no final answer after it yet) and the tool's result."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    said = {"role": "assistant", "content": None, "tool_calls": [call]}
    history = [
        {"role": "developer", "content": "Be brief."},
        *ASK,
        {**said, "reasoning_content": "I should call the tool."},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    prompt = prompt_of(
        server, {"messages": history, "tools": [WEATHER], "reasoning_effort": "high"}
    )  # noqa: E501
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'  # noqa: E501
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 21 C"<|end|>'  # noqa: E501
    ) in prompt
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=16
    )
    message = r.choices[0].message
    assert no_markers(message.content, getattr(message, "reasoning_content", None))


def test_ollama_think(server: LiveServer) -> None:
    """``think`` is taken for a harmony template (a level is its reasoning effort); the answer
    carries no control token whatever the model wrote."""
    body = {"model": MODEL, "messages": ASK, "stream": False, "think": "low"}
    body["options"] = {"temperature": 0, "num_predict": 12}
    r = server.http().post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    assert message["role"] == "assistant" and no_markers(
        message["content"], message.get("thinking")
    )
    show = server.http().post("/api/show", json={"model": MODEL}).json()
    assert "thinking" in show["capabilities"]


def test_ollama_shapes_of_a_harmony_answer(server: LiveServer) -> None:
    """What the Ollama format makes of a harmony answer's tokens, streamed token by token and
    whole: ``thinking``, ``content``, ``tool_calls`` with arguments as an object."""
    tokenizer = server.service.tokenizer
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    )
    ids = tokenizer.encode(text, add_special=False) + [tokenizer.eos_id]
    plan = tools.plan(tools.ToolFields.model_validate({"tools": [WEATHER]}), GPT_OSS.read_text())
    for think in (True, False):
        whole = _OllamaChat(MODEL, server.service, plan, think, 0.0, 0.0)
        done = Choice(0, token_ids=ids, finish_reason="stop")
        message = whole.whole(done)["message"]
        assert message.get("thinking") == ("Need weather." if think else None)
        assert message["content"] == ""
        assert message["tool_calls"] == [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ]
        parsed = ollama.ChatResponse(model=MODEL, message=message, done=True).message
        assert parsed.thinking == message.get("thinking")  # as Ollama's own client reads it
        fmt, choice, lines = (
            _OllamaChat(MODEL, server.service, plan, think, 0.0, 0.0),
            Choice(0),
            [],
        )
        for i in ids:
            choice.token_ids.append(i)
            lines.append(fmt.part(choice, "", None))
        lines.append(fmt.part(choice, "", "stop"))
        sent = [line["message"] for line in lines if line is not None]
        assert "".join(m.get("thinking", "") for m in sent) == message.get("thinking", "")
        assert [c for m in sent for c in m.get("tool_calls", [])] == message["tool_calls"]
        assert all(m["content"] == "" for m in sent)
