"""DynaIR as text: a printer and a parser, with ``parse_graph(print_graph(g)) == g``.

    graph @llama(tokens: %0 tensor<i32, [T]>, positions: %1 tensor<i32, [T]>, ...) {
      %3: tensor<f32, [T, 576]> = embed %0, @"token_embd.weight": tensor<q8_0, [49152, 576]>
      %4: tensor<f32, [T, 576]> = rms_norm %3, @"blk.0.attn_norm.weight": tensor<f32, [576]>, ...
      ...
      return logits: %481
    }

A node is ``%id: type = op operands, weights, attrs``: value operands by id (their types
are those of their definitions), each weight with its tensor type, attributes as
``name=value`` typed by the op table (an int, a float written as Python writes it so that
it reads back to the same bits, ``true``/``false``, a list of tensor names). Dimensions are
numbers, symbols (``T`` tokens of the step, ``S`` sequences that need logits) or ``?``.
Parse errors name the line and column.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput

from dynalm.errors import DynaError
from dynalm.ir.graph import Graph, GraphError, Node, TensorType, Value, Weight
from dynalm.ir.ops import OPS, Names, check_attrs
from dynalm.ir.passes import verify

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
MAX_FILE_BYTES = 64 << 20  # a printed graph: ~150 bytes a node


class IRSyntaxError(DynaError):
    """DynaIR text that does not parse: ``where:line:col: what``."""


def _attr(value: Any) -> str:
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is tuple:
        return "[" + ", ".join(json.dumps(n) for n in value) + "]"
    return repr(value)  # int, or a float in the shortest form that reads back exactly


def print_node(node: Node) -> str:
    operands = [str(a) for a in node.args] + [str(w) for w in node.weights]
    known = OPS[node.op].attrs if node.op in OPS else ()
    order = [a.name for a in known if a.name in node.attrs]
    order += [k for k in node.attrs if k not in order]
    operands += [f"{k}={_attr(node.attrs[k])}" for k in order]
    return f"{node.out}: {node.out.type} = {node.op} {', '.join(operands)}"


def print_graph(graph: Graph) -> str:
    name = graph.name if _IDENT.fullmatch(graph.name) else json.dumps(graph.name)
    ins = ", ".join(f"{k}: {v} {v.type}" for k, v in graph.inputs.items())
    outs = ", ".join(f"{k}: {v}" for k, v in graph.outputs.items())
    body = "".join(f"  {print_node(n)}\n" for n in graph.nodes)
    return f"graph @{name}({ins}) {{\n{body}  return {outs}\n}}"


_GRAMMAR = r"""
start: "graph" "@" _name "(" [input ("," input)*] ")" "{" node* "return" [output ("," output)*] "}"
input: NAME ":" VALUE type
output: NAME ":" VALUE
node: VALUE ":" type "=" NAME operand ("," operand)*
?operand: VALUE | weight | attr
weight: "@" STRING ":" type
attr: NAME "=" _attr_value
_attr_value: NUMBER | TRUE | FALSE | names
names: "[" [STRING ("," STRING)*] "]"
type: "tensor" "<" NAME "," "[" [DIM ("," DIM)*] "]" ">"
_name: NAME | STRING
TRUE: "true"
FALSE: "false"
VALUE: /%\d+/
DIM: /\d+|[A-Za-z_]\w*|\?/
NAME: /[A-Za-z_][A-Za-z0-9_.]*/
NUMBER: /-?(\d+(\.\d*)?([eE][-+]?\d+)?|inf|nan)/
STRING: /"([^"\\\n]|\\.)*"/
COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""


