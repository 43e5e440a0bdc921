"""A parsed ``.lum`` file split into its declarations, with the checks that need no model:
each name declared once, one ``forward`` block, ``return`` only in functions and
``output`` only in ``forward``, every called function or op known and given the operands,
weights and attributes it takes, every variable bound somewhere before it is read.

Besides ``arch``, a program may read names it is *given*: values the elaborator receives
rather than the file declaring them (a family file's: the model's hyper-parameters, read
once by ``models.hparams``; RFC 005)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dynalm.files import read_source
from dynalm.ir.lumen.syntax import parse, parse_cached
from dynalm.ir.lumen.tree import LumenError, Node, Tok, at
from dynalm.ir.ops import OPS, REQUIRED

# Built-in functions: name -> (fewest, most positional arguments, keyword arguments).
BUILTINS: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "gguf": (1, 1, ("default",)),  # a metadata value of the model file
    "has": (1, 1, ()),  # whether the model file has a tensor of that name
    "rows": (1, 1, ()),  # a weight's first dimension
    "sqrt": (1, 1, ()),
}


@dataclass
class Program:
    where: str
    text: str
    given: frozenset[str] = frozenset()  # names the elaborator gives (beside arch)
    families: list[str] = field(default_factory=list)
    params: list[Node] = field(default_factory=list)
    inputs: list[Node] = field(default_factory=list)
    fns: dict[str, Node] = field(default_factory=dict)
    forward: Node | None = None

    def error(self, node: Node | Tok, message: str) -> LumenError:
        return at(self.where, node, message)

    def source(self, node: Node) -> str:
        """The text of ``node``, on one line and short, for messages."""
        text = " ".join(self.text[node.meta.start_pos : node.meta.end_pos].split())
        return text if len(text) <= 80 else text[:77] + "..."


def load_program(
    text: str, where: str, cached: bool = False, given: frozenset[str] = frozenset()
) -> Program:
    """Parse (``cached``: through the tree cache) and check ``text``, which may read the
    ``given`` names; a ``LumenError`` names the first fault's line and column."""
    program = Program(where, text, frozenset(given))
    names: set[str] = {"arch", *given}
    tree = parse_cached(text, where) if cached else parse(text, where)
    for item in tree.children:
        if item.data == "family":
            # GGUF architecture names may hold dashes (nomic-bert)
            program.families += ["-".join(map(str, a.children)) for a in item.children]
            continue
        if item.data == "forward":
            if program.forward is not None:
                raise program.error(item, "a second forward block")
            program.forward = item
            continue
        name = item.children[0]
        if str(name) in names or str(name) in OPS or str(name) in BUILTINS:
            raise program.error(name, f"'{name}' is already defined")
        names.add(str(name))
        {"param": program.params, "input": program.inputs}.get(item.data, []).append(item)
        if item.data == "fn":
            program.fns[str(name)] = item
    if not program.families:
        raise LumenError(f"{where}:1:1: the file names no family (family NAME, ...)")
    if program.forward is None:
        raise LumenError(f"{where}:1:1: the file has no forward block")
    _Checker(program).run()
    return program


MAX_FILE_BYTES = 1 << 20  # a family file is a few KiB


def load_file(path: Path, given: frozenset[str] = frozenset()) -> Program:
    return load_program(read_source(path, MAX_FILE_BYTES), str(path), cached=True, given=given)


