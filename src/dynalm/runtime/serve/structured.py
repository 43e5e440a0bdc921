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
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import llguidance
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynalm.errors import InvalidRequest, show

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)

# llguidance's JSON options, set inside each schema ("x-guidance")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# llguidance's parser holds at most 2,000 items in a row: more choices than that fail at the
# first token, so the limit is stated up front
MAX_CHOICES = 1000
MAX_SCHEMA_DEPTH = 100  # nesting of a schema's objects and arrays
# What a regex's counted repeats may expand to (``x{m,n}`` counts max(m, n), nested repeats
# multiply, a sequence or alternation adds): llguidance unrolls them, so the cost of each
# step's mask grows with it (SmolLM2, one core: a{1000} 0.7 ms, a{10000} 35 ms, a{100000}
# 45-900 ms a step, on the server's mask thread). A regex with no counted repeat is never
# refused by this (its expansion is its length).
MAX_REGEX_EXPANSION = 1000
# a schema's numbers reach llguidance as 64-bit integers or finite doubles
_MAX_SCHEMA_INT = 2**63


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
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
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
            return json_grammar(_schema(self.value, self.field), self.field)
        if self.kind == "regex":
            check_regex(self.value, self.field)
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.value))
        try:  # Lark, or llama.cpp's GBNF (converted)
            lark = llguidance.grammar_from("grammar", self.value)
        except ValueError as e:
            raise InvalidRequest(f"{self.field}: {str(e).splitlines()[0]}") from None
        check_grammar(lark, self.field)
        return lark


