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
        assert isinstance(width, int), f"symbolic last dim in {self}"
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
    """Appends typed nodes; each method infers its output type from its operands."""

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

    def weight(self, name: str) -> Weight:
        if name not in self._weight_types:
            from dynalm.errors import ModelFormatError

            raise ModelFormatError(f"the model has no tensor '{name}'")
        return Weight(name, self._weight_types[name])

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
    def embed(self, ids: Value, table: str) -> Value:
        w = self.weight(table)
        return self._emit("embed", (ids.type.shape[0], w.type.shape[1]), (ids,), (w,))

    def rms_norm(self, x: Value, weight: str, eps: float) -> Value:
        return self._emit("rms_norm", x.type.shape, (x,), (self.weight(weight),), eps=eps)

    def head_rms_norm(self, x: Value, weight: str, eps: float, head_dim: int) -> Value:
        """RMSNorm over each head's slice of a ``[T, heads * head_dim]`` value (QK-norm)."""
        return self._emit(
            "head_rms_norm", x.type.shape, (x,), (self.weight(weight),), eps=eps, head_dim=head_dim
        )

    def matmul(self, x: Value, weight: str, bias: str | None = None) -> Value:
        w = self.weight(weight)
        weights = (w,) if bias is None else (w, self.weight(bias))
        return self._emit("matmul", (x.type.shape[0], w.type.shape[0]), (x,), weights)

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
        weights = () if freq_factors is None else (self.weight(freq_factors),)
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
        return self._emit("add", a.type.shape, (a, b))

    def mul(self, a: Value, b: Value) -> Value:
        return self._emit("mul", a.type.shape, (a, b))

    def scale(self, x: Value, factor: float) -> Value:
        return self._emit("scale", x.type.shape, (x,), factor=factor)

    def silu(self, x: Value) -> Value:
        return self._emit("silu", x.type.shape, (x,))

    def gelu_tanh(self, x: Value) -> Value:
        return self._emit("gelu_tanh", x.type.shape, (x,))

    def select_rows(self, x: Value, rows: Value) -> Value:
        """Keep the rows listed in ``rows`` (the last token of each sequence)."""
        return self._emit("select_rows", (rows.type.shape[0], x.type.shape[1]), (x, rows))