class _Checker:
    """The static checks, over scopes of names (flow-insensitive within a function)."""

    def __init__(self, program: Program):
        self.p = program
        self.globals = {"arch", *program.given}

    def run(self) -> None:
        for param in self.p.params:
            self.expr(param.children[2], self.globals)
            self.globals.add(str(param.children[0]))
        self.globals.update(str(i.children[0]) for i in self.p.inputs)
        for fn in self.p.fns.values():
            name, *params, ret, body = fn.children
            params = [p for p in params if p is not None]
            types = [p.children[1] for p in params]
            # the names a parameter's type leaves unbound are type variables, bound by the call
            variables = {
                str(t) for tt in types if isinstance(tt, Node) for t in tt.children[:1]
            } | {n for tt in types if isinstance(tt, Node) for n in self.free(tt)}
            scope = self.globals | {str(p.children[0]) for p in params} | variables
            self.types([*types, ret], scope)
            self.block(body, scope | self.bound(body), in_fn=True)
            if not any(s.data == "return_" for s in body.children):
                raise self.p.error(name, f"function {name} does not end with a return")
        body = self.p.forward.children[0]
        self.block(body, self.globals | self.bound(body), in_fn=False)

    def bound(self, block: Node) -> set[str]:
        """Names a block's statements bind (let, for), nested blocks included."""
        names = set()
        for s in block.iter_subtrees():
            if s.data in ("let", "for_"):
                names.add(str(s.children[0]))
        return names

    def types(self, types: list, scope: set[str]) -> None:
        """Types may name unbound dimensions and dtypes (type variables): only calls in
        them are checked."""
        for t in types:
            if isinstance(t, Node):
                for dim in t.children[1:]:
                    if isinstance(dim, Node):
                        self.expr(dim, scope | self.free(dim))

    @staticmethod
    def free(tree: Node) -> set[str]:
        return {str(v.children[0]) for v in tree.iter_subtrees() if v.data == "var"}

    def block(self, block: Node, scope: set[str], in_fn: bool) -> None:
        for s in block.children:
            if s.data == "return_" and not in_fn:
                raise self.p.error(s, "return outside a function (forward ends with output)")
            if s.data == "output" and in_fn:
                raise self.p.error(s, "output inside a function (functions return)")
            for child in s.children:
                if isinstance(child, Node) and child.data == "block":
                    self.block(child, scope, in_fn)
                elif isinstance(child, Node) and child.data == "if_":
                    self.block(Node("block", [child], child.meta), scope, in_fn)
                elif isinstance(child, Node) and child.data == "tensor_type":
                    self.types([child], scope)
                elif isinstance(child, Node):
                    self.expr(child, scope)

    def expr(self, tree: Node, scope: set[str]) -> None:
        if not isinstance(tree, Node):
            return
        if tree.data == "var" and str(tree.children[0]) not in scope:
            raise self.p.error(tree, f"unknown name '{tree.children[0]}'")
        if tree.data == "call":
            self.call(tree)
        for child in tree.children:
            if isinstance(child, Node) and child.data == "kwarg":
                self.expr(child.children[1], scope)
            elif isinstance(child, Node):
                self.expr(child, scope)

    def call(self, tree: Node) -> None:
        name, *args = (a for a in tree.children if a is not None)
        positional = sum(1 for a in args if not (isinstance(a, Node) and a.data == "kwarg"))
        keywords = [str(a.children[0]) for a in args if isinstance(a, Node) and a.data == "kwarg"]
        if str(name) in self.p.fns:
            params = [p for p in self.p.fns[str(name)].children[1:-2] if p is not None]
            lo = hi = len(params)
            allowed: tuple[str, ...] = ()
        elif str(name) in OPS:
            op = OPS[str(name)]
            lo = len(op.operands) + sum(1 for w in op.weights if not w.optional)
            hi = len(op.operands) + len(op.weights)
            allowed = tuple(a.name for a in op.attrs)
            for a in op.attrs:
                if a.default is REQUIRED and a.name not in keywords:
                    raise self.p.error(tree, f"{name} needs the attribute {a.name}")
        elif str(name) in BUILTINS:
            lo, hi, allowed = BUILTINS[str(name)]
        else:
            raise self.p.error(name, f"unknown function or op '{name}'")
        if not lo <= positional <= hi:
            takes = str(lo) if lo == hi else f"{lo} to {hi}"
            raise self.p.error(tree, f"{name} takes {takes} arguments, found {positional}")
        for k in keywords:
            if k not in allowed:
                raise self.p.error(tree, f"{name} has no argument {k}=")
