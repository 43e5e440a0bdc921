"""Whether an answer keeps the promise of its request's constraint: the one check that the
HTTP fuzzers (schemathesis's hook, `fuzz_hooks`, and the structured-output fuzzer of
`test_fuzz_http`) apply to every 200.

A choice that ends ``stop`` (or ``tool_calls``) under a constraint must match it: valid JSON
of its schema, a full match of its regex, one of its choices, calls of the offered functions
with valid arguments. A choice cut by ``length`` may be any prefix. Every log-prob is a
finite number. A schema or regex that the checker itself cannot read (a fuzzed one that
jsonschema or Python's `re` refuses) is not checked beyond being JSON."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema

ENDED = ("stop", "tool_calls")


def constraint_of(body: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, value) of the request's output constraint: kind json, regex or choice."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return "json", {"type": "object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema") or {}
        return "json", spec.get("schema", {"type": "object"})
    so = body.get("structured_outputs") if isinstance(body.get("structured_outputs"), dict) else {}
    for kind, keys in (
        ("json", ("guided_json", "json")),
        ("regex", ("guided_regex", "regex")),
        ("choice", ("guided_choice", "choice")),
    ):
        for value in (body.get(keys[0]), so.get(keys[1])):
            if value is not None:
                return kind, json.loads(value) if isinstance(
                    value, str
                ) and kind == "json" else value
    if so.get("json_object"):
        return "json", {"type": "object"}
    return None


def _matches(kind: str, value: Any, text: str) -> str | None:
    """Why ``text`` does not match the constraint, or None."""
    if kind == "choice":
        return None if text in value else f"{text!r} is not one of the {len(value)} choices"
    if kind == "regex":
        try:
            pattern = re.compile(value)
        except (re.error, RecursionError, OverflowError):
            return None
        return None if pattern.fullmatch(text) else f"{text!r} does not match {value!r}"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return f"{text!r} is not JSON: {e}"
    try:
        jsonschema.validate(doc, value)
    except jsonschema.ValidationError as e:
        return f"{text!r} does not validate: {e.message[:300]}"
    except (jsonschema.SchemaError, jsonschema.exceptions._WrappedReferencingError):  # type: ignore[attr-defined]
        return None
    except (RecursionError, ValueError, TypeError, OverflowError):
        return None
    return None


def _finite_logprobs(logprobs: Any) -> str | None:
    numbers: list[Any] = []
    if isinstance(logprobs, dict) and "content" in logprobs:  # chat
        for entry in logprobs["content"] or []:
            numbers.append(entry["logprob"])
            numbers += [t["logprob"] for t in entry["top_logprobs"]]
    elif isinstance(logprobs, dict):  # legacy completions
        numbers += [v for v in logprobs.get("token_logprobs", []) if v is not None]
        numbers += [v for top in logprobs.get("top_logprobs", []) if top for v in top.values()]
    bad = [v for v in numbers if not (isinstance(v, float | int) and math.isfinite(v))]
    return f"log-probs that are not finite numbers: {bad[:5]}" if bad else None


def violation(body: dict[str, Any], choice: dict[str, Any]) -> str | None:
    """Why one answered choice (chat message or completion text, assembled if streamed)
    breaks its request's promise, or None."""
    if problem := _finite_logprobs(choice.get("logprobs")):
        return problem
    reason = choice.get("finish_reason")
    if reason not in ENDED:
        return None
    message = choice.get("message")
    text = choice["text"] if message is None else message.get("content") or ""
    calls = (message or {}).get("tool_calls") or []
    tools = {
        t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
        for t in body.get("tools") or []
    }
    forced = body.get("tool_choice")
    if calls or (tools and forced not in (None, "auto", "none")):
        if reason != "tool_calls" or not calls:
            return f"tool_choice {forced!r} answered without calls ({reason}): {text!r}"
        for call in calls:
            name, args = call["function"]["name"], call["function"]["arguments"]
            if name not in tools:
                return f"a call of {name!r}, which was not offered"
            if problem := _matches("json", tools[name], args):
                return f"the arguments of {name!r}: {problem}"
        return None
    if (constraint := constraint_of(body)) is None:
        return None
    if body.get("stop") or (body.get("echo") and message is None):
        return None  # a stop string may cut the text; echo puts the prompt first
    return _matches(*constraint, text)


def streamed_choices(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The choices of a streamed answer, assembled: content (or text), tool calls, finish
    reason and the log-probs of every chunk."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for part in event.get("choices") or []:
            choice = out.setdefault(part["index"], {"index": part["index"], "finish_reason": None})
            if "delta" in part:
                message = choice.setdefault("message", {"content": "", "tool_calls": []})
                message["content"] += part["delta"].get("content") or ""
                for call in part["delta"].get("tool_calls") or []:
                    message["tool_calls"].append(call)
                lp = (part.get("logprobs") or {}).get("content") or []
                choice.setdefault("logprobs", {"content": []})["content"] += lp
            else:
                choice["text"] = choice.get("text", "") + part["text"]
                for key, values in (part.get("logprobs") or {}).items():
                    choice.setdefault("logprobs", {}).setdefault(key, []).extend(values)
            choice["finish_reason"] = part.get("finish_reason") or choice["finish_reason"]
    return [out[i] for i in sorted(out)]
