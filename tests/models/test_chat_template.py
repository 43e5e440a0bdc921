"""Chat templates render as transformers' ``apply_chat_template`` does: SmolLM2's own template, and
each fallback against the canonical Hugging Face template it stands in for."""

from __future__ import annotations

import re
import resource
import sys
import time
from datetime import datetime
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from dynalm.errors import InvalidRequest
from dynalm.models import chat_template
from dynalm.models.chat_template import ChatTemplate
from dynalm.models.tokenizer import Tokenizer

# The canonical templates of the model cards the fallbacks mimic.
HF_CHATML = (  # transformers' chat templating docs
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HF_LLAMA3 = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
HF_GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  \n"},
    ],
    [{"role": "user", "content": "héllo 😀 <b>bold</b>\n\nnew paragraph"}],
    [
        {"role": "system", "content": "Be kind.\nAlways."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


def _metadata_strings(path: Path, keys: tuple[str, ...]) -> dict:
    fields = gguf.GGUFReader(path).fields
    return {k: fields[k].contents() for k in keys}


def hf_render(template: str, messages: list[dict], bos: str, eos: str) -> str:
    """transformers' apply_chat_template(tokenize=False, add_generation_prompt=True)."""
    backend = HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    return hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def family_tokenizer(arch: str, specials: list[str], bos: int, eos: int) -> tuple[dict, Tokenizer]:
    """A byte-level tokenizer whose control tokens are ``specials`` (ids 0..)."""
    letters = [chr(c) for c in range(33, 127)]
    metadata = {
        "general.architecture": arch,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [*specials, *letters],
        "tokenizer.ggml.token_type": np.array([3] * len(specials) + [1] * len(letters)),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos,
    }
    return metadata, Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="session")
def smol_template(smollm2_gguf: Path) -> tuple[ChatTemplate, str, str, str]:
    keys = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    meta = _metadata_strings(smollm2_gguf, keys)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bos, eos = tokens[meta[keys[1]]], tokens[meta[keys[2]]]
    metadata, tok = family_tokenizer("llama", tokens, meta[keys[1]], meta[keys[2]])
    template = ChatTemplate.from_gguf_metadata(
        {**metadata, "tokenizer.chat_template": meta[keys[0]]}, tok
    )
    return template, meta[keys[0]], bos, eos


def test_smollm2_template_matches_transformers(smol_template) -> None:
    template, source, bos, eos = smol_template
    assert template.source == source and "<|im_start|>" in source
    assert template.stop_token_ids == {2}  # <|im_end|>
    for messages in CONVERSATIONS:
        assert template.render(messages) == hf_render(source, messages, bos, eos)
    no_prompt = template.render(CONVERSATIONS[0], add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


@pytest.mark.parametrize(
    ("arch", "specials", "canonical", "stop"),
    [
        ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], HF_CHATML, "<|im_end|>"),
        ("llama", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], HF_CHATML, "<|im_end|>"),
        (
            "llama",
            [
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
            HF_LLAMA3,
            "<|eot_id|>",
        ),
        (
            "gemma3",
            ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
            HF_GEMMA3,
            None,
        ),
    ],
)
def test_fallbacks_match_canonical_templates(
    arch: str, specials: list[str], canonical: str, stop: str | None
) -> None:
    bos, eos = (2, 1) if arch.startswith("gemma") else (0, 1)
    metadata, tok = family_tokenizer(arch, specials, bos, eos)
    template = ChatTemplate.from_gguf_metadata(metadata, tok)
    for messages in CONVERSATIONS:
        assert template.render(messages) == hf_render(
            canonical, messages, specials[bos], specials[eos]
        )
    expected_stop = stop or "<end_of_turn>"
    assert tok.token_to_id(expected_stop) in template.stop_token_ids


