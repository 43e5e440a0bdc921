"""Elaboration: a checked ``.lum`` program run against one model file's metadata and tensor
types, giving the DynaIR graph of its forward pass. No weight is read.

Values are numbers, booleans and strings (parameters, loop counters), tensors (graph values)
and weights (the file's tensors, typed with their stored dtype). Every op goes through the
op table (``dynalm.ir.ops``), every function argument and return value is matched against
its declared type, whose unbound names are type variables bound by the first use (a dtype
such as a weight's ``D``, or a dimension); a mismatch is reported at the expression with the
expected and the found type.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import numpy as np

from dynalm.errors import DynaError, show
from dynalm.ir.builder import GraphBuilder, check_weight_name, check_weight_shape
from dynalm.ir.graph import Graph, GraphError, TensorType, Value, Weight
from dynalm.ir.lumen.program import Program
from dynalm.ir.lumen.tree import LumenError, Node, Tok
from dynalm.ir.ops import OPS, WEIGHT_DTYPES, op_def

DTYPES = WEIGHT_DTYPES | {"f32", "i32"}
MAX_CALL_DEPTH = 64
# Elaboration's budget. A family file is a loop over the layers calling a few functions (a
# 128-layer llama: ~16k steps, ~2k nodes); a runaway program (a loop to 10**9, an exponential
# recursion) is stopped with an error at the expression where the budget ran out.
MAX_STEPS = 250_000  # expressions and blocks evaluated
MAX_ITERATIONS = 100_000  # loop iterations, all loops together
MAX_NODES = 100_000  # graph nodes built
MAX_SECONDS = 20.0
MAX_EVAL_DEPTH = 200  # nested evaluations (expressions, blocks, calls): ~3 frames each
MAX_INT = 2**63 - 1  # Lumen's ints are int64s, as GGUF's metadata integers
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Return(Exception):
    def __init__(self, value: Any):
        self.value = value


def describe(value: Any) -> str:
    """A value's type, as messages show it."""
    if isinstance(value, Value):
        return str(value.type)
    if isinstance(value, Weight):
        return f'weight "{value.name}": {value.type}'
    if value is None:
        return "none (an absent optional weight)"
    return type(value).__name__