@cache
def _parser() -> Lark:
    return Lark(_GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _unexpected(e: UnexpectedInput) -> str:
    token = getattr(e, "token", None)
    if token is None:
        return f"unexpected character {getattr(e, 'char', '')!r}"
    found = "end of input" if token.type == "$END" else repr(str(token))
    names = sorted(getattr(e, "expected", None) or ())
    shown = []
    for name in names[:8]:
        pattern = next((t.pattern for t in _parser().terminals if t.name == name), None)
        literal = pattern is not None and pattern.type == "str"
        shown.append(repr(pattern.value) if literal else name.lower())
    return f"unexpected {found}" + (f", expected {' or '.join(shown)}" if shown else "")


class _Reader:
    def __init__(self, where: str):
        self.where = where
        self.values: dict[int, Value] = {}

    def error(self, token: Token | Tree, message: str) -> IRSyntaxError:
        meta = token if isinstance(token, Token) else token.meta
        return IRSyntaxError(f"{self.where}:{meta.line}:{meta.column}: {message}")

    def type(self, tree: Tree) -> TensorType:
        dtype, *dims = tree.children
        shape = tuple(int(d) if d.isdigit() else str(d) for d in dims if d is not None)
        return TensorType(str(dtype), shape)

    def value(self, token: Token) -> Value:
        vid = int(token[1:])
        if vid not in self.values:
            raise self.error(token, f"{token} is used before it is defined")
        return self.values[vid]

    def define(self, token: Token, type_: TensorType) -> Value:
        vid = int(token[1:])
        if vid in self.values:
            raise self.error(token, f"{token} is defined twice")
        self.values[vid] = Value(vid, type_)
        return self.values[vid]

    def attr(self, op: str, tree: Tree) -> tuple[str, Any]:
        name, raw = tree.children
        spec = OPS[op].attr(str(name))
        if spec is None:
            raise self.error(name, f"{op} has no attribute '{name}'")
        if spec.type is Names:
            if not isinstance(raw, Tree):
                raise self.error(name, f"{name} is a list of names, found {raw}")
            return str(name), tuple(json.loads(s) for s in raw.children if s is not None)
        text = str(raw) if isinstance(raw, Token) else "[...]"
        if spec.type is bool and raw.type in ("TRUE", "FALSE"):
            return str(name), raw.type == "TRUE"
        if spec.type is int and re.fullmatch(r"-?\d+", text):
            return str(name), int(text)
        if spec.type is float and isinstance(raw, Token) and raw.type == "NUMBER":
            return str(name), float(text)
        kind = {int: "an integer", float: "a number", bool: "true or false"}[spec.type]
        raise self.error(name, f"{op}'s attribute {name} is {kind}, found {text}")

    def node(self, tree: Tree) -> Node:
        out_id, out_type, op, *operands = tree.children
        if str(op) not in OPS:
            raise self.error(op, f"unknown op '{op}' (known: {', '.join(OPS)})")
        args: list[Value] = []
        weights: list[Weight] = []
        attrs: dict[str, Any] = {}
        for x in operands:
            if isinstance(x, Token):
                args.append(self.value(x))
            elif x.data == "weight":
                weights.append(Weight(json.loads(x.children[0]), self.type(x.children[1])))
            else:
                key, val = self.attr(str(op), x)
                attrs[key] = val
        try:
            attrs = check_attrs(OPS[str(op)], attrs)
        except GraphError as e:
            raise self.error(op, str(e)) from None
        out = self.define(out_id, self.type(out_type))
        return Node(str(op), out, tuple(args), tuple(weights), attrs)


def parse_graph(text: str, where: str = "<dynair>") -> Graph:
    """The graph ``text`` describes; an ``IRSyntaxError`` (``where:line:col: ...``) if it
    does not parse or uses a value before defining it. Types are checked by ``verify``."""
    return _parse(text, where)[0]


def read_graph(text: str, where: str = "<dynair>") -> Graph:
    """``parse_graph``, then the verifier; its errors too name the node's line and column."""
    graph, lines = _parse(text, where)
    try:
        verify(graph)
    except GraphError as e:
        at = f"{lines[e.node]}: " if e.node is not None else ": "
        raise IRSyntaxError(f"{where}:{at}{e}") from None
    return graph


def _parse(text: str, where: str) -> tuple[Graph, list[str]]:
    """The graph and each node's ``line:col``."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise IRSyntaxError(f"{where}:{e.line}:{e.column}: {_unexpected(e)}") from None
    reader = _Reader(where)
    name, *rest = tree.children
    name = json.loads(name) if name.type == "STRING" else str(name)
    inputs: dict[str, Value] = {}
    nodes: list[Node] = []
    lines: list[str] = []
    outputs: dict[str, Value] = {}
    for item in rest:
        if item is None:
            continue
        if item.data == "input":
            key, vid, t = item.children
            inputs[str(key)] = reader.define(vid, reader.type(t))
        elif item.data == "node":
            nodes.append(reader.node(item))
            lines.append(f"{item.meta.line}:{item.meta.column}")
        else:
            key, vid = item.children
            outputs[str(key)] = reader.value(vid)
    return Graph(name, inputs, nodes, outputs), lines
