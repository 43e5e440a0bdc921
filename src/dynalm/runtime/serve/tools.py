"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` on the wire,
the tools shown to the model, and the model's calls read back out of its text.

Showing: a chat template that uses ``tools`` (Qwen 2.5, Hermes, Llama 3.1 ...) gets them as
transformers passes them, with earlier calls (``tool_calls``) and ``tool`` messages as the
template expects. Any other template gets the fallback: a system message that lists the
functions as JSON schemas and asks for each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; earlier calls are written
back in that form, and ``tool`` messages become user messages inside
``<tool_response>...</tool_response>`` (as Qwen's template writes them).

Reading: Hermes / Qwen ``<tool_call>`` blocks, or Llama 3's bare JSON ``{"name": ...,
"parameters": {...}}`` (after an optional ``<|python_tag|>``); a call of a function that was
not offered stays text. With ``tool_choice`` ``required`` or a named function the answer is
generated under a grammar of exactly that form, so it always parses; ``auto`` lets the model
choose and parses what it wrote; ``none`` shows no tools. A call the model repeats word for
word is a loop, not a second request: the answer ends at the repeat (`ToolPlan.looping`) and
each distinct call is kept once. Text is read by linear scans, never a backtracking regex.

gpt-oss's templates (`chat_template.harmony`) get a `HarmonyPlan` whether or not tools are
offered: its answers come on channels (`harmony`), read into reasoning, content and calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynalm.errors import InvalidRequest, show
from dynalm.models.chat_template import harmony
from dynalm.models.tokenizer import Tokenizer
from dynalm.runtime.serve.harmony import CHANNEL, CONSTRAIN, MESSAGE, HarmonyReader, Part
from dynalm.runtime.serve.structured import ANY_OBJECT, check_schema, json_schema_with_style

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)
MAX_TOOLS = 128

# ---------------------------------------------------------------- the wire


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(BaseModel):
    """The request fields about tools (mixed into the chat request model)."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ToolFields:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function needs a name of its own")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice asks for a tool call, but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names '{choice.function.name}', which is not in tools")
        return self


# ---------------------------------------------------------------- the plan of one request

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_CALL_MARKERS = (_HERMES_OPEN, _PYTHON_TAG)  # text from one on is a call, never content

FALLBACK_PROMPT = (
    "You may call functions to answer. To call one, answer with only this, one block per "
    "call:\n<tool_call>\n"
    '{"name": "<function name>", "arguments": {<the arguments as a JSON object>}}\n'
    "</tool_call>\nThe functions, as JSON schemas:\n"
)


def template_takes_tools(source: str) -> bool:
    return "tools" in source


def llama3_style(source: str) -> bool:
    """Llama 3.1's templates ask for a bare JSON call (``"parameters"``), not a tag."""
    return _HERMES_OPEN not in source and (_PYTHON_TAG in source or "ipython" in source)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Answer:
    """What an answer's text says: its content, its calls and (harmony) its reasoning."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None = None


@dataclass
class ToolPlan:
    """How one chat request shows its tools and reads calls back (`plan` makes it)."""

    # whether the answer is read with the tokenizer's control tokens in it (harmony's are
    # structure); else as the engine decoded it, without them
    reads_control_tokens = False

    tools: list[Tool]
    choice: str | NamedToolChoice
    parallel: bool
    in_template: bool  # the chat template renders the tools (else the fallback prompt)
    llama3: bool  # calls are Llama 3 JSON (else Hermes <tool_call> blocks)
    names: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = {t.function.name for t in self.tools}

    # -- showing
    def offered(self) -> list[Tool]:
        """The tools the model sees (only the named one for a named choice)."""
        if isinstance(self.choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.choice.function.name]
        return self.tools

    def fallback_system_text(self) -> str:
        return FALLBACK_PROMPT + "\n".join(
            json.dumps(t.model_dump(exclude_none=True)) for t in self.offered()
        )

    # -- constraining
    def grammar(self, tokenizer: Tokenizer | None = None) -> str | None:
        """For ``required`` and a named function: the llguidance grammar of the calls."""
        if self.choice in ("auto", "none"):
            return None
        args = "parameters" if self.llama3 else "arguments"
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    args: t.function.parameters or ANY_OBJECT,
                },
                "required": ["name", args],
                "additionalProperties": False,
            }
            for t in self.offered()
        ]
        schema = json.dumps(json_schema_with_style({"anyOf": calls}))
        if self.llama3:  # one bare JSON call
            lark = f"start: %json {schema}"
        else:
            repeat = ' ("\\n" call)*' if self.parallel else ""
            call = f'"{_HERMES_OPEN}\\n" %json {schema} "\\n{_HERMES_CLOSE}"'
            lark = f"start: call{repeat}\ncall: {call}\n"
        return _grammar(lark)

    # -- reading
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's text before any call (None if empty) and its calls, each distinct
        call once (a model that repeats a call is looping, not asking twice)."""
        found: list[tuple[str, Any]] = []
        start = text.find(_HERMES_OPEN)
        if start >= 0:
            for body, _ in _hermes_blocks(text, start):
                found.extend(_calls_in_json(body))
            found = list(dict.fromkeys(found))
            content = text[:start]
        else:
            stripped = text.lstrip()
            if stripped.startswith(_PYTHON_TAG):
                stripped = stripped[len(_PYTHON_TAG) :]
            found = _calls_in_json(stripped)
            content = "" if found else text
        calls = [
            ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=args))
            for name, args in found
            if name in self.names
        ]
        if not calls:
            return text or None, []
        if not self.parallel:
            calls = calls[:1]
        return content.strip() or None, calls

    def read(self, text: str) -> Answer:
        """The whole answer read: calls, and the content (all of ``text`` if no call)."""
        content, calls = self.parse(text)
        return Answer(content, calls) if calls else Answer(text, [])

    def stream(self) -> ToolStream | HarmonyStream:
        return ToolStream(self)

    def looping(self, text: str) -> bool:
        """Whether the last whole call block of ``text`` repeats an earlier one: the model is
        in a loop (SmolLM2 under ``required`` writes the same call until max_tokens), so the
        answer is complete. Cheap unless ``text`` just closed a block."""
        if self.llama3 or not text.rstrip().endswith(_HERMES_CLOSE):
            return False
        start = text.find(_HERMES_OPEN)
        bodies = [b for b, closed in _hermes_blocks(text, max(start, 0)) if closed]
        return len(bodies) > 1 and bodies[-1] in bodies[:-1]


