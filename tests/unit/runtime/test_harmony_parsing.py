"""gpt-oss's harmony answers read without a model: reasoning, content and calls out of whole
and streamed text (cut anywhere), malformed text (cut off, unknown recipients, bad arguments),
the grammar of ``required``, and earlier reasoning going back to the template."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import numpy as np
import pytest

from dynalm.models.tokenizer import Tokenizer, _byte_of_char
from dynalm.runtime.engine.guided import GrammarCompiler
from dynalm.runtime.serve.generation import ChatFormat, Choice
from dynalm.runtime.serve.harmony import CHANNEL, MARKERS, HarmonyReader
from dynalm.runtime.serve.protocol import ChatMessage
from dynalm.runtime.serve.tools import (
    HarmonyPlan,
    ToolFields,
    ToolPlan,
    plan,
    template_messages,
)

GPT_OSS = (Path(__file__).parents[2] / "models/data/openai-gpt-oss-120b.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
THINK = "<|channel|>analysis<|message|>User wants weather. <b>Use</b> the tool.<|end|>"
CALL_IN_CHANNEL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
CALL_IN_HEADER = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city":"Paris"}<|call|>'
)
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny <|in Paris|>.<|return|>"


def harmony_plan(tools: list | None = None, choice: str = "auto") -> HarmonyPlan:
    made = plan(ToolFields.model_validate({"tools": tools, "tool_choice": choice}), GPT_OSS)
    assert isinstance(made, HarmonyPlan)
    return made


def streamed(p: ToolPlan, text: str, rng: random.Random) -> tuple[str, str, list]:
    """(reasoning, content, calls) of ``text`` pushed in random pieces."""
    stream, got = p.stream(), {"reasoning_content": "", "content": ""}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [stream.push(piece) for piece in pieces]
    last, calls = stream.finish()
    for delta in [*deltas, last]:
        for key, value in delta.items():
            assert not any(m in value for m in MARKERS), value  # nothing structural leaks
            got[key] += value
    return got["reasoning_content"], got["content"], calls


THOUGHT = "User wants weather. <b>Use</b> the tool."
SAID = "It is sunny <|in Paris|>."
OPEN_CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
CASES = [  # (text, reasoning, content, the call's city)
    (THINK + ANSWER, THOUGHT, SAID, None),
    (THINK + CALL_IN_CHANNEL, THOUGHT, None, "Paris"),
    (CALL_IN_HEADER[len("<|start|>assistant") :], None, None, "Paris"),
    # the decoder dropped <|end|>: the next <|start|> ends the message all the same
    (THINK.replace("<|end|>", "") + ANSWER, THOUGHT, SAID, None),
    # a preamble (commentary without recipient) is for the user
    (
        "<|channel|>commentary<|message|>Checking.<|end|>" + CALL_IN_CHANNEL,
        None,
        "Checking.",
        "Paris",
    ),
    # cut off by max_tokens: what came is kept, in its channel
    ("<|channel|>analysis<|message|>Thinking ab", "Thinking ab", None, None),
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is", THOUGHT, "It is", None),
    (OPEN_CALL, None, None, "Paris"),
    # a header cut off before <|message|> is structure, not text: dropped
    (THINK + "<|start|>assistant<|channel|>fin", THOUGHT, None, None),
    # a model that wrote no harmony at all: its text is the content
    ("Just an answer <b>.", None, "Just an answer <b>.", None),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "call"), CASES)
def test_answers_whole_and_streamed_in_any_pieces(
    text: str, reasoning: str | None, content: str | None, call: str | None
) -> None:
    p = harmony_plan([WEATHER])
    answer = p.read(text)
    assert (answer.reasoning, answer.content) == (reasoning, content)
    assert [json.loads(c.function.arguments) for c in answer.calls] == (
        [{"city": call}] if call else []
    )
    assert all(c.function.name == "get_weather" and c.id.startswith("call_") for c in answer.calls)
    rng = random.Random(text)
    for _ in range(40):
        r, c, calls = streamed(p, text, rng)
        assert (r or None, c or None) == (reasoning, content)
        assert [x.function.arguments for x in calls] == [x.function.arguments for x in answer.calls]


NO_CALLS = {
    "not offered": "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
    "no function": '<|channel|>commentary to=browser.search json<|message|>{"q": 1}',
    "bad JSON": '<|channel|>commentary to=functions.get_weather json<|message|>{"city": Par',
    "no object": '<|channel|>commentary to=functions.get_weather json<|message|>["Paris"]',
}


@pytest.mark.parametrize("why", NO_CALLS)
def test_messages_that_are_no_call_stay_text(why: str) -> None:
    """Nothing is lost: the recipient and the body go to the content, as harmony wrote them
    without the control tokens."""
    p, message = harmony_plan([WEATHER]), NO_CALLS[why]
    answer = p.read(THINK + "<|start|>assistant" + message + "<|call|>")
    recipient = message.split("to=")[1].split(" ")[0]
    body = message.split("<|message|>")[1]
    assert answer.calls == [], why
    assert answer.content == f"to={recipient} {body}"
    assert answer.reasoning == THOUGHT


def test_reader_holds_only_what_may_be_a_control_token() -> None:
    reader = HarmonyReader()
    assert reader.push("<|channel|>final<|mess") == []
    [part] = reader.push("age|>Hi <")
    assert (part.kind, part.text) == ("content", "Hi ")  # "<" may begin <|end|>
    [part] = reader.push("3 you<|")
    assert part.text == "<3 you"
    assert reader.push("return|>") == [] and reader.finish() == []


def test_plan_is_chosen_by_the_template() -> None:
    assert isinstance(harmony_plan(), HarmonyPlan)  # no tools: still read as harmony
    assert harmony_plan([WEATHER], "none").offered() == []
    assert harmony_plan([WEATHER]).reads_control_tokens
    chatml = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    assert plan(ToolFields.model_validate({}), chatml) is None


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)  # noqa: E501
def test_required_grammar_is_one_call(choice: object) -> None:
    p = harmony_plan([WEATHER, {"type": "function", "function": {"name": "get_time"}}], choice)
    grammar = p.grammar()
    assert grammar is not None
    good = CALL_IN_CHANNEL[len("<|start|>assistant") : -len("<|call|>")]
    tokenizer = llguidance.LLTokenizer("byte")  # one token per byte: markers are text here
    for text, ok in ((good, True), (good.replace('"Paris"', "7"), False), (THINK + good, False)):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        consumed = matcher.try_consume_tokens(tokenizer.tokenize_str(text))
        assert (consumed == len(text.encode()) and matcher.is_accepting()) == ok, text
    assert p.read(good).calls[0].function.name == "get_weather"


def test_earlier_reasoning_goes_back_as_the_template_wants() -> None:
    p = harmony_plan([WEATHER])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    said = ChatMessage.model_validate(
        {"role": "assistant", "content": "x", "tool_calls": [call], "reasoning_content": "Hm."}
    )
    shown, extra = template_messages(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": said.text(),
                "tool_calls": said.tool_calls,
                "reasoning": said.reasoning_content,
            },
        ],
        p,
        GPT_OSS,
    )
    assert shown[1]["thinking"] == shown[1]["reasoning_content"] == "Hm."
    assert "content" not in shown[1]  # gpt-oss's template takes thinking or content with calls
    assert shown[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather"]


def control_token_vocabulary() -> Tokenizer:
    """A byte-level vocabulary whose harmony markers are control tokens, as gpt-oss's."""
    specials = list(dict.fromkeys(["<|endoftext|>", "<|return|>", "<|call|>", *MARKERS]))
    alphabet = sorted(set(_byte_of_char()))  # every byte, one token each
    metadata = {
        "general.architecture": "gpt-oss",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [*specials, *alphabet],
        "tokenizer.ggml.token_type": np.array([3] * len(specials) + [1] * len(alphabet)),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 1,
    }
    return Tokenizer.from_gguf_metadata(metadata)


