"""Chat templates: a conversation (list of ``{"role", "content"}`` dicts) to one prompt string.

The template comes from ``tokenizer.chat_template`` in the GGUF (a Hugging Face Jinja template) or,
when the file has none, from a fallback chosen by model family (ChatML, Llama 3, Gemma). It renders
in Jinja's immutable sandbox with the globals HF templates expect, the way transformers'
``apply_chat_template`` does, so the same messages give the same text.

A template is code from the model file, and the sandbox bounds what it may touch, not what it may
cost: three nested ``range(100000)`` loops never end and ``'x' * 4000000000`` takes 16 GB. So a
render is bounded too: a deadline (``RENDER_SECONDS``) checked by a trace function on each call
and each line of template code (so in every loop), and a size budget (`_Budget`) checked *before*
each operation that can make a large value in one step (``*``, ``**``, ``+``, ``%``, ``~``,
``replace``, ``join``, ``format``, numbers given to calls and filters such as ``center``), on
each result, and on the output. Tracing makes SmolLM2's template over 20 messages cost 0.6 ms
instead of 0.05 ms; a prefill costs far more.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynalm.errors import InvalidRequest, show
from dynalm.files import read_source
from dynalm.models.metadata import text
from dynalm.models.tokenizer import Tokenizer

MAX_SOURCE_CHARS = 256 * 1024  # templates in the wild are under 20 KB
MAX_TEMPLATE_BYTES = 4 * MAX_SOURCE_CHARS  # a template file, read before its characters count
RENDER_SECONDS = 2.0  # renders take about a millisecond
MAX_RENDER_CHARS = 1 << 20  # beyond the messages' own text (which a template may repeat 4x)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Gemma has no system role: a system message is put before the first user message.
GEMMA = (
    "{{ bos_token }}"
    "{% set prefix = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in (messages[1:] if prefix else messages) %}"
    "{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) }}"
    "{{ '\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Tokens that close a turn in the templates we know; those a template names are its stop tokens
# (in harmony, <|end|> closes a message but not the turn: `harmony`).
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "<|return|>",
    "<|call|>",
)


def harmony(source: str) -> bool:
    """Whether a template writes gpt-oss's "harmony" format: each assistant message on a
    channel (``<|channel|>analysis`` for reasoning, ``final`` for the answer, ``commentary``
    for tool calls), a turn ending at ``<|return|>`` or ``<|call|>`` (as llama.cpp detects it)."""
    return "<|channel|>" in source


def _raise_exception(message: str) -> None:
    raise InvalidRequest(message)


class _OverBudget(Exception):
    """A render went over its time or size budget."""


class _Budget(threading.local):
    """The running render's limits (one render at a time per thread)."""

    max_chars = MAX_RENDER_CHARS

    def check(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _OverBudget(f"{what} of {size} characters (at most {self.max_chars})")


_budget = _Budget()


def _deadline_tracer(seconds: float) -> Callable[..., Any]:
    """A ``sys.settrace`` function: called on each call the render makes and on every line
    of the template's own code (its loops); past ``seconds`` it stops the render."""
    deadline, events = time.monotonic() + seconds, 0

    def trace(frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        nonlocal events
        events += 1
        if not events & 255 and time.monotonic() > deadline:
            raise _OverBudget(f"took more than {seconds:g} s")
        return trace if frame.f_code.co_filename == "<template>" else None

    return trace


def _size(value: Any) -> int:
    """About how many characters ``value`` takes as text, containers summed (ints: their
    decimal digits); the count stops early once over the budget."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        total = 2
        for item in value:
            total += _size(item) + 2
            if total > _budget.max_chars:
                break
        return total
    return 1


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on ``fmt % args`` or ``fmt.format(...)``: each field (``%`` or ``{``) at
    most as long as the longest argument or the largest width/precision written in ``fmt``."""
    widest = max([_size(a) for a in (*args, *kwargs.values())] + [0])
    widths = [int(d) for d in re.findall(r"\d{1,12}", fmt)] or [0]
    return len(fmt) + (fmt.count("%") + fmt.count("{")) * max(widest, max(widths))


def _result_size(name: str, subject: Any, args: tuple, kwargs: dict) -> int:
    """An upper bound on the size of ``subject.name(*args, **kwargs)`` (a string method, or
    the filter ``name`` of ``subject``) for the calls that can multiply sizes."""
    n = _size(subject)
    numbers = [abs(a) for a in (*args, *kwargs.values()) if type(a) is int]
    if name == "replace" and len(args) >= 2:
        return n + (n + 1) * _size(args[1]) // max(1, _size(args[0]))
    if name == "join" and isinstance(subject, str):  # str.join(items)
        items = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        return _size(items) + n * len(items)
    if name == "join":  # the filter: items|join(separator)
        sep = args[0] if args else kwargs.get("d", "")
        return n + _size(sep) * n
    if name in ("format", "format_map") and isinstance(subject, str):
        return _format_size(subject, args, kwargs)
    if name in ("expandtabs", "indent", "tojson"):  # a number of characters per line or tab
        width = args[0] if args and isinstance(args[0], str) else ""
        return n * (1 + max([8, len(width), *numbers]))
    return n + sum(numbers)  # center, ljust, zfill, wordwrap, truncate, ...


def _checked(value: Any, what: str) -> Any:
    _budget.check(_size(value), what)
    return value


def _guarded(filter_: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A filter whose arguments and result are checked against the budget (its
    ``pass_context``-style marker is kept by ``wraps``)."""
    takes_context = hasattr(filter_, "jinja_pass_arg")

    @functools.wraps(filter_)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        subject, *rest = args[1:] if takes_context else args
        _budget.check(_result_size(name, subject, tuple(rest), kwargs), f"the {name} filter")
        return _checked(filter_(*args, **kwargs), f"the {name} filter's result")

    return guarded


class _BoundedCode(CodeGenerator):
    """Compiles ``a ~ b`` to a checked join (Jinja's own is a plain one)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every operation that can grow a value checked first."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCode

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        a, b = _size(left), _size(right)
        if operator == "*" and isinstance(right, int) and not isinstance(left, int):
            _budget.check(a * abs(right), "a repetition")
        elif operator == "*" and isinstance(left, int) and not isinstance(right, int):
            _budget.check(b * abs(left), "a repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            _budget.check(max(a, 1) * abs(right), "a power")
        elif operator == "+":
            _budget.check(a + b, "a sum")
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            _budget.check(_format_size(left, args, {}), "a % format")
        return _checked(super().call_binop(context, operator, left, right), "a result")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        name = getattr(__obj, "__name__", "")
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        subject = getattr(method, "__self__", None)
        what = f"{name or 'a call'}()"
        _budget.check(_result_size(name, subject, args, kwargs), what)
        return _checked(super().call(__context, __obj, *args, **kwargs), f"the result of {what}")

    def concat(self, parts: tuple) -> str:
        texts = [str(p) for p in parts]
        _budget.check(sum(map(len, texts)), "a ~ concatenation")
        return "".join(texts)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: plain json.dumps, without Jinja's HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.filters = {name: _guarded(f, name) for name, f in _ENV.filters.items()}
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
del _ENV.globals["lipsum"]  # lipsum(n=10**6) alone would run for minutes


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with.

    The rendered prompt already holds the special tokens the model expects (BOS included when the
    template writes ``bos_token``), so it is tokenized with ``tokenizer.encode(text,
    add_special=False)`` -- the same ids as transformers' ``apply_chat_template(tokenize=True)``.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        stop_token_ids: frozenset[int] = frozenset(),
        name: str = "the chat template",
    ) -> None:
        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_token_ids = stop_token_ids
        if len(source) > MAX_SOURCE_CHARS:
            raise InvalidRequest(f"{name} is {len(source)} characters (at most {MAX_SOURCE_CHARS})")
        try:
            self._template = _ENV.from_string(source)
        except Exception as e:  # a syntax error, or a source nested too deep to compile
            raise InvalidRequest(f"{name} does not parse: {show(str(e))}") from e

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, tokenizer: Tokenizer) -> ChatTemplate:
        """The file's ``tokenizer.chat_template``, else a fallback by family (`for_family`)."""
        source = text(metadata, "tokenizer.chat_template", None)
        arch = str(metadata.get("general.architecture", ""))
        return cls.for_family(source, "tokenizer.chat_template", arch, tokenizer)

    @classmethod
    def from_hf_directory(
        cls, directory: Path, config: dict, arch: str, tokenizer: Tokenizer
    ) -> ChatTemplate:
        """A Hugging Face model directory's template: ``chat_template.jinja`` (what recent
        transformers write), else tokenizer_config.json's ``chat_template`` (a string, or a
        list of named templates: the one named "default"), else a fallback by family."""
        where, source = "chat_template.jinja", None
        try:
            source = read_source(directory / where, MAX_TEMPLATE_BYTES, InvalidRequest)
        except FileNotFoundError:
            where, source = "tokenizer_config.json chat_template", config.get("chat_template")
        except OSError as e:
            raise InvalidRequest(f"{directory / where}: cannot read ({e})") from None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is not None and not isinstance(source, str):
            raise InvalidRequest(f"{directory}: {where} {show(source)} is not a template")
        return cls.for_family(source, where, arch, tokenizer)

    @classmethod
    def for_family(
        cls, source: str | None, where: str, arch: str, tokenizer: Tokenizer
    ) -> ChatTemplate:
        """``source`` (found at ``where``), or when None a fallback by family: Gemma for
        ``gemma*`` architectures, Llama 3 for llama models whose vocabulary has
        ``<|eot_id|>``, ChatML for everything else (Qwen2, SmolLM ...)."""
        name = f"the chat template ({where})"
        if source is None:
            if arch.startswith("gemma"):
                source, name = GEMMA, "the Gemma chat template"
            elif arch == "llama" and tokenizer.token_to_id("<|eot_id|>") is not None:
                source, name = LLAMA3, "the Llama 3 chat template"
            else:
                source, name = CHATML, "the ChatML chat template"
        ends = [t for t in _END_OF_TURN if t in source and not (harmony(source) and t == "<|end|>")]
        stops = (tokenizer.token_to_id(t) for t in ends)

        def token_text(id_: int | None) -> str:
            return "" if id_ is None else tokenizer.decode([id_], skip_special=False)

        return cls(
            source,
            bos_token=token_text(tokenizer.bos_id),
            eos_token=token_text(tokenizer.eos_id),
            stop_token_ids=frozenset(i for i in stops if i is not None),
            name=name,
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template (``tools``, ...).

        A template that rejects the conversation (``raise_exception``), fails, tries to leave
        the sandbox, or goes over its time or size budget raises `InvalidRequest`.
        """
        context = {
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        _budget.max_chars = sys.maxsize
        _budget.max_chars = MAX_RENDER_CHARS + 4 * _size([messages, context])
        tracer = sys.gettrace()
        sys.settrace(_deadline_tracer(RENDER_SECONDS))
        try:
            pieces, size = [], 0
            for piece in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            ):
                size += len(piece)
                _budget.check(size, "an output")
                pieces.append(piece)
            return "".join(pieces)
        except InvalidRequest:
            raise
        except _OverBudget as e:
            raise InvalidRequest(f"{self.name} is too costly to render: {e}") from None
        except Exception as e:  # the template's own failure: a type error, 1/0, recursion ...
            raise InvalidRequest(
                f"{self.name} failed on these messages: {type(e).__name__}: {show(str(e))}"
            ) from e
        finally:
            sys.settrace(tracer)
            _budget.max_chars = MAX_RENDER_CHARS
