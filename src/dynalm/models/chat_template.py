"""Chat templates: a conversation (list of ``{"role", "content"}`` dicts) to one prompt string.

The template comes from ``tokenizer.chat_template`` in the GGUF (a Hugging Face Jinja template) or,
when the file has none, from a fallback chosen by model family (ChatML, Llama 3, Gemma). It renders
in Jinja's immutable sandbox with the globals HF templates expect, the way transformers'
``apply_chat_template`` does, so the same messages give the same text.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynalm.errors import InvalidRequest
from dynalm.models.tokenizer import Tokenizer

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

# Tokens that close a turn in the templates we know; those a template names are its stop tokens.
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
)


def _raise_exception(message: str) -> None:
    raise InvalidRequest(message)


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


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)


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
    ) -> None:
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_token_ids = stop_token_ids
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template does not parse: {e}") from e

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, tokenizer: Tokenizer) -> ChatTemplate:
        """The file's ``tokenizer.chat_template``, else a fallback by family.

        Fallbacks: Gemma for ``gemma*`` architectures, Llama 3 for llama models whose vocabulary
        has ``<|eot_id|>``, ChatML for everything else (Qwen2, SmolLM ...).
        """
        source = metadata.get("tokenizer.chat_template")
        if source is None:
            arch = str(metadata.get("general.architecture", ""))
            if arch.startswith("gemma"):
                source = GEMMA
            elif arch == "llama" and tokenizer.token_to_id("<|eot_id|>") is not None:
                source = LLAMA3
            else:
                source = CHATML
        stops = (tokenizer.token_to_id(t) for t in _END_OF_TURN if t in source)

        def text(id_: int | None) -> str:
            return "" if id_ is None else tokenizer.decode([id_], skip_special=False)

        return cls(
            source,
            bos_token=text(tokenizer.bos_id),
            eos_token=text(tokenizer.eos_id),
            stop_token_ids=frozenset(i for i in stops if i is not None),
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template (``tools``, ...).

        A template that rejects the conversation (``raise_exception``), fails, or tries to leave
        the sandbox raises `InvalidRequest`.
        """
        context = {
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template failed: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequest(f"chat template failed on these messages: {e!r}") from e