def test_answer_is_read_from_token_ids_with_control_tokens() -> None:
    """The engine's text drops control tokens; the chat format reads the ids with harmony's
    kept (and others, such as <|endoftext|>, dropped), whole and token by token."""
    tok = control_token_vocabulary()
    ids = tok.encode(THINK + ANSWER + "<|endoftext|>", add_special=False)
    fmt = ChatFormat("m", tok, False, harmony_plan())
    message, reason = fmt._message(Choice(0, token_ids=ids, finish_reason="stop"))
    assert (message.reasoning_content, message.content, reason) == (THOUGHT, SAID, "stop")
    fmt, choice, got = ChatFormat("m", tok, False, harmony_plan()), Choice(0), {}
    for i in [*ids, None]:
        if i is not None:
            choice.token_ids.append(i)
        chunk = fmt.chunk(choice, "", None, None if i is not None else "stop")
        for key, value in (chunk.choices[0].delta if chunk else {}).items():
            got[key] = got.get(key, "") + value
    assert got == {"reasoning_content": THOUGHT, "content": SAID}


def test_required_grammar_takes_the_vocabularys_control_tokens() -> None:
    """In gpt-oss's vocabulary the harmony markers are control tokens: the grammar of a
    required call asks for those ids, not for the markers spelt out in text."""
    tok = control_token_vocabulary()
    grammar = harmony_plan([WEATHER], "required").grammar(tok)
    assert grammar is not None
    compiler = GrammarCompiler(tok, frozenset({1, 2}), tok.vocab_size)
    call = CALL_IN_CHANNEL[len("<|start|>assistant") : -len("<|call|>")]
    as_tokens = tok.encode(call, add_special=False)
    char_of = {b: c for c, b in _byte_of_char().items()}
    spelt = [tok.token_to_id(char_of[b]) for b in call.encode()]  # markers as plain bytes
    assert tok.token_to_id(CHANNEL) in as_tokens and tok.token_to_id(CHANNEL) not in spelt
    for ids, ok in ((as_tokens, True), (spelt, False)):
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        consumed = matcher.try_consume_tokens(ids)
        assert (consumed == len(ids) and matcher.is_accepting()) == ok


def test_dynalm_run_shows_reasoning_apart_from_the_answer(capsys: pytest.CaptureFixture) -> None:
    """``dynalm run`` on a harmony model: the answer's final channel on stdout (returned as
    the answer), the reasoning on stderr, no marker in either; the engine's events carry
    the ids (its text has no control tokens), the stop token as ``token=None``."""
    from types import SimpleNamespace

    from dynalm.cli import _stream
    from dynalm.runtime.generator import GenerationEvent

    tok = control_token_vocabulary()
    ids = tok.encode(THINK + ANSWER, add_special=False)
    events = [GenerationEvent(tok.decode([i]), i) for i in ids[:-1]]
    events.append(GenerationEvent("", None, "stop"))  # <|return|>, a stop token
    engine_like = SimpleNamespace(
        model=SimpleNamespace(tokenizer=tok), generate=lambda *a, **k: iter(events)
    )
    answer = _stream(engine_like, [], None, channels=True)
    out, err = capsys.readouterr()
    assert answer == out == SAID
    assert THOUGHT in err.replace("\n", "")  # (rich markup escaped: shown as written)
    assert not any(m in out + err for m in MARKERS)
