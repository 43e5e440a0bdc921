"""Rewrite passes over DynaIR graphs, each a named function checked by the verifier.

The architecture builders stay declarative (one op per line of the model's math);
the passes turn that graph into fewer, fused ops for the executor:

* ``merge-matmuls``: matmuls that read the same value with weights of one dtype and
  input width (q/k/v of a layer, gate/up) -> one ``matmul`` over the row-concatenated
  weight (named ``<first part> (merged)``, its parts in ``attrs["parts"]``) and a
  ``split`` per original output (a copy of its column range, ``attrs["start"]``), so
  consumers are unchanged and the activations are quantised once;
* ``fuse-gated``: ``mul(silu(g), u)`` -> ``swiglu(g, u)`` and
  ``mul(gelu_tanh(g), u)`` -> ``geglu(g, u)`` (one kernel, no intermediate);
* ``fuse-residual``: ``add(x, matmul(h, W))`` -> ``matmul_add(h, x, W)``, the residual
  added into the matmul's output buffer (one executor step instead of two);
* ``view-splits``: a ``split`` read only by operands that take strided rows
  (``VIEW_OPERANDS``: rope's input, attention's q/k/v) becomes a view of its source's
  columns (``attrs["view"]``), so q/k/v are never copied out of the merged matmul.

A pass returns a new graph and never mutates its input. :func:`verify` runs before the
first pass and after every pass, so a broken rewrite is reported by name.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable

from dynalm.core.quant import QUANT_FORMATS
from dynalm.ir.graph import Graph, GraphError, Node, TensorType, Value, Weight
from dynalm.ir.ops import OPS, check_attrs, infer, op_def

# Merge only matmuls this small: for them the per-call cost (dispatch, re-quantising the
# input) is a large share; large ones gain nothing and, batched, measured slower merged.
MERGE_MAX_BYTES = 256 * 1024
_BYTES_PER_BLOCK = {f.name: (f.block_size, f.type_size) for f in QUANT_FORMATS.values()}


def _weight_bytes(w: Weight) -> int:
    block, size = _BYTES_PER_BLOCK[w.type.dtype]
    n_rows, n_cols = w.type.shape
    return int(n_rows) * int(n_cols) // block * size


# Operands whose kernels read rows at any stride, so they may be views of a wider value.
VIEW_OPERANDS = {
    op.name: tuple(i for i, x in enumerate(op.operands) if x.strided) for op in OPS.values()
}
_GATES = {op.gate: op.name for op in OPS.values() if op.gate}  # silu -> swiglu, ...


def verify(graph: Graph) -> None:
    """SSA (each value defined once, before use), every node typed as the op table's rules
    give for its operands and attributes, views read only where ``VIEW_OPERANDS`` allows."""
    defined = {v.id for v in graph.inputs.values()}
    views = {n.out.id for n in graph.nodes if n.attrs.get("view") is True}
    if len(defined) != len(graph.inputs):
        raise GraphError("two graph inputs share a value")
    for i, node in enumerate(graph.nodes):
        where = f"node {i} ({node.op} -> {node.out})"
        try:
            op = op_def(node.op)
            if check_attrs(op, node.attrs) != node.attrs:
                raise GraphError(f"attributes {node.attrs} lack their defaults")
            result = infer(
                op, [a.type for a in node.args], [w.type for w in node.weights], node.attrs
            )
        except GraphError as e:
            raise GraphError(f"{where}: {e}", i) from None
        if result != node.out.type:
            raise GraphError(f"{where}: the op gives {result}, the node says {node.out.type}", i)
        for j, arg in enumerate(node.args):
            if arg.id not in defined:
                raise GraphError(f"{where}: uses {arg} before it is defined", i)
            if arg.id in views and j not in VIEW_OPERANDS[node.op]:
                raise GraphError(f"{where}: operand {j} cannot be the view {arg}", i)
        if node.out.id in defined:
            raise GraphError(f"{where}: {node.out} is defined twice", i)
        defined.add(node.out.id)
    for name, out in graph.outputs.items():
        if out.id not in defined:
            raise GraphError(f"output {name!r} ({out}) is never defined")
        if out.id in views:
            raise GraphError(f"output {name!r} ({out}) is a view")


def _uses(graph: Graph) -> Counter[int]:
    """How often each value is read (graph outputs count as reads)."""
    uses = Counter(a.id for node in graph.nodes for a in node.args)
    uses.update(v.id for v in graph.outputs.values())
    return uses


def _fuse_pairs(
    graph: Graph, match: Callable[[Node, dict[int, Node]], tuple[Node, Node] | None]
) -> Graph:
    """Replace each ``(producer, consumer)`` pair found by ``match`` with the fused node it
    returns: the producer is dropped and the fused node takes the consumer's place, where
    all operands of both are already defined. ``match`` only sees producers whose value
    is read once (by that consumer), so dropping them is safe."""
    uses = _uses(graph)
    producers = {n.out.id: n for n in graph.nodes if uses[n.out.id] == 1}
    dropped: set[int] = set()
    nodes: list[Node] = []
    for node in graph.nodes:
        found = match(node, producers)
        if found is None:
            nodes.append(node)
            continue
        producer, fused = found
        dropped.add(producer.out.id)
        nodes.append(fused)
    nodes = [n for n in nodes if n.out.id not in dropped]
    return Graph(graph.name, dict(graph.inputs), nodes, dict(graph.outputs))


def fuse_gated(graph: Graph) -> Graph:
    """``mul(act(g), u)`` -> ``swiglu(g, u)`` / ``geglu(g, u)``."""

    def match(node: Node, producers: dict[int, Node]) -> tuple[Node, Node] | None:
        if node.op != "mul":
            return None
        for act, other in (node.args, node.args[::-1]):
            p = producers.get(act.id)
            if p is not None and p.op in _GATES:
                return p, Node(_GATES[p.op], node.out, (p.args[0], other))
        return None

    return _fuse_pairs(graph, match)


def fuse_residual(graph: Graph) -> Graph:
    """``add(x, matmul(h, W))`` -> ``matmul_add(h, x, W)`` (= ``h @ W^T [+ bias] + x``)."""

    def match(node: Node, producers: dict[int, Node]) -> tuple[Node, Node] | None:
        if node.op != "add":
            return None
        for residual, branch in (node.args, node.args[::-1]):
            p = producers.get(branch.id)
            if p is not None and p.op == "matmul":
                return p, Node("matmul_add", node.out, (p.args[0], residual), p.weights)
        return None

    return _fuse_pairs(graph, match)


def _merged_weight(parts: list[Weight]) -> Weight:
    """``parts`` stacked by rows: ``[sum N, K]`` (or ``[sum N]`` for biases)."""
    first = parts[0].type
    rows = sum(int(w.type.shape[0]) for w in parts)
    # blk.0.attn_{q,k,v}.weight -> blk.0.attn_qkv.weight; ffn_{gate,up} -> ffn_gate_up
    found = [re.fullmatch(r"(.*\.[a-z]+_)([a-z]+)(\..*)", w.name) for w in parts]
    if all(found) and len({(m.group(1), m.group(3)) for m in found}) == 1:
        names = [m.group(2) for m in found]
        joined = "".join(names) if all(len(n) == 1 for n in names) else "_".join(names)
        stem = f"{found[0].group(1)}{joined}{found[0].group(3)}"
    else:
        stem = "+".join(w.name for w in parts)
    return Weight(f"{stem} (merged)", TensorType(first.dtype, (rows, *first.shape[1:])))


def merge_matmuls(graph: Graph) -> Graph:
    """Small matmuls (weights under ``MERGE_MAX_BYTES``: q/k/v of a layer) reading one
    value, with weights of the same dtype and input width (and all or none biased, biases
    of one dtype), become one matmul over the stacked weight and a ``split`` per original
    output. The merged node stands where the group's first matmul was (its input is
    defined there), the splits right after it."""
    groups: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.op != "matmul" or _weight_bytes(node.weights[0]) > MERGE_MAX_BYTES:
            continue
        w = node.weights[0]
        bias = node.weights[1].type.dtype if len(node.weights) > 1 else None
        key = (node.args[0].id, w.type.dtype, w.type.shape[1:], bias)
        groups.setdefault(key, []).append(node)
    next_id = 1 + max(
        [v.id for v in graph.inputs.values()] + [n.out.id for n in graph.nodes], default=-1
    )
    replace: dict[int, list[Node]] = {}  # first matmul's out id -> merged matmul + splits
    dropped: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        weight = _merged_weight([n.weights[0] for n in members])
        weights = (weight,)
        attrs: dict = {"parts": tuple(n.weights[0].name for n in members)}
        if len(members[0].weights) > 1:
            weights += (_merged_weight([n.weights[1] for n in members]),)
            attrs["bias_parts"] = tuple(n.weights[1].name for n in members)
        x = members[0].args[0]
        merged = Value(next_id, TensorType("f32", (x.type.shape[0], weight.type.shape[0])))
        next_id += 1
        new = [Node("matmul", merged, (x,), weights, attrs)]
        start = 0
        for n in members:
            width = n.out.type.row_width
            new.append(Node("split", n.out, (merged,), attrs={"start": start, "width": width}))
            start += width
        replace[members[0].out.id] = new
        dropped.update(n.out.id for n in members[1:])
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.out.id in dropped:
            continue
        nodes.extend(replace.get(node.out.id, [node]))
    return Graph(graph.name, dict(graph.inputs), nodes, dict(graph.outputs))


def view_splits(graph: Graph) -> Graph:
    """Mark the splits whose every reader takes views (and that are no graph output)."""
    copies = {v.id for v in graph.outputs.values()}  # values that must own their rows
    for node in graph.nodes:
        for i, arg in enumerate(node.args):
            if i not in VIEW_OPERANDS[node.op]:
                copies.add(arg.id)
    nodes = [
        dataclasses.replace(n, attrs={**n.attrs, "view": True})
        if OPS[n.op].view and n.out.id not in copies
        else n
        for n in graph.nodes
    ]
    return Graph(graph.name, dict(graph.inputs), nodes, dict(graph.outputs))


INPUT_PERM = ".input_perm"  # ``X.input_perm``: the column order of ``X.weight``'s input


def gather_permuted_inputs(graph: Graph, weights: dict[str, TensorType]) -> Graph:
    """Before each matmul whose weight ``X.weight`` has an ``X.input_perm`` among
    ``weights`` (its input columns were permuted at load: GPTQ act-order), a
    ``gather_cols`` of its input by that index: ``x[:, perm] @ W[:, perm]^T = x @ W^T``.
    Runs on the built graph, before ``optimize`` (a gathered input is a value of its own,
    so matmuls that read it are not merged with those reading the ungathered one)."""
    next_id = 1 + max(
        [v.id for v in graph.inputs.values()] + [n.out.id for n in graph.nodes], default=0
    )
    nodes: list[Node] = []
    for node in graph.nodes:
        name = node.weights[0].name if node.weights else ""
        perm = name.removesuffix(".weight") + INPUT_PERM
        if node.op == "matmul" and name.endswith(".weight") and perm in weights:
            x = node.args[0]
            gathered = Value(next_id, x.type)
            next_id += 1
            nodes.append(Node("gather_cols", gathered, (x,), (Weight(perm, weights[perm]),)))
            node = dataclasses.replace(node, args=(gathered, *node.args[1:]))
        nodes.append(node)
    return Graph(graph.name, dict(graph.inputs), nodes, dict(graph.outputs))


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph], Graph]


OPTIMIZE = (
    Pass("merge-matmuls", merge_matmuls),
    Pass("fuse-gated", fuse_gated),
    Pass("fuse-residual", fuse_residual),
    Pass("view-splits", view_splits),
)


def optimize(graph: Graph, passes: tuple[Pass, ...] = OPTIMIZE) -> Graph:
    """Run ``passes`` in order, verifying the input and every pass's result."""
    verify(graph)
    for p in passes:
        graph = p.run(graph)
        try:
            verify(graph)
        except GraphError as e:
            raise GraphError(f"after pass {p.name}: {e}") from None
    return graph