def _grammar(lark: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:  # a parameters schema llguidance cannot take
        raise InvalidRequest(f"tools: {show(str(e).splitlines()[0])}") from None


def _hermes_blocks(text: str, at: int) -> list[tuple[str, bool]]:
    """The stripped bodies of the ``<tool_call>`` blocks of ``text`` from ``at`` on, each with
    whether it was closed (the last may run to the end). A linear scan: a regex with a lazy
    body and optional close backtracked quadratically on ``<tool_call>`` and 10k spaces."""
    blocks = []
    while (at := text.find(_HERMES_OPEN, at)) >= 0:
        body_at = at + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_at)
        closed = end >= 0
        end = end if closed else len(text)
        blocks.append((text[body_at:end].strip(), closed))
        at = end + len(_HERMES_CLOSE) if closed else end
    return blocks


def _calls_in_json(text: str) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of each call object in ``text``: objects one after
    the other, apart by whitespace or ``;``, each ``{"name", "arguments" | "parameters"}``.
    Anything else means no calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str):
            return []
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return []
        if not isinstance(args, dict):
            return []
        calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    return calls


class HarmonyPlan(ToolPlan):
    """gpt-oss's harmony: calls are commentary messages ``to=functions.NAME`` whose body is
    the arguments (JSON), reasoning is the analysis channel. A message to a recipient that is
    no offered function, or whose body is no JSON object, is not a call: it stays text, in
    the content as ``to=RECIPIENT BODY`` (control tokens never do)."""

    reads_control_tokens = True

    def grammar(self, tokenizer: Tokenizer | None = None) -> str | None:
        """For ``required`` and a named function: the answer is one call, at once (no
        analysis first), then the turn ends. Control tokens are the vocabulary's own tokens
        where it has them (llguidance's ``<|...|>``), else their text."""
        if self.choice in ("auto", "none"):
            return None

        def token(text: str) -> str:
            i = None if tokenizer is None else tokenizer.token_to_id(text)
            return text if i is not None and tokenizer.is_special(i) else json.dumps(text)

        def arguments(t: Tool) -> str:
            return json.dumps(json_schema_with_style(t.function.parameters or ANY_OBJECT))

        calls = [
            f'{token(CHANNEL)} "commentary to=functions.{t.function.name} " {token(CONSTRAIN)}'
            f' "json" {token(MESSAGE)} %json {arguments(t)}'
            for t in self.offered()
        ]
        return _grammar("start: " + "\n    | ".join(calls) + "\n")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        answer = self.read(text)
        return answer.content, answer.calls

    def read(self, text: str) -> Answer:
        stream = self.stream()
        first = stream.push(text)
        last, calls = stream.finish()

        def joined(key: str) -> str | None:
            return first.get(key, "") + last.get(key, "") or None

        return Answer(joined("content"), calls, joined("reasoning_content"))

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)

    def looping(self, text: str) -> bool:
        return False  # a call ends the turn (<|call|> is a stop token)

    def call(self, part: Part) -> ToolCall | None:
        """The call a message to a recipient makes, if it is one."""
        name = (part.recipient or "").removeprefix("functions.")
        if part.recipient != f"functions.{name}" or name not in self.names:
            return None
        try:
            args = json.loads(part.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(args, dict):
            return None
        arguments = json.dumps(args, ensure_ascii=False)
        return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def plan(fields: ToolFields, template_source: str) -> ToolPlan | None:
    """The request's tool plan; None when it offers no tools (or ``tool_choice`` none),
    except for a harmony template, whose answers are always read by a `HarmonyPlan`."""
    choice = fields.tool_choice or "auto"
    if harmony(template_source) and (not fields.tools or choice == "none"):
        return HarmonyPlan([], "auto", fields.parallel_tool_calls, True, False)
    if not fields.tools or choice == "none":
        return None
    for i, tool in enumerate(fields.tools):  # before any is shown or turned into a grammar
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    in_template = template_takes_tools(template_source)
    return (HarmonyPlan if harmony(template_source) else ToolPlan)(
        fields.tools,
        choice,
        fields.parallel_tool_calls,
        in_template,
        llama3=in_template and llama3_style(template_source),
    )


# ---------------------------------------------------------------- messages for the template


def _arguments(text: str) -> Any:
    """Templates expect a call's arguments as an object (transformers' convention)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _hermes_block(call: ToolCall) -> str:
    body = {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
    return f"{_HERMES_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{_HERMES_CLOSE}"


def template_messages(
    messages: list[dict[str, Any]], plan_: ToolPlan | None, template_source: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (``role``, ``content``, and ``tool_calls`` / ``tool_call_id`` / ``name``
    where given) as the template reads them, and the extra template variables."""
    native = template_takes_tools(template_source)
    out: list[dict[str, Any]] = []
    for m in messages:
        calls: list[ToolCall] = m.get("tool_calls") or []
        if native:
            message = {"role": m["role"], "content": m["content"]}
            if m.get("reasoning") is not None:  # an earlier answer's, under both names
                message["reasoning_content"] = message["thinking"] = m["reasoning"]
                if calls and harmony(template_source):  # gpt-oss's takes one or the other
                    message.pop("content")
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in calls
                ]
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    message[key] = m[key]
            out.append(message)
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            out.append({"role": "user", "content": text})
        else:
            text = "\n".join(filter(None, [m["content"], *map(_hermes_block, calls)]))
            out.append({"role": m["role"], "content": text})
    extra: dict[str, Any] = {}
    if plan_ is not None and native:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in plan_.offered()]
    elif plan_ is not None:
        prompt = plan_.fallback_system_text()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, extra


