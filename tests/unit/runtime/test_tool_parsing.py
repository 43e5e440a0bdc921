"""Tool calls without a model: calls read out of Hermes / Qwen and Llama 3 text, streamed
text held back once a call begins, and tools, earlier calls and tool results rendered
through a template that takes tools and through the fallback prompt."""

from __future__ import annotations

import json

import llguidance
import pytest

from dynalm.models.chat_template import ChatTemplate
from dynalm.runtime.serve.tools import (
    FALLBACK_PROMPT,
    FunctionCall,
    Tool,
    ToolCall,
    ToolFields,
    ToolPlan,
    plan,
    template_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# Qwen 2.5's template, cut to what it does with tools
QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call in <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
LLAMA3_LIKE = "{{ tools }}<|python_tag|>{% for m in messages %}{{ m.content }}{% endfor %}"


def make_plan(template: str, choice: object = "auto", parallel: bool = True) -> ToolPlan:
    fields = ToolFields.model_validate(
        {"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel}
    )
    made = plan(fields, template)
    assert made is not None
    return made


def test_hermes_calls_are_parsed_with_text_before_them() -> None:
    p = make_plan(QWEN_LIKE)
    assert not p.llama3 and p.in_template
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>'
    )
    content, calls = p.parse(text)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert len(make_plan(QWEN_LIKE, parallel=False).parse(text)[1]) == 1


def test_llama3_json_calls_and_what_is_not_a_call() -> None:
    p = make_plan(LLAMA3_LIKE)
    assert p.llama3
    content, calls = p.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    for text in (
        '{"name": "not_offered", "parameters": {}}',  # a function nobody offered
        '{"name": "get_weather", "parameters": {"city": ',  # cut short
        "Just an answer.",
        '{"city": "Paris"}',  # JSON that is no call
    ):
        assert p.parse(text) == (text, [])


@pytest.mark.parametrize("template", [QWEN_LIKE, LLAMA3_LIKE])
def test_required_grammar_accepts_exactly_the_calls(template: str) -> None:
    p = make_plan(template, choice="required", parallel=False)
    grammar = p.grammar()
    assert grammar is not None
    key = "parameters" if p.llama3 else "arguments"
    good = json.dumps({"name": "get_weather", key: {"city": "Rome"}})
    if not p.llama3:
        good = f"<tool_call>\n{good}\n</tool_call>"
    bad = good.replace("get_weather", "get_wether")
    tokenizer = llguidance.LLTokenizer("byte")  # one token per byte
    for text, ok in ((good, True), (bad, False)):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        consumed = matcher.try_consume_tokens(tokenizer.tokenize_str(text))
        assert (consumed == len(text.encode()) and matcher.is_accepting()) == ok, text
        assert p.parse(text)[1] or not ok


def test_named_choice_offers_only_that_function() -> None:
    p = make_plan(PLAIN_CHATML, choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.function.name for t in p.offered()] == ["get_time"]
    assert "get_weather" not in p.fallback_system_text()


def test_tool_choice_refusals() -> None:
    with pytest.raises(ValueError, match="not in tools"):
        ToolFields.model_validate(
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}
        )
    with pytest.raises(ValueError, match="no tools are given"):
        ToolFields.model_validate({"tool_choice": "required"})
    with pytest.raises(ValueError, match="a name of its own"):
        ToolFields.model_validate({"tools": [WEATHER, WEATHER]})
    assert plan(ToolFields.model_validate({"tools": [WEATHER], "tool_choice": "none"}), "") is None


def test_stream_holds_back_a_call_and_sends_it_whole() -> None:
    p = make_plan(PLAIN_CHATML)
    stream = p.stream()
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    deltas = [stream.push(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "  # not even "<tool_c"
    rest, calls = stream.finish()
    assert rest == {} and [c.function.name for c in calls] == ["get_time"]
    plain = p.stream()
    words = "Paris is sunny today <b>ok</b>."
    deltas = [plain.push(words[i : i + 4]) for i in range(0, len(words), 4)]
    sent = "".join(d.get("content", "") for d in [*deltas, plain.finish()[0]])
    assert sent == words and plain.finish()[1] == []


def conversation() -> list[dict]:
    call = ToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
    )
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1", "name": None},
    ]


def test_template_that_takes_tools_renders_them() -> None:
    p = make_plan(QWEN_LIKE)
    messages, extra = template_messages(conversation(), p, QWEN_LIKE)
    text = ChatTemplate(QWEN_LIKE).render(messages, **extra)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert FALLBACK_PROMPT not in text


def test_fallback_prompt_for_a_template_without_tools() -> None:
    p = make_plan(PLAIN_CHATML)
    assert not p.in_template
    messages, extra = template_messages(conversation(), p, PLAIN_CHATML)
    assert extra == {}
    text = ChatTemplate(PLAIN_CHATML).render(messages)
    assert text.startswith("<|im_start|>system\n" + FALLBACK_PROMPT)
    assert json.dumps(Tool.model_validate(WEATHER).model_dump(exclude_none=True)) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>" in text
