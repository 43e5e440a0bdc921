"""DynaIR: the forward pass as an SSA graph of typed tensors.

Every value has a type ``tensor<dtype, [dims]>``; a dim is a number or a symbol
(``T`` = tokens in the step, ``S`` = sequences that need logits). Weights are
typed with their stored (possibly quantised) dtype, so a graph prints as

    %8: tensor<f32, [T, 576]> = matmul %7, @"blk.0.attn_q.weight": tensor<q4_1, [576, 576]>

Graphs are built by the architecture builders in ``dynalm.models.arch`` with
:class:`GraphBuilder`; passes rewrite them; the executor runs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Dim = int | str


class GraphError(ValueError):
    """A graph that breaks SSA or typing rules (a bug in a builder or a pass)."""


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

    def __str__(self) -> str:
        operands = [str(a) for a in self.args] + [str(w) for w in self.weights]
        attrs = "".join(f", {k}={v!r}" for k, v in self.attrs.items())
        return f"{self.out}: {self.out.type} = {self.op} {', '.join(operands)}{attrs}"


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

    def __str__(self) -> str:
        ins = ", ".join(f"{k}: {v} {v.type}" for k, v in self.inputs.items())
        outs = ", ".join(f"{k}: {v}" for k, v in self.outputs.items())
        body = "\n".join(f"  {n}" for n in self.nodes)
        return f"graph @{self.name}({ins}) {{\n{body}\n  return {outs}\n}}"


class GraphBuilder:
    """Appends typed nodes; each method infers its output type from its operands and checks
    the weights it is given against them, so that a model file whose tensors disagree with
    its hyper-parameters is refused here, before any kernel is bound to the shapes."""

    def __init__(self, name: str, weight_types: dict[str, TensorType]):
        self.name = name
        self._weight_types = weight_types
        self._next_id = 0
        self.inputs: dict[str, Value] = {}
        self.nodes: list[Node] = []

    # -- values -----------------------------------------------------------------
    def _value(self, dtype: str, shape: tuple[Dim, ...]) -> Value:
        value = Value(self._next_id, TensorType(dtype, shape))
        self._next_id += 1
        return value

    def input(self, name: str, dtype: str, shape: tuple[Dim, ...]) -> Value:
        value = self._value(dtype, shape)
        self.inputs[name] = value
        return value

    def weight(self, name: str, *shape: Dim | None) -> Weight:
        """The weight ``name``, which must have ``shape`` (None: any size on that axis)."""
        from dynalm.errors import ModelFormatError

        if name not in self._weight_types:
            raise ModelFormatError(f"the model has no tensor '{name}'")
        w = Weight(name, self._weight_types[name])
        actual = w.type.shape
        fits = len(actual) == len(shape)
        if not fits or any(e not in (None, a) for e, a in zip(shape, actual, strict=True)):
            expected = ", ".join("?" if d is None else str(d) for d in shape)
            raise ModelFormatError(
                f"tensor '{name}' has shape [{', '.join(map(str, actual))}], expected [{expected}]"
            )
        return w

    def has_weight(self, name: str) -> bool:
        return name in self._weight_types

    def _emit(
        self,
        op: str,
        shape: tuple[Dim, ...],
        args: tuple[Value, ...],
        weights: tuple[Weight, ...] = (),
        **attrs: Any,
    ) -> Value:
        out = self._value("f32", shape)
        self.nodes.append(Node(op, out, args, weights, attrs))
        return out

    def finish(self, **outputs: Value) -> Graph:
        return Graph(self.name, dict(self.inputs), list(self.nodes), outputs)

    # -- operations ---------------------------------------------------------------
    def embed(self, ids: Value, table: str, rows: int | None = None) -> Value:
        w = self.weight(table, rows, None)
        return self._emit("embed", (ids.type.shape[0], w.type.shape[1]), (ids,), (w,))

    def rms_norm(self, x: Value, weight: str, eps: float) -> Value:
        w = self.weight(weight, x.type.row_width)
        return self._emit("rms_norm", x.type.shape, (x,), (w,), eps=eps)

    def head_rms_norm(self, x: Value, weight: str, eps: float, head_dim: int) -> Value:
        """RMSNorm over each head's slice of a ``[T, heads * head_dim]`` value (QK-norm)."""
        self._heads(x, head_dim)
        w = self.weight(weight, head_dim)
        return self._emit("head_rms_norm", x.type.shape, (x,), (w,), eps=eps, head_dim=head_dim)

    def matmul(
        self, x: Value, weight: str, bias: str | None = None, rows: int | None = None
    ) -> Value:
        """``x @ W^T`` for a weight ``[rows, width of x]`` (any rows when None)."""
        w = self.weight(weight, rows, x.type.row_width)
        n = w.type.shape[0]
        weights = (w,) if bias is None else (w, self.weight(bias, n))
        return self._emit("matmul", (x.type.shape[0], n), (x,), weights)

    @staticmethod
    def _heads(x: Value, head_dim: int, heads: int | None = None) -> None:
        width = x.type.row_width
        if head_dim < 1 or width % head_dim or (heads is not None and width != heads * head_dim):
            n = "whole heads" if heads is None else f"{heads} heads"
            raise GraphError(f"{x.type} is not {n} of {head_dim}")

    def rope(
        self,
        x: Value,
        positions: Value,
        *,
        head_dim: int,
        rope_dim: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: str | None = None,
    ) -> Value:
        self._heads(x, head_dim)
        if not (2 <= rope_dim <= head_dim and rope_dim % 2 == 0):
            raise GraphError(f"rope over {rope_dim} of {head_dim} dimensions")
        weights = () if freq_factors is None else (self.weight(freq_factors, rope_dim // 2),)
        return self._emit(
            "rope",
            x.type.shape,
            (x, positions),
            weights,
            head_dim=head_dim,
            rope_dim=rope_dim,
            base=base,
            neox=neox,
            scale=scale,
        )

    def attention(
        self,
        q: Value,
        k: Value,
        v: Value,
        *,
        layer: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int = 0,
    ) -> Value:
        """Writes this step's k/v into the layer's KV pages, then attends causally."""
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise GraphError(f"{n_heads} heads cannot share {n_kv_heads} kv heads")
        self._heads(q, head_dim, n_heads)
        self._heads(k, head_dim, n_kv_heads)
        self._heads(v, head_dim, n_kv_heads)
        return self._emit(
            "attention",
            (q.type.shape[0], n_heads * head_dim),
            (q, k, v),
            layer=layer,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            scale=scale,
            window=window,
        )

    def add(self, a: Value, b: Value) -> Value:
        return self._emit("add", self._same(a, b), (a, b))

    def mul(self, a: Value, b: Value) -> Value:
        return self._emit("mul", self._same(a, b), (a, b))

    @staticmethod
    def _same(a: Value, b: Value) -> tuple[Dim, ...]:
        if a.type.shape != b.type.shape:
            raise GraphError(f"element-wise operands {a.type} and {b.type} differ")
        return a.type.shape

    def scale(self, x: Value, factor: float) -> Value:
        return self._emit("scale", x.type.shape, (x,), factor=factor)

    def silu(self, x: Value) -> Value:
        return self._emit("silu", x.type.shape, (x,))

    def gelu_tanh(self, x: Value) -> Value:
        return self._emit("gelu_tanh", x.type.shape, (x,))

    def select_rows(self, x: Value, rows: Value) -> Value:
        """Keep the rows listed in ``rows`` (the last token of each sequence)."""
        return self._emit("select_rows", (rows.type.shape[0], x.type.shape[1]), (x, rows))