# ---------------------------------------------------------------- streaming


class ToolStream:
    """One streamed choice of a request with tools: text streams as content until a call
    begins; the call is held and sent whole, as ``tool_calls`` deltas, at the end."""

    def __init__(self, plan_: ToolPlan) -> None:
        self.plan = plan_
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calling = False

    def push(self, text: str) -> dict[str, str]:
        """Add generated text; return the delta that can be sent now."""
        content = self._content(text)
        return {"content": content} if content else {}

    def _content(self, text: str) -> str:
        self.text += text
        if self.calling:
            return ""
        rest = self.text[self.sent :]
        if self.plan.llama3 and self.sent == 0 and rest.lstrip()[:1] in ("", "{"):
            return ""  # a bare JSON call may be starting: hold it
        hits = [i for i in (rest.find(m) for m in _CALL_MARKERS) if i >= 0]
        if hits:
            self.calling = True
            upto = min(hits)
        else:  # hold a tail that may be the start of a marker
            upto = len(rest)
            for marker in _CALL_MARKERS:
                for n in range(min(len(marker) - 1, len(rest)), 0, -1):
                    if rest.endswith(marker[:n]):
                        upto = min(upto, len(rest) - n)
                        break
        self.sent += upto
        return rest[:upto]

    def finish(self) -> tuple[dict[str, str], list[ToolCall]]:
        """At the end: the delta of the content still unsent, and the calls (if any)."""
        calls = self.plan.parse(self.text)[1]
        if not calls and self.text[self.sent :]:
            return {"content": self.text[self.sent :]}, []
        return {}, calls  # the text before the first call went out already


class HarmonyStream:
    """One streamed choice of a harmony answer: reasoning and content stream as they come
    (as ``reasoning_content`` and ``content`` deltas), calls go out whole at the end."""

    def __init__(self, plan_: HarmonyPlan) -> None:
        self.plan = plan_
        self.reader = HarmonyReader()
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> dict[str, str]:
        return self._delta(self.reader.push(text))

    def finish(self) -> tuple[dict[str, str], list[ToolCall]]:
        delta = self._delta(self.reader.finish())
        return delta, self.calls if self.plan.parallel else self.calls[:1]

    def _delta(self, parts: list[Part]) -> dict[str, str]:
        # reasoning_content: the field vLLM's and llama.cpp's servers answer reasoning in
        delta: dict[str, str] = {}
        for part in parts:
            if part.kind == "message":
                if (call := self.plan.call(part)) is not None:
                    self.calls.append(call)
                    continue
                part = Part("content", f"to={part.recipient} {part.text}")
            key = "reasoning_content" if part.kind == "reasoning" else "content"
            delta[key] = delta.get(key, "") + part.text
        return delta


def call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed ``tool_calls`` entries: each call whole, with its index."""
    return [{"index": i, **c.model_dump()} for i, c in enumerate(calls)]
