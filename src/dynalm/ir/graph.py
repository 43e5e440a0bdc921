"""DynaIR: the forward pass as an SSA graph of typed tensors.

Every value has a type ``tensor<dtype, [dims]>``; a dim is a number or a symbol
(``T`` = tokens in the step, ``S`` = sequences that need logits). Weights are
typed with their stored (possibly quantised) dtype, so a graph prints as

    %8: tensor<f32, [T, 576]> = matmul %7, @"blk.0.attn_q.weight": tensor<q4_1, [576, 576]>

Graphs are built by the Lumen elaborator (``dynalm.ir.lumen``) from a family's ``.lum`` file
through :class:`dynalm.ir.builder.GraphBuilder`; the ops are defined in ``dynalm.ir.ops``;
``dynalm.ir.text`` prints and parses them; passes rewrite them; the executor runs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Dim = int | str


class GraphError(ValueError):
    """A graph that breaks SSA or typing rules (a bug in a builder or a pass); ``node``: the
    index of the node at fault, when one is."""

    def __init__(self, message: str, node: int | None = None):
        super().__init__(message)
        self.node = node


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"tensor<{self.dtype}, [{', '.join(str(d) for d in self.shape)}]>"

    @property
    def row_width(self) -> int:
        """Elements per row of a ``[T, w]`` activation (the planner's size class)."""
        width = self.shape[-1]
        if not isinstance(width, int):
            raise GraphError(f"symbolic last dim in {self}")
        return width


@dataclass(frozen=True)
class Weight:
    name: str
    type: TensorType

    def __str__(self) -> str:
        return f'@"{self.name}": {self.type}'


@dataclass(frozen=True)
class Value:
    id: int
    type: TensorType

    def __str__(self) -> str:
        return f"%{self.id}"


@dataclass(frozen=True)
class Node:
    """One operation: ``out = op(args..., weights...; attrs)``."""

    op: str
    out: Value
    args: tuple[Value, ...]
    weights: tuple[Weight, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Graph:
    """A forward pass: named inputs, nodes in execution order, named outputs."""

    name: str
    inputs: dict[str, Value]
    nodes: list[Node]
    outputs: dict[str, Value]

    def weights(self) -> Iterator[Weight]:
        seen: set[str] = set()
        for node in self.nodes:
            for w in node.weights:
                if w.name not in seen:
                    seen.add(w.name)
                    yield w
