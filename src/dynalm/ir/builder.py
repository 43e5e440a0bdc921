"""Building DynaIR graphs: typed nodes appended through the op table's rules."""

from __future__ import annotations

import re
from typing import Any

from dynalm.errors import ModelFormatError, show
from dynalm.ir.graph import Dim, Graph, GraphError, Node, TensorType, Value, Weight
from dynalm.ir.ops import check_attrs, infer, op_def


def check_weight_shape(w: Weight, shape: tuple[Dim | None, ...]) -> Weight:
    """A model tensor must have ``shape`` (None: any size on that axis), so that a file whose
    tensors disagree with its hyper-parameters is refused before any kernel is bound. A
    tensor of fewer dimensions is read as ggml reads it, the outer ones it lacks being 1
    where ``shape`` allows it (converters that squeeze write a one-label classifier's
    ``[1, d]`` as ``[d]``): the weight returned is then of ``shape``'s rank."""
    actual = w.type.shape
    missing = len(shape) - len(actual)
    if missing > 0 and all(d in (None, 1) for d in shape[:missing]):
        actual = (1,) * missing + tuple(actual)
        w = Weight(w.name, TensorType(w.type.dtype, actual))
    fits = len(actual) == len(shape)
    if not fits or any(e not in (None, a) for e, a in zip(shape, actual, strict=True)):
        expected = ", ".join("?" if d is None else str(d) for d in shape)
        raise ModelFormatError(
            f"tensor '{w.name}' has shape [{', '.join(map(str, actual))}], expected [{expected}]"
        )
    return w


MAX_DIM = 2**31 - 1  # kernels index rows and columns with int32
MAX_NAME = 256


def check_weight_name(name: str) -> None:
    """A tensor name is dot-separated parts, none empty, of printable characters without
    spaces or path separators: "blk..weight", ".x" or "../x" is a program's mistake."""
    parts = name.split(".")
    if len(name) > MAX_NAME or not all(p.isprintable() and _NAME_PART.fullmatch(p) for p in parts):
        raise GraphError(
            f"{show(name)} is not a tensor name (dot-separated parts, none empty, no spaces, "
            f"'/' or '\\', at most {MAX_NAME} characters)"
        )


_NAME_PART = re.compile(r"[^\s./\\]+")


def check_input_shape(name: str, shape: tuple[Dim, ...]) -> None:
    for d in shape:
        if isinstance(d, int) and not 1 <= d <= MAX_DIM:
            raise GraphError(f"input {name} has a dimension {d}, not in [1, {MAX_DIM}]")


class GraphBuilder:
    """Appends nodes whose result types the op table infers from their operands, so a
    wrong operand, attribute or weight is refused where the node is built."""

    def __init__(self, name: str, weight_types: dict[str, TensorType]):
        self.name = name
        self._weight_types = weight_types
        self._next_id = 0
        self.inputs: dict[str, Value] = {}
        self.nodes: list[Node] = []

    def input(self, name: str, dtype: str, shape: tuple[Dim, ...]) -> Value:
        check_input_shape(name, shape)
        value = Value(self._next_id, TensorType(dtype, shape))
        self._next_id += 1
        self.inputs[name] = value
        return value

    def weight(self, name: str, *shape: Dim | None) -> Weight:
        """The model's tensor ``name``; with ``shape``, checked to have it."""
        check_weight_name(name)
        if name not in self._weight_types:
            raise ModelFormatError(f"the model has no tensor '{name}'")
        w = Weight(name, self._weight_types[name])
        return check_weight_shape(w, shape) if shape else w

    def has_weight(self, name: str) -> bool:
        return name in self._weight_types

    def op(
        self, name: str, *args: Value, weights: tuple[Weight | None, ...] = (), **attrs: Any
    ) -> Value:
        """Append ``name(args; weights; attrs)`` (an absent optional weight is None)."""
        op = op_def(name)
        attrs = check_attrs(op, attrs)
        result = infer(op, [a.type for a in args], [w and w.type for w in weights], attrs)
        out = Value(self._next_id, result)
        self._next_id += 1
        present = tuple(w for w in weights if w is not None)
        self.nodes.append(Node(name, out, tuple(args), present, attrs))
        return out

    def finish(self, **outputs: Value) -> Graph:
        return Graph(self.name, dict(self.inputs), list(self.nodes), outputs)