def test_raise_exception_is_invalid_request() -> None:
    template = ChatTemplate("{{ raise_exception('no ' + messages[0]['role'] + ' here') }}")
    with pytest.raises(InvalidRequest, match="^no user here$"):
        template.render([{"role": "user", "content": "x"}])
    _, tok = family_tokenizer("gemma3", ["<pad>", "<eos>", "<bos>"], 2, 1)
    gemma = ChatTemplate.from_gguf_metadata({"general.architecture": "gemma3"}, tok)
    with pytest.raises(InvalidRequest, match="alternate"):
        gemma.render([{"role": "assistant", "content": "first"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set _ = messages.append(1) %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_escapes(source: str) -> None:
    with pytest.raises(InvalidRequest, match="chat template"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_template_errors_name_the_problem() -> None:
    with pytest.raises(InvalidRequest, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(InvalidRequest, match="chat template failed"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_globals_and_filters() -> None:
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}"
        "|{{ tools is none }}|{{ extra_var }}{% for m in messages %}{% break %}{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    out = template.render([{"role": "user", "content": "é<&>"}], extra_var=7)
    year = datetime.now().strftime("%Y")
    assert out == f'<s>|</s>|{{"role": "user", "content": "é<&>"}}|{year}|True|7'


BIG = "{% set b = 'x' * 500000 %}"


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}",
            "took more than 0.3 s",
        ),
        (
            "{% for c in messages[0]['content'] * 500 %}{% for d in range(99999) %}{% endfor %}"
            "{% endfor %}",
            "took more than",
        ),
        ("{{ 'x' * 4000000000 }}", "a repetition of 4000000000 characters"),
        ("{{ [0] * 4000000000 }}", "a repetition"),
        ("{{ 2 ** 4000000000 }}", "a power"),
        ("{{ 'x' | center(4000000000) }}", "the center filter"),
        ("{{ 'x'.ljust(4000000000) }}", "ljust()"),
        ("{{ '{:>4000000000}'.format(1) }}", "format()"),
        ("{{ '%4000000000d' % 1 }}", "a % format"),
        (BIG + "{{ b.replace('', b) }}", "replace()"),
        (BIG + "{{ ([b] * 1000) | join }}", "a repetition"),
        ("{{ ('\n' * 100000) | indent(1000) }}", "the indent filter"),
        (BIG + "{% for i in range(100000) %}{{ b }}{% endfor %}", "an output"),
        (
            "{% set ns = namespace(x='x') %}{% for i in range(64) %}"
            "{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
            "a ~ concatenation",
        ),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    ],
)
def test_render_is_bounded_in_time_and_size(source: str, needle: str, monkeypatch) -> None:
    """Hostile templates (the model file's code) fail fast, without a memory blow-up."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    tracer, t0 = sys.gettrace(), time.monotonic()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    template = ChatTemplate(source, name="the test template")
    with pytest.raises(InvalidRequest, match="^the test template ") as error:
        template.render([{"role": "user", "content": "hi"}])
    assert needle in str(error.value) and len(str(error.value)) < 400
    assert time.monotonic() - t0 < 3
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB
    assert sys.gettrace() is tracer


def test_budget_grows_with_the_messages() -> None:
    """A long conversation is not taken for a hostile template: the size budget is 1 MB
    beyond four times the messages' text."""
    content = "word " * 1_000_000
    out = ChatTemplate(HF_CHATML).render([{"role": "user", "content": content}] * 2)
    assert len(out) > 2 * len(content)
    with pytest.raises(InvalidRequest, match="too long|at most"):
        ChatTemplate("x" * (chat_template.MAX_SOURCE_CHARS + 1))


# ---------------------------------------------------------------- gpt-oss (harmony)

GPT_OSS = Path(__file__).parent / "data" / "openai-gpt-oss-120b.jinja"
HARMONY_SPECIALS = [
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
    "<|start|>", "<|end|>", "<|message|>", "<|call|>",
]  # fmt: skip
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "a city"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
CALL = {"id": "c1", "type": "function"}
CALL["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
ASKED = {"role": "user", "content": "Weather in Paris?"}
HARMONY_CASES = {  # (messages, the template's other variables)
    "plain": ([{"role": "user", "content": "Hi!"}], {}),
    "system and turns": ([*CONVERSATIONS[3]], {}),
    "developer": ([{"role": "developer", "content": "Be terse."}, ASKED], {}),
    "tools offered": ([ASKED], {"tools": [WEATHER_TOOL]}),
    "call and result, then the answer": (
        [
            ASKED,
            {"role": "assistant", "content": "", "thinking": "Use it.", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"},
        ],
        {"tools": [WEATHER_TOOL]},
    ),
    "call and result, reasoning kept": (
        [
            ASKED,
            {"role": "assistant", "content": "", "thinking": "Use it.", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"sky": "sunny"}'},
        ],
        {"tools": [WEATHER_TOOL]},
    ),
    "reasoning effort": ([ASKED], {"reasoning_effort": "high"}),
}


def _undated(text: str) -> str:  # the template writes today's date (strftime_now)
    return re.sub(r"Current date: \d{4}-\d\d-\d\d", "Current date: D", text)


@pytest.mark.parametrize("case", HARMONY_CASES)
def test_gpt_oss_template_renders_as_transformers(case: str) -> None:
    """gpt-oss's own template (harmony) in DynaLM's bounded sandbox gives what transformers'
    apply_chat_template (jinja2's own sandbox) gives, for each kind of conversation."""
    metadata, tok = family_tokenizer("gpt-oss", HARMONY_SPECIALS, 0, 2)
    source = GPT_OSS.read_text()
    template = ChatTemplate.from_gguf_metadata({**metadata, "tokenizer.chat_template": source}, tok)
    messages, extra = HARMONY_CASES[case]
    ours = template.render(messages, **extra)
    backend = HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>"
    )
    oracle = hf.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True, **extra
    )
    assert _undated(ours) == _undated(oracle)
    assert ours.endswith("<|start|>assistant")
    if "tools" in extra:
        assert "type get_weather = (_: {" in ours
    if case == "call and result, reasoning kept":  # no final answer after the call yet
        assert "<|channel|>analysis<|message|>Use it.<|end|>" in ours
        call = "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        assert call + '<|message|>{"city": "Paris"}<|call|>' in ours
    if case == "call and result, then the answer":
        assert "Use it." not in ours  # earlier turns' reasoning is dropped
    assert ("Reasoning: high" in ours) == (case == "reasoning effort")
    # a turn ends at <|return|> (the answer) or <|call|> (a tool call); <|end|> only ends a
    # message inside the turn (the analysis before the final answer)
    stops = {tok.token_to_id(t) for t in ("<|return|>", "<|call|>")}
    assert stops <= template.stop_token_ids
    assert stops <= tok.eog_ids and tok.token_to_id("<|end|>") not in tok.eog_ids
    assert tok.token_to_id("<|end|>") not in template.stop_token_ids