def _metadata_scalar(key: str, value: Any) -> Any:
    """A metadata value as a Lumen scalar: a per-layer array of one integer is that integer."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and len(value):
        if (value != value[0]).any():
            raise DynaError(f"{key} varies per layer, which is not supported")
        return int(value[0])
    if type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
        return value
    raise DynaError(f"{key} holds {type(value).__name__}, not a number, boolean or string")


class Elaborator:
    def __init__(
        self,
        program: Program,
        arch: str,
        metadata: dict[str, Any],
        weight_types: dict[str, TensorType],
        given: dict[str, Any] | None = None,
    ):
        """``given``: the values of the names the program was checked to read beside its
        own (``Program.given``)."""
        given = given or {}
        missing = sorted(program.given - set(given))
        if missing:
            raise LumenError(f"{program.where}: {', '.join(missing)} not given")
        self.p = program
        self.metadata = metadata
        self.builder = GraphBuilder(arch, weight_types)
        self.globals: dict[str, Any] = {**given, "arch": arch}
        self.depth = 0  # calls
        self.nesting = 0  # evaluations
        self.steps = self.iterations = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    # -- the program ------------------------------------------------------------------
    def run(self) -> Graph:
        for param in self.p.params:
            name, kind, expr = param.children
            self.globals[str(name)] = self.scalar(kind, self.eval(expr, {}), param)
        for decl in self.p.inputs:
            name, t = decl.children
            dtype, shape = self.input_type(t)
            try:
                self.globals[str(name)] = self.builder.input(str(name), dtype, shape)
            except GraphError as err:
                raise self.p.error(t, str(err)) from None
        outputs: dict[str, Value] = {}
        self.block(self.p.forward.children[0], {}, outputs)
        if not outputs:
            raise self.p.error(self.p.forward, "forward gives no output")
        return self.builder.finish(**outputs)

    def scalar(self, kind: Tok, value: Any, node: Node) -> Any:
        """``value`` as the scalar type ``kind`` (an int is a float)."""
        want = {"int": int, "float": float, "bool": bool, "str": str}[str(kind)]
        if want is float and type(value) is int:
            return float(value)
        if type(value) is not want:
            raise self.p.error(node, f"expected {kind}, found {describe(value)} ({show(value)})")
        return value

    def input_type(self, t: Node) -> tuple[str, tuple]:
        """An input's declared type: a concrete dtype, dims numbers or symbols (T, S)."""
        dtype, *dims = t.children
        shape: list = []
        for d in (d for d in dims if d is not None):
            if isinstance(d, Node) and d.data == "var" and str(d.children[0]) not in self.globals:
                shape.append(str(d.children[0]))
            elif isinstance(d, Node):
                shape.append(self.int(self.eval(d, {}), d))
            else:
                raise self.p.error(d, "an input's dims are numbers or symbols, not ?")
        if str(dtype) not in DTYPES:
            raise self.p.error(t, f"an input's dtype is one of {', '.join(sorted(DTYPES))}")
        return str(dtype), tuple(shape)

    def matches(self, t: Node | Tok, value: Any, env: dict, bound: dict) -> bool:
        """Whether ``value`` has the declared type ``t``. A name the scope does not bind is
        a type variable: its first use binds it (in ``bound``), later uses must agree."""
        if isinstance(t, Tok):
            want = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,)}
            return type(value) in want[str(t)]
        if not isinstance(value, (Value, Weight)):
            return False
        dtype, *dims = t.children
        dims = [d for d in dims if d is not None]
        actual = value.type
        if len(dims) != len(actual.shape):
            return False
        for want, got in [(dtype, actual.dtype), *zip(dims, actual.shape, strict=True)]:
            if isinstance(want, Tok) and want.type == "ANY":
                continue
            name = str(want.children[0]) if isinstance(want, Node) and want.data == "var" else None
            if isinstance(want, Tok):  # the dtype
                name = None if str(want) in DTYPES else str(want)
                if name is None and str(want) != got:
                    return False
            if name is not None and name in bound:
                if bound[name] != got:
                    return False
            elif name is not None and name not in env and name not in self.globals:
                bound[name] = got
            elif isinstance(want, Node) and self.eval(want, env) != got:
                return False
        return True

    # -- statements -------------------------------------------------------------------
    def block(self, block: Node, env: dict, outputs: dict | None) -> None:
        self.enter(block)
        try:
            for s in block.children:
                self.statement(s, env, outputs)
        finally:
            self.nesting -= 1

    def enter(self, node: Node) -> None:
        """Count an evaluation against the budget (steps, nesting, time)."""
        self.steps += 1
        self.nesting += 1
        if self.nesting > MAX_EVAL_DEPTH:
            self.nesting -= 1
            raise self.p.error(node, f"evaluation nested deeper than {MAX_EVAL_DEPTH} levels")
        if self.steps > MAX_STEPS or (self.steps % 4096 == 0 and time.monotonic() > self.deadline):
            self.nesting -= 1
            raise self.p.error(
                node,
                f"elaboration ran past its budget ({MAX_STEPS} steps, {MAX_SECONDS:g} s): "
                "a runaway loop or recursion?",
            )

    def statement(self, s: Node, env: dict, outputs: dict | None) -> None:
        kind = s.data
        if kind == "let":
            name, *t, expr = s.children  # let NAME [: type] = expr
            t = t[0] if t else None
            value = self.eval(expr, env)
            if t is not None and not self.matches(t, value, env, {}):
                raise self.mismatch(expr, t, value, env)
            env[str(name)] = value
        elif kind == "for_":
            name, lo, hi, body = s.children
            start, stop = self.int(self.eval(lo, env), lo), self.int(self.eval(hi, env), hi)
            self.iterations += max(0, stop - start)
            if self.iterations > MAX_ITERATIONS:  # counted before the loop runs
                raise self.p.error(
                    s,
                    f"a loop of {stop - start} iterations: elaboration runs at most "
                    f"{MAX_ITERATIONS} loop iterations in all",
                )
            for i in range(start, stop):
                env[str(name)] = i
                self.block(body, env, outputs)
        elif kind == "if_":
            cond, then, other = s.children
            branch = then if self.bool(self.eval(cond, env), cond) else other
            if branch is not None:
                self.block(
                    branch if branch.data == "block" else Node("block", [branch], branch.meta),
                    env,
                    outputs,
                )
        elif kind == "return_":
            raise _Return(self.eval(s.children[0], env))
        else:  # output
            name, expr = s.children
            value = self.eval(expr, env)
            if not isinstance(value, Value):
                raise self.p.error(expr, f"an output is a tensor, found {describe(value)}")
            outputs[str(name)] = value

    def mismatch(self, expr: Node, t: Node | Tok, value: Any, env: dict) -> LumenError:
        want = str(t) if isinstance(t, Tok) else self.p.source(t)
        return self.p.error(
            expr, f"{self.p.source(expr)}: expected {want}, found {describe(value)}"
        )

    # -- expressions ------------------------------------------------------------------
    def lookup(self, name: str, env: dict, node: Node, missing: bool = False) -> Any:
        if name in env:
            return env[name]
        if name in self.globals:
            return self.globals[name]
        if missing:
            return None
        raise self.p.error(node, f"'{name}' is not bound here")

    def format(self, text: str, env: dict, node: Any) -> str:
        return _FIELD.sub(lambda m: str(self.lookup(m.group(1), env, node)), text)

    def int(self, value: Any, node: Any) -> int:
        if type(value) is not int:
            raise self.p.error(node, f"expected int, found {describe(value)}")
        return value

    def bool(self, value: Any, node: Any) -> bool:
        if type(value) is not bool:
            raise self.p.error(node, f"a condition is a bool, found {describe(value)}")
        return value

    def number(self, value: Any, node: Node) -> Any:
        """``value``, refused when a number leaves Lumen's range (int64, finite floats)."""
        if type(value) is int and not -MAX_INT <= value <= MAX_INT:
            raise self.p.error(node, f"an integer beyond the int64 range ({_digits(value)})")
        if type(value) is float and not math.isfinite(value):
            raise self.p.error(node, f"a float that is not finite ({value})")
        return value

    def eval(self, e: Node, env: dict) -> Any:
        self.enter(e)
        try:
            return self.evaluate(e, env)
        finally:
            self.nesting -= 1

    def evaluate(self, e: Node, env: dict) -> Any:
        kind = e.data
        if kind == "number":
            text = str(e.children[0])
            if any(c in text for c in ".eE"):
                return self.number(float(text), e)
            if len(text) > len(str(MAX_INT)):  # before int(): Python refuses 4,300 digits
                raise self.p.error(e, f"an integer beyond the int64 range ({len(text)} digits)")
            return self.number(int(text), e)
        if kind == "string":
            return self.format(str(e.children[0])[1:-1], env, e)
        if kind in ("true", "false"):
            return kind == "true"
        if kind == "var":
            return self.lookup(str(e.children[0]), env, e)
        if kind in ("weight", "shaped_weight"):
            return self.weight(e, env)
        if kind == "call":
            return self.call(e, env)
        if kind == "ifexpr":
            cond, then, other = e.children
            return self.eval(then if self.bool(self.eval(cond, env), cond) else other, env)
        if kind in ("and_", "or_"):
            left = self.bool(self.eval(e.children[0], env), e.children[0])
            if left == (kind == "or_"):
                return left
            return self.bool(self.eval(e.children[1], env), e.children[1])
        if kind == "not_":
            return not self.bool(self.eval(e.children[0], env), e.children[0])
        if kind == "neg":
            value = self.eval(e.children[0], env)
            if type(value) not in (int, float):
                raise self.p.error(e, f"cannot negate {describe(value)}")
            return self.number(-value, e)
        return self.binop(e, env)

    def weight(self, e: Node, env: dict) -> Weight | None:
        token, *dims = e.children
        optional = token.startswith("w?")
        name = self.format(str(token)[3 if optional else 2 : -1], env, e)
        try:
            check_weight_name(name)
            if optional and not self.builder.has_weight(name):
                return None
            w = self.builder.weight(name)
            if e.data == "shaped_weight":
                shape = [
                    None if isinstance(d, Tok) else self.int(self.eval(d, env), d) for d in dims
                ]
                w = check_weight_shape(w, tuple(shape))
        except GraphError as err:
            raise self.p.error(e, str(err)) from None
        except DynaError as err:
            raise type(err)(f"{self.p.where}:{e.meta.line}:{e.meta.column}: {err}") from None
        return w

    def binop(self, e: Node, env: dict) -> Any:
        left, op, right = e.children
        a, b = self.eval(left, env), self.eval(right, env)
        if isinstance(a, Value) or isinstance(b, Value):
            return self.tensor_binop(e, str(op), a, b)
        numbers = type(a) in (int, float) and type(b) in (int, float)
        same = type(a) is type(b) and type(a) in (bool, str)
        try:
            if op in ("==", "!=") and (numbers or same):
                return (a == b) == (op == "==")
            if numbers:
                return self.number(_ARITHMETIC[str(op)](a, b), e)
        except ZeroDivisionError:
            raise self.p.error(e, f"{self.p.source(e)}: division by zero") from None
        except OverflowError:  # a float too large for the operation (1e308 * 1e308 is inf)
            raise self.p.error(e, f"{self.p.source(e)}: a float overflow") from None
        raise self.p.error(e, f"cannot apply '{op}' to {describe(a)} and {describe(b)}")

    def tensor_binop(self, e: Node, op: str, a: Any, b: Any) -> Value:
        """``a + b`` is the op add, ``a * b`` mul, ``a * number`` scale."""
        if op == "*" and isinstance(a, Value) and type(b) in (int, float):
            return self.emit(e, "scale", [a], [], {"factor": float(b)})
        if op in ("+", "*") and isinstance(a, Value) and isinstance(b, Value):
            return self.emit(e, "add" if op == "+" else "mul", [a, b], [], {})
        raise self.p.error(e, f"cannot apply '{op}' to {describe(a)} and {describe(b)}")

    # -- calls --------------------------------------------------------------------------
    def call(self, e: Node, env: dict) -> Any:
        name, *args = (a for a in e.children if a is not None)
        positional = [self.eval(a, env) for a in args if a.data != "kwarg"]
        keywords = {str(a.children[0]): a.children[1] for a in args if a.data == "kwarg"}
        if str(name) in self.p.fns:
            return self.call_fn(e, self.p.fns[str(name)], positional)
        if str(name) in OPS:
            values = {k: self.eval(v, env) for k, v in keywords.items()}
            return self.call_op(e, str(name), positional, values)
        return self.builtin(e, str(name), positional, keywords, env)

    def call_fn(self, e: Node, fn: Node, args: list[Any]) -> Any:
        name, *params, ret, body = fn.children
        params = [p for p in params if p is not None]
        if len(args) != len(params):
            raise self.p.error(e, f"{name} takes {len(params)} arguments, found {len(args)}")
        if self.depth >= MAX_CALL_DEPTH:
            raise self.p.error(e, f"calls nested deeper than {MAX_CALL_DEPTH}")
        env: dict[str, Any] = {}
        bound: dict[str, Any] = {}  # the type variables of this call
        for param, value in zip(params, args, strict=True):
            pname, t = param.children
            if not self.matches(t, value, env, bound):
                raise self.p.error(
                    e,
                    f"{self.p.source(e)}: argument {pname} of {name}: expected "
                    f"{self.p.source(t) if isinstance(t, Node) else t}, found {describe(value)}",
                )
            env[str(pname)] = float(value) if str(t) == "float" else value
        env.update(bound)  # a function may read the dims and dtypes its arguments bound
        self.depth += 1
        try:
            self.block(body, env, None)
        except _Return as r:
            result = r.value
        else:
            raise self.p.error(fn, f"function {name} ended without a return")
        finally:
            self.depth -= 1
        if not self.matches(ret, result, env, bound):
            raise self.p.error(
                e,
                f"{self.p.source(e)}: {name} returns {describe(result)}, declared "
                f"{self.p.source(ret) if isinstance(ret, Node) else ret}",
            )
        return result

    def call_op(self, e: Node, name: str, args: list[Any], attrs: dict[str, Any]) -> Value:
        op = op_def(name)
        values, weights = args[: len(op.operands)], args[len(op.operands) :]
        for operand, v in zip(op.operands, values, strict=False):
            if not isinstance(v, Value):
                raise self.p.error(
                    e,
                    f"{self.p.source(e)}: operand {operand.name} of {name} is a tensor value, "
                    f"found {describe(v)}",
                )
        for slot, w in zip(op.weights, weights, strict=False):
            if w is not None and not isinstance(w, Weight):
                raise self.p.error(
                    e,
                    f"{self.p.source(e)}: {slot.name} of {name} is a weight of the model "
                    f"file, found {describe(w)}",
                )
        return self.emit(e, name, values, weights, attrs)

    def emit(self, e: Node, name: str, values: list, weights: list, attrs: dict) -> Value:
        if len(self.builder.nodes) >= MAX_NODES:
            raise self.p.error(e, f"a graph of more than {MAX_NODES} nodes")
        try:
            return self.builder.op(name, *values, weights=tuple(weights), **attrs)
        except GraphError as err:
            raise self.p.error(e, f"{self.p.source(e)}: {err}") from None

    def builtin(
        self, e: Node, name: str, args: list[Any], keywords: dict[str, Node], env: dict
    ) -> Any:
        (arg,) = args
        if name == "sqrt":
            if type(arg) not in (int, float) or arg < 0:
                raise self.p.error(e, f"sqrt of {describe(arg)} {show(arg)}")
            return math.sqrt(arg)
        if name == "has":
            if type(arg) is not str:
                raise self.p.error(e, f"has takes a tensor name, found {describe(arg)}")
            try:
                check_weight_name(arg)
            except GraphError as err:
                raise self.p.error(e, str(err)) from None
            return self.builder.has_weight(arg)
        if name == "rows":
            if not isinstance(arg, Weight):
                raise self.p.error(e, f"rows takes a weight, found {describe(arg)}")
            return int(arg.type.shape[0])
        # gguf(key, default = ...): the default is evaluated only when the key is absent
        if type(arg) is not str:
            raise self.p.error(e, f"gguf takes a metadata key, found {describe(arg)}")
        if arg in self.metadata:
            try:
                value = _metadata_scalar(arg, self.metadata[arg])
            except DynaError as err:
                raise self.p.error(e, str(err)) from None
            return self.number(value, e)
        if "default" in keywords:
            return self.eval(keywords["default"], env)
        raise self.p.error(e, f"the model's metadata has no {arg} and gguf() has no default")


def _digits(value: int) -> str:
    """A huge int's size, for a message (``str`` refuses more than 4,300 digits)."""
    return f"about 2**{value.bit_length() - 1}" if abs(value) > MAX_INT else str(value)


_ARITHMETIC = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
}
