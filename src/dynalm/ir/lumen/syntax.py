"""The Lumen grammar (lark, LALR, positions kept), its parse errors, and the parsed tree
as ``tree.Node``s (cached, so that model load imports lark only for a file it has not
parsed before).

A ``.lum`` file declares a family: the architectures it serves, parameters bound from GGUF
metadata, the graph's inputs, functions, and one ``forward`` block; see ``docs/lumen.md``.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynalm.ir.lumen.tree import MAX_NESTING, LumenError, Meta, Node, Tok, at, cached_tree

if TYPE_CHECKING:
    from lark import Lark

GRAMMAR = r"""
start: _item*
_item: family | param | input | fn | forward
family: "family" arch ("," arch)*
arch: NAME ("-" NAME)*
param: "param" NAME ":" SCALAR "=" expr
input: "input" NAME ":" tensor_type
fn: "fn" NAME "(" [fparam ("," fparam)*] ")" "->" _type block
fparam: NAME ":" _type
forward: "forward" block
block: "{" _stmt* "}"
_stmt: let | for_ | if_ | return_ | output
let: "let" NAME [":" _type] "=" expr
for_: "for" NAME "in" expr ".." expr block
if_: "if" expr block ["else" (block | if_)]
return_: "return" expr
output: "output" NAME "=" expr

_type: SCALAR | tensor_type
tensor_type: "tensor" "<" NAME "," "[" [_dim ("," _dim)*] "]" ">"
_dim: sum | ANY
SCALAR.3: /(int|float|bool|str)\b/
ANY: "?"

?expr: or_expr
     | "if" expr "then" expr "else" expr -> ifexpr
?or_expr: and_expr | or_expr "or" and_expr -> or_
?and_expr: not_expr | and_expr "and" not_expr -> and_
?not_expr: compare | "not" not_expr -> not_
?compare: sum | sum _cmp sum -> binop
?sum: product | sum _add product -> binop
?product: unary | product _mul unary -> binop
?unary: atom | "-" unary -> neg
?atom: NUMBER -> number
     | STRING -> string
     | WEIGHT -> weight
     | WEIGHT ":" "[" _dim ("," _dim)* "]" -> shaped_weight
     | "true" -> true
     | "false" -> false
     | NAME -> var
     | NAME "(" [arg ("," arg)*] ")" -> call
     | "(" expr ")"
?arg: expr | NAME "=" expr -> kwarg

!_cmp: "==" | "!=" | "<=" | ">=" | "<" | ">"
!_add: "+" | "-"
!_mul: "*" | "/" | "//" | "%"
NAME: /[A-Za-z_][A-Za-z0-9_]*/
NUMBER: /[0-9]+\.[0-9]+([eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+|[0-9]+/
STRING: /"[^"\\\n]*"/
WEIGHT.2: /w\??"[^"\\\n]*"/
COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""


# Building the LALR tables takes ~90 ms, loading them ~5 ms: they are kept, as JSON (no
# pickle), next to this file, under the grammar's hash; `python -m dynalm.ir.lumen.syntax`
# rewrites them after a grammar change (a test checks they are current).
TABLES = Path(__file__).with_name("lalr_tables.json")
# One lexer for the whole grammar: the contextual lexer's per-state scanners cost ~70 ms
# of regex compilation at the first parse.
_OPTIONS = dict(parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True)


@cache
def _grammar_hash() -> str:
    return hashlib.sha256(f"{GRAMMAR}{sorted(_OPTIONS.items())}".encode()).hexdigest()


def _build() -> Lark:
    from lark import Lark

    return Lark(GRAMMAR, **_OPTIONS)


def _int_keys(obj: dict) -> dict:
    # JSON keys are strings; the tables index states and rules by number
    return {int(k) if k.isdigit() else k: v for k, v in obj.items()}


@cache
def _parser() -> Lark:
    from lark import Lark

    try:
        saved = json.loads(TABLES.read_text(), object_hook=_int_keys)
    except (OSError, ValueError):
        return _build()
    if saved.get("grammar") != _grammar_hash():
        return _build()
    return Lark._load_from_dict(saved["data"], saved["memo"])


def write_tables() -> None:
    from lark.grammar import Rule
    from lark.lexer import TerminalDef

    data, memo = _build().memo_serialize([TerminalDef, Rule])
    tables = {"grammar": _grammar_hash(), "data": data, "memo": memo}
    TABLES.write_text(json.dumps(tables, sort_keys=True) + "\n")


def parse(text: str, where: str) -> Node:
    """``text``'s tree; a ``LumenError`` at the first token the grammar does not allow."""
    from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

    try:
        tree = _parser().parse(text)
    except UnexpectedToken as e:
        expected = sorted(_pretty(t) for t in e.accepts or e.expected)
        found = "end of file" if e.token.type == "$END" else repr(str(e.token))
        hint = f"expected {' or '.join(expected[:8])}" if expected else "unexpected input"
        raise LumenError(f"{where}:{e.line}:{e.column}: {hint}, found {found}") from None
    except UnexpectedCharacters as e:
        raise LumenError(f"{where}:{e.line}:{e.column}: unexpected character {e.char!r}") from None
    except UnexpectedInput as e:
        raise LumenError(f"{where}:{e.line}:{e.column}: {e}") from None
    return _convert(tree, where)


def parse_cached(text: str, where: str) -> Node:
    """``parse``, through the tree cache (model load: no lark for a file parsed before)."""
    return cached_tree(text, _grammar_hash(), lambda: parse(text, where))


def _convert(tree: Any, where: str) -> Node:
    """lark's tree as ``Node``s, iteratively (a file may nest thousands deep: `- - - 1`, a
    20,000-term sum), refused at the first node nested deeper than ``MAX_NESTING``."""
    from lark import Token, Tree

    def node(t: Tree) -> Node:
        m = t.meta
        position = [getattr(m, k, 0) for k in ("line", "column", "start_pos", "end_pos")]
        return Node(str(t.data), [], Meta(*position))

    root = node(tree)
    # pre-order, children pushed in reverse: each is appended to its parent in source order
    stack = [(c, root.children, 2) for c in reversed(tree.children)]
    while stack:
        x, siblings, depth = stack.pop()
        if isinstance(x, Tree):
            child = node(x)
            if depth > MAX_NESTING:
                raise at(where, child, f"nested deeper than {MAX_NESTING} levels")
            siblings.append(child)
            stack.extend((c, child.children, depth + 1) for c in reversed(x.children))
        elif isinstance(x, Token):
            siblings.append(Tok(x.type, str(x), x.line, x.column))
        else:
            siblings.append(None)
    return root


def _pretty(terminal: str) -> str:
    try:
        pattern = _parser().get_terminal(terminal).pattern
    except KeyError:
        return terminal
    return repr(pattern.value) if pattern.type == "str" else terminal.lower()


if __name__ == "__main__":
    write_tables()
