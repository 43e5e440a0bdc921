"""Structured output on the wire: OpenAI's ``response_format`` and vLLM's guided-decoding
extensions, each turned into one llguidance grammar (which `guided` then enforces).

* ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}``; ``text`` asks for nothing.
* vLLM's older fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (Lark or GBNF), and its newer ``structured_outputs`` object with the keys
  ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``.

A request may ask for one constraint only. JSON is generated compactly, as ``json.dumps``
writes it (``", "`` and ``": "``, no other whitespace): free whitespace lets a small model
write newlines forever instead of the value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynalm.errors import InvalidRequest

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)

# llguidance's JSON options, set inside each schema ("x-guidance")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=lambda: dict(ANY_OBJECT), alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with (and only with) type "json_schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (exactly one key)."""

    model_config = _STRICT

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: a ``kind`` of grammar and its text or schema,
    with the request field that asked (for error messages)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: Any
    field: str

    def grammar(self) -> str:
        """The llguidance grammar (still to be checked against the vocabulary)."""
        if self.kind == "json":
            return json_grammar(_schema(self.value, self.field))
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.value))
        try:  # Lark, or llama.cpp's GBNF (converted)
            return llguidance.grammar_from("grammar", self.value)
        except ValueError as e:
            raise InvalidRequest(f"{self.field}: {str(e).splitlines()[0]}") from None


def _schema(value: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM takes a schema written as a JSON string too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON schema (an object)")
    return value


def json_schema_with_style(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's options for the compact JSON style."""
    return {**schema, "x-guidance": JSON_STYLE}


def json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json_schema_with_style(schema))


class ConstraintFields(BaseModel):
    """The request fields that constrain the output (mixed into the request models)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> ConstraintFields:
        self.constraint()  # raises for two constraints at once
        return self

    def constraint(self) -> Constraint | None:
        """The request's constraint, if any."""
        found: list[Constraint] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(Constraint("json", ANY_OBJECT, "response_format"))
        elif fmt is not None and fmt.json_schema is not None:
            schema = fmt.json_schema.json_schema
            found.append(Constraint("json", schema, "response_format.json_schema.schema"))
        for kind, value in (
            ("json", self.guided_json),
            ("regex", self.guided_regex),
            ("choice", self.guided_choice),
            ("grammar", self.guided_grammar),
        ):
            if value is not None:
                found.append(Constraint(kind, value, f"guided_{kind}"))  # type: ignore[arg-type]
        if (so := self.structured_outputs) is not None:
            keys = [
                ("json", so.json_, "json"),
                ("json", ANY_OBJECT if so.json_object else None, "json_object"),
                ("regex", so.regex, "regex"),
                ("choice", so.choice, "choice"),
                ("grammar", so.grammar, "grammar"),
            ]
            given = [Constraint(k, v, f"structured_outputs.{n}") for k, v, n in keys if v]  # type: ignore[arg-type]
            if not given:
                raise ValueError(
                    "structured_outputs must give one of json, regex, choice, "
                    "grammar or json_object"
                )
            found += given
        if len(found) > 1:
            names = ", ".join(c.field for c in found)
            raise ValueError(f"ask for one output constraint at most (got {names})")
        return found[0] if found else None