def _schema(value: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM takes a schema written as a JSON string too
        value = load_schema(value, field)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON schema (an object)")
    return value


def load_schema(text: str | bytes, what: str) -> Any:
    """JSON text of a schema, parsed as the HTTP bodies are (big integers kept, nesting
    bounded: Python's `json` recurses until RecursionError); `check_schema` comes later."""
    try:
        return pydantic_core.from_json(text)
    except ValueError as e:
        raise InvalidRequest(f"{what}: cannot read a JSON schema: {e}") from None


def check_schema(schema: dict[str, Any], field: str) -> None:
    """What llguidance cannot take, as a 400 naming the place in ``schema``: nesting over
    `MAX_SCHEMA_DEPTH`, numbers out of range (5,000-digit bounds), and ``$ref`` chains that
    lead back to themselves (a root ``{"$ref": "#"}``: no token could ever start it)."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    refs: list[tuple[dict[str, Any], str]] = []
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(f"{field}: nested deeper than {MAX_SCHEMA_DEPTH} at {path}")
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append((node, path))
            stack += [(v, f"{path}/{k}", depth + 1) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{path}/{i}", depth + 1) for i, v in enumerate(node)]
        elif isinstance(node, int) and not isinstance(node, bool):
            if not -_MAX_SCHEMA_INT < node < _MAX_SCHEMA_INT:
                raise InvalidRequest(
                    f"{field}: the number at {path or '/'} ({_digits(node)} digits) is out of "
                    "range: a schema's integers must be within +-2**63"
                )
        elif isinstance(node, float) and not math.isfinite(node):
            raise InvalidRequest(f"{field}: the number at {path or '/'} is not finite")
        elif isinstance(node, str) and path.endswith("/pattern"):
            check_regex(node, f"{field}: the pattern at {path}")
    for node, path in refs:
        seen = [id(node)]
        chain = [node["$ref"]]
        while isinstance(target := _resolve(schema, chain[-1]), dict) and isinstance(
            target.get("$ref"), str
        ):
            if id(target) in seen:
                raise InvalidRequest(
                    f"{field}: the $ref at {path or '/'} leads back to itself "
                    f"({' -> '.join(show(r, 60) for r in chain)}): nothing could match it"
                )
            seen.append(id(target))
            chain.append(target["$ref"])


_REPEAT = re.compile(r"\{(\d*)(,(\d*))?\}")
_HUGE = 10**9  # a count of 10 digits or more: past any limit (and 5,000 digits kill int())
_CAP = 10**15  # sizes stop growing here: (a{999999999}){999999999}... stays a small int


def _count(low: str, high: str) -> int:
    return max(int(low or 0), int(high or 0)) if max(len(low), len(high)) < 10 else _HUGE


class _Expansion:
    """What a sequence of atoms expands to, with groups, alternation and counted repeats:
    one frame per open group (size of the alternatives closed so far, of the current one,
    of its last atom); an atom's size is multiplied by the repeat that follows it."""

    def __init__(self) -> None:
        self.frames = [[0, 0, 0]]

    def atom(self, size: int) -> None:
        top = self.frames[-1]
        top[1], top[2] = min(top[1] + size, _CAP), size

    def open(self) -> None:
        self.frames.append([0, 0, 0])

    def close(self) -> None:
        if len(self.frames) > 1:
            top = self.frames.pop()
            self.atom(top[0] + top[1])

    def alternative(self) -> None:
        top = self.frames[-1]
        top[0], top[1], top[2] = min(top[0] + top[1], _CAP), 0, 0

    def repeat(self, count: int) -> None:
        top = self.frames[-1]
        top[1] = min(top[1] + top[2] * (count - 1), _CAP)
        top[2] = min(top[2] * count, _CAP)

    def total(self) -> int:
        return min(sum(f[0] + f[1] for f in self.frames), _CAP)


def regex_expansion(regex: str, what: str) -> int:
    """How many characters ``regex`` spells out once its counted repeats are unrolled
    (``x{m,n}`` counts max(m, n)). A scan of the regex's structure only: escapes and
    character classes are one character, groups nest, anchors are none; what is not valid
    is left to llguidance to refuse, except a possessive quantifier (``x?+``, ``x*+``,
    ``x{2}+``: Python's ``re`` and PCRE's), which llguidance would read as a repeat of a
    repeat, another language: refused (400 naming ``what``)."""
    e = _Expansion()
    i, n = 0, len(regex)
    repeated = False  # the last token was a quantifier
    while i < n:
        c = regex[i]
        if c == "+" and repeated:
            raise InvalidRequest(
                f"{what}: the possessive quantifier {regex[max(0, i - 1) : i + 1]!r} at "
                f"character {i} is not supported (without its '+' it matches the same strings)"
            )
        repeated = c in "?*+"
        if c == "\\":
            i += 2
            if i - 1 < n and regex[i - 1] in "pPxu" and i < n and regex[i] == "{":
                i = regex.find("}", i) + 1 or n  # \p{Greek}, \x{41}: not a repeat
            e.atom(1)
        elif c == "[":
            j = i + 1 + (regex[i + 1 : i + 2] == "^")
            j += regex[j : j + 1] == "]"  # a ']' first is a member
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i = j + 1
            e.atom(1)
        elif c == "(":
            e.open()
            i += 1
            if regex.startswith("?", i):  # (?:, (?P<name>, (?i): up to the ':' or ')'
                end = min(k for k in (regex.find(":", i), regex.find(")", i), n) if k >= 0)
                i = end + (regex[end : end + 1] == ":")
        elif c == ")":
            e.close()
            i += 1
        elif c == "|":
            e.alternative()
            i += 1
        elif c == "{" and (m := _REPEAT.match(regex, i)) and (m.group(1) or m.group(3)):
            e.repeat(_count(m.group(1), m.group(3) or ""))
            i, repeated = m.end(), True
        else:
            if c not in "^$":  # (anchors match no character)
                e.atom(1)
            i += 1
    return e.total()


def check_regex(regex: str, what: str) -> None:
    """Refuse (400 naming ``what`` and the limit) a regex whose counted repeats expand past
    `MAX_REGEX_EXPANSION` characters (see there)."""
    _check_expansion(
        regex_expansion(regex, what),
        len(regex),
        f"{what}: its counted repeats expand the regex to",
    )


def _check_expansion(total: int, written: int, what: str) -> None:
    """One limit for regexes and grammars: past `MAX_REGEX_EXPANSION` characters, unless
    the client wrote that many itself (a long literal costs what it is)."""
    if total > max(MAX_REGEX_EXPANSION, written):
        shown = str(total) if total < 10**12 else f"about 10^{len(str(total)) - 1}"
        raise InvalidRequest(
            f"{what} {shown} characters, more than the limit of {MAX_REGEX_EXPANSION}"
        )


# llguidance's Lark (what `llguidance.grammar_from` makes of Lark and GBNF alike), as far
# as sizes go: a rule's head at the start of a line, directives, and the atoms of a body
_RULE_HEAD = re.compile(r"[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:(?!:)")
_LARK_ATOM = re.compile(
    r"""(?P<space>\s+|//[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?)
    |(?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
    |(?P<token><\|[^|\n]*\|>|<\[[^\]\n]*\]>)
    |(?P<directive>%\w+)
    |(?P<repeat>\{[ \t]*(?P<low>\d*)[ \t]*(?:,[ \t]*(?P<high>\d*)[ \t]*)?\})
    |(?P<tilde>~[ \t]*(?P<tlow>\d+)(?:[ \t]*\.\.[ \t]*(?P<thigh>\d+))?)
    |(?P<name>[A-Za-z_][\w.]*)
    |(?P<open>[(\[])|(?P<close>[)\]])|(?P<bar>\|)
    |.""",
    re.X,
)


def _json_end(text: str, i: int) -> int:
    """Where the JSON value that opens with the bracket at ``i`` ends (strings skipped)."""
    depth, quoted = 0, False
    while i < len(text):
        c = text[i]
        if quoted:
            i += c == "\\"
            quoted = c != '"'
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def check_grammar(lark: str, what: str) -> None:
    """Refuse (400 naming ``what``, the rule and the limit) a grammar any of whose rules
    spells out more than `MAX_REGEX_EXPANSION` characters once counted repeats
    (``x{m,n}``, ``x ~ m..n``) are unrolled and the rules it uses put in its place: repeats
    nested through rules multiply, as llguidance's costs do (SmolLM2: ``x{150}`` of
    ``y{150}`` costs each step's mask what ``a{20000}`` does, ~20 times ``a{1000}``); a
    rule used inside itself counts once (recursion is not unrolled). Regexes count as
    `check_regex` counts them, and each embedded ``%json`` schema goes through
    `check_schema`."""
    bodies: dict[str, list[tuple[str, Any]]] = {}
    body: list[tuple[str, Any]] = []  # (atoms before the first rule: no rule's)
    i, n = 0, len(lark)
    while i < n:
        line_start = i == 0 or lark[i - 1] == "\n"
        if line_start and (head := _RULE_HEAD.match(lark, i)):
            body = bodies.setdefault(head.group(1), [])
            i = head.end()
            continue
        m = _LARK_ATOM.match(lark, i)
        assert m is not None  # (its last alternative takes any character)
        i, kind = m.end(), m.lastgroup
        if kind == "directive" and m.group() == "%ignore":  # its lexemes: a rule's
            body = bodies.setdefault("%ignore", [])
        elif kind == "directive":  # %json {...}, %regex {...}; %import ...: its line
            j = n - len(lark[i:].lstrip(" \t"))
            end = _json_end(lark, j) if lark.startswith("{", j) else j
            if m.group() == "%json":
                check_schema(_schema(load_schema(lark[j:end], what), what), f"{what}: %json")
                body.append(("atom", 1))
            elif m.group() == "%regex":
                body.append(("atom", 1))
            elif not lark[m.start() - 1 : m.start()].strip():
                end = lark.find("\n", end) % (n + 1)
            i = end
        elif kind == "string":
            body.append(("atom", max(1, len(m.group().rstrip("i")) - 2)))
        elif kind == "regex":
            pattern = m.group()[1 : m.group().rindex("/")]
            body.append(("atom", regex_expansion(pattern, f"{what}: the regex /{pattern}/")))
        elif kind == "token":
            body.append(("atom", 1))
        elif kind == "repeat" and (m.group("low") or m.group("high")):
            body.append(("repeat", _count(m.group("low"), m.group("high") or "")))
        elif kind == "tilde":
            body.append(("repeat", _count(m.group("tlow"), m.group("thigh") or "")))
        elif kind in ("name", "open", "close", "bar"):
            body.append((kind, m.group()))
    for name, size in _rule_sizes(bodies).items():
        _check_expansion(size, n, f"{what}: the rule {show(name, 60)} expands to")


def _rule_sizes(bodies: dict[str, list[tuple[str, Any]]]) -> dict[str, int]:
    """Each rule's expansion, the rules it uses expanded in place (depth first, without
    recursion: a chain of 100,000 rules is fine); a rule that uses itself counts 1 there."""
    sizes: dict[str, int] = {}
    started: set[str] = set()
    for root in bodies:
        stack = [root]
        while stack:
            name = stack[-1]
            if name not in started:
                started.add(name)
                stack += [
                    v for k, v in bodies[name] if k == "name" and v in bodies and v not in started
                ]
                continue
            stack.pop()
            if name in sizes:
                continue
            e = _Expansion()
            for kind, value in bodies[name]:
                if kind == "atom":
                    e.atom(value)
                elif kind == "name":  # undefined or imported (common.WS): one character
                    e.atom(sizes.get(value, 1))
                elif kind == "repeat":
                    e.repeat(value)
                elif kind == "bar":
                    e.alternative()
                elif kind == "open":
                    e.open()
                else:
                    e.close()
            sizes[name] = e.total()
    return sizes


def _digits(n: int) -> int:
    """Decimal digits of ``n`` (``str`` refuses integers of over 4,300)."""
    estimate = int(abs(n).bit_length() * math.log10(2)) + 1
    return estimate - 1 if abs(n) < 10 ** (estimate - 1) else estimate


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The node a local ``$ref`` (a JSON pointer after ``#``) names; None if none."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def json_schema_with_style(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's options for the compact JSON style."""
    return {**schema, "x-guidance": JSON_STYLE}


def json_grammar(schema: dict[str, Any], field: str) -> str:
    """The grammar of JSON matching ``schema`` (``field``: where it came from)."""
    check_schema(schema, field)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema_with_style(schema))
    except ValueError as e:  # what the checks above do not foresee: still the client's
        raise InvalidRequest(f"{field}: {show(str(e).splitlines()[0])}") from None


class ConstraintFields(BaseModel):
    """The request fields that constrain the output (mixed into the request models)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
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
