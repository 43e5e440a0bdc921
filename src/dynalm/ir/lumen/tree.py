"""Lumen's syntax trees, and the cache that spares model load the parser.

A parsed file is a tree of ``Node`` (a grammar rule: ``data``, ``children``, source
position) and ``Tok`` (a token: its text, terminal type and position). They are lark's
trees converted, so that a tree read back from the cache needs no lark at all: importing
lark and its grammar tables costs ~30 ms of every model load, reading a file's cached tree
~2 ms. The cache holds JSON (no pickle) under ``$DYNALM_CACHE/lumen`` (default
``~/.cache/dynalm/lumen``), keyed by the file's text and the grammar; a cache that cannot
be written only costs the parse.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dynalm.errors import DynaError

CACHE_FORMAT = 1
# Deepest nesting of rules a file may have (an expression's operators, blocks, calls): the
# checker and the elaborator recurse over trees, ~3 Python frames a level.
MAX_NESTING = 100


class LumenError(DynaError):
    """A ``.lum`` program that does not parse, check or elaborate: ``file:line:col: what``."""


class Meta:
    __slots__ = ("line", "column", "start_pos", "end_pos")

    def __init__(self, line: int, column: int, start_pos: int, end_pos: int):
        self.line, self.column, self.start_pos, self.end_pos = line, column, start_pos, end_pos


class Tok(str):
    """A token: the text it matched, with its terminal ``type`` and position."""

    def __new__(cls, type_: str, value: str, line: int, column: int) -> Tok:
        token = super().__new__(cls, value)
        token.type, token.line, token.column = type_, line, column
        return token


class Node:
    """A grammar rule's match: ``data`` (the rule), ``children`` (Node, Tok or None)."""

    __slots__ = ("data", "children", "meta")

    def __init__(self, data: str, children: list, meta: Meta):
        self.data, self.children, self.meta = data, children, meta

    def iter_subtrees(self) -> Iterator[Node]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children if isinstance(c, Node))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and (self.data, self.children) == (
            other.data,
            other.children,
        )

    __hash__ = None  # type: ignore[assignment]


def at(where: str, node: Node | Tok | None, message: str) -> LumenError:
    """``message`` at ``node``'s position in file ``where``."""
    place = node.meta if isinstance(node, Node) else node
    line = getattr(place, "line", None)
    return LumenError(
        f"{where}:{line}:{place.column}: {message}" if line else f"{where}: {message}"
    )


def _encode(x: Node | Tok | None) -> Any:
    if isinstance(x, Node):
        m = x.meta
        return [
            x.data,
            [m.line, m.column, m.start_pos, m.end_pos],
            [_encode(c) for c in x.children],
        ]
    if isinstance(x, Tok):
        return {"t": x.type, "v": str(x), "p": [x.line, x.column]}
    return None


def _decode(x: Any, depth: int = 1) -> Node | Tok | None:
    """A cached tree, every field checked: a corrupt or foreign entry raises ValueError."""
    if depth > MAX_NESTING:
        raise ValueError("nested too deep")
    if type(x) is list and len(x) == 3:
        data, meta, children = x
        if type(data) is str and _ints(meta, 4) and type(children) is list:
            return Node(data, [_decode(c, depth + 1) for c in children], Meta(*meta))
    elif type(x) is dict and set(x) == {"t", "v", "p"}:
        if type(x["t"]) is str and type(x["v"]) is str and _ints(x["p"], 2):
            return Tok(x["t"], x["v"], *x["p"])
    elif x is None:
        return None
    raise ValueError(f"not a cached tree: {type(x).__name__}")


def _ints(x: Any, n: int) -> bool:
    return type(x) is list and len(x) == n and all(type(i) is int for i in x)


def cache_dir() -> Path:
    root = os.environ.get("DYNALM_CACHE")
    return Path(root) / "lumen" if root else Path.home() / ".cache" / "dynalm" / "lumen"


def cached_tree(text: str, grammar: str, parse: Callable[[], Node]) -> Node:
    """The tree of ``text``: read from the cache, or ``parse()`` d and then cached. An entry
    that does not decode to a tree (corrupt, foreign, truncated) is parsed again and
    rewritten; only a tree that parsed is written."""
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{grammar}\0{text}".encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.json"
    try:
        tree = _decode(json.loads(path.read_text()))
        if isinstance(tree, Node):
            return tree
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        pass
    tree = parse()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(_encode(tree), f, separators=(",", ":"))
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only cache only costs the parse
    return tree
