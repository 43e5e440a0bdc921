"""The Lumen grammar (lark, LALR, positions kept) and its parse errors.

A ``.lum`` file declares a family: the architectures it serves, parameters bound from GGUF
metadata, the graph's inputs, functions, and one ``forward`` block; see ``docs/lumen.md``.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

from lark import Lark, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.grammar import Rule
from lark.lexer import TerminalDef

from dynalm.errors import DynaError

GRAMMAR = r"""
start: _item*
_item: family | param | input | fn | forward
family: "family" NAME ("," NAME)*
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
NUMBER: /\d+\.\d+([eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+/
STRING: /"[^"\\\n]*"/
WEIGHT.2: /w\??"[^"\\\n]*"/
COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""


class LumenError(DynaError):
    """A ``.lum`` program that does not parse, check or elaborate: ``file:line:col: what``."""


def at(where: str, node: Tree | object, message: str) -> LumenError:
    line, col = getattr(node, "line", None), getattr(node, "column", None)
    meta = getattr(node, "meta", None)
    if meta is not None and not getattr(meta, "empty", True):
        line, col = meta.line, meta.column
    return LumenError(f"{where}:{line}:{col}: {message}" if line else f"{where}: {message}")


# Building the LALR tables takes ~90 ms, loading them ~5 ms: they are kept, as JSON (no
# pickle), next to this file, under the grammar's hash; `python -m dynalm.ir.lumen.syntax`
# rewrites them after a grammar change (a test checks they are current).
TABLES = Path(__file__).with_name("lalr_tables.json")
# One lexer for the whole grammar: the contextual lexer's per-state scanners cost ~70 ms
# of regex compilation at the first parse.
_OPTIONS = dict(parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True)


def _grammar_hash() -> str:
    return hashlib.sha256(f"{GRAMMAR}{sorted(_OPTIONS.items())}".encode()).hexdigest()


def _build() -> Lark:
    return Lark(GRAMMAR, **_OPTIONS)


def _int_keys(obj: dict) -> dict:
    # JSON keys are strings; the tables index states and rules by number
    return {int(k) if k.isdigit() else k: v for k, v in obj.items()}


@cache
def _parser() -> Lark:
    try:
        saved = json.loads(TABLES.read_text(), object_hook=_int_keys)
    except (OSError, ValueError):
        return _build()
    if saved.get("grammar") != _grammar_hash():
        return _build()
    return Lark._load_from_dict(saved["data"], saved["memo"])


def write_tables() -> None:
    data, memo = _build().memo_serialize([TerminalDef, Rule])
    tables = {"grammar": _grammar_hash(), "data": data, "memo": memo}
    TABLES.write_text(json.dumps(tables, sort_keys=True) + "\n")


def parse(text: str, where: str) -> Tree:
    try:
        return _parser().parse(text)
    except UnexpectedToken as e:
        expected = sorted(_pretty(t) for t in e.accepts or e.expected)
        found = "end of file" if e.token.type == "$END" else repr(str(e.token))
        hint = f"expected {' or '.join(expected[:8])}" if expected else "unexpected input"
        raise LumenError(f"{where}:{e.line}:{e.column}: {hint}, found {found}") from None
    except UnexpectedCharacters as e:
        raise LumenError(f"{where}:{e.line}:{e.column}: unexpected character {e.char!r}") from None
    except UnexpectedInput as e:
        raise LumenError(f"{where}:{e.line}:{e.column}: {e}") from None


def _pretty(terminal: str) -> str:
    try:
        pattern = _parser().get_terminal(terminal).pattern
    except KeyError:
        return terminal
    return repr(pattern.value) if pattern.type == "str" else terminal.lower()


def parse_file(path: Path) -> Tree:
    return parse(path.read_text(), str(path))


if __name__ == "__main__":
    write_tables()
