"""DynaIR rewrite passes on a small hand-built graph, and the verifier that guards them."""

from __future__ import annotations

import dataclasses

import pytest

from dynalm.ir.graph import Graph, GraphBuilder, Node, TensorType
from dynalm.ir.passes import GraphError, Pass, fuse_gated, fuse_residual, optimize, verify

D, F = 8, 24  # model and FFN widths


def ffn_block(activation: str = "silu", extra_use: bool = False) -> Graph:
    """embed -> norm -> gated FFN -> residual add (-> optionally a second use of act)."""
    weights = {
        "embd": TensorType("f32", (50, D)),
        "norm": TensorType("f32", (D,)),
        "gate": TensorType("q4_1", (F, D)),
        "up": TensorType("q4_1", (F, D)),
        "down": TensorType("q4_1", (D, F)),
    }
    g = GraphBuilder("block", weights)
    x = g.embed(g.input("tokens", "i32", ("T",)), "embd")
    h = g.rms_norm(x, "norm", 1e-5)
    gate = g.matmul(h, "gate")
    act = g.silu(gate) if activation == "silu" else g.gelu_tanh(gate)
    f = g.matmul(g.mul(act, g.matmul(h, "up")), "down")
    out = g.add(x, f)
    if extra_use:
        return g.finish(out=out, act=act)
    return g.finish(out=out)


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


@pytest.mark.parametrize(("activation", "fused"), [("silu", "swiglu"), ("gelu_tanh", "geglu")])
def test_gated_activation_and_mul_become_one_op(activation: str, fused: str):
    graph = ffn_block(activation)
    out = fuse_gated(graph)
    verify(out)
    assert ops(out) == ["embed", "rms_norm", "matmul", "matmul", fused, "matmul", "add"]
    node = out.nodes[4]
    gate_matmul, up_matmul = out.nodes[2], out.nodes[3]
    assert node.args == (gate_matmul.out, up_matmul.out)  # (gate, up), in that order
    assert ops(graph).count("mul") == 1  # the input graph is untouched


def test_residual_add_folds_into_the_matmul():
    out = fuse_residual(ffn_block())
    verify(out)
    assert ops(out)[-1] == "matmul_add" and "add" not in ops(out)
    node = out.nodes[-1]
    embed, mul = out.nodes[0], out.nodes[-2]
    assert node.args == (mul.out, embed.out) and node.weights[0].name == "down"
    assert out.outputs["out"] == node.out


def test_a_value_read_twice_is_not_fused_away():
    out = optimize(ffn_block(extra_use=True))
    assert "silu" in ops(out) and "mul" in ops(out)  # act is also a graph output
    assert "matmul_add" in ops(out)


def test_optimize_runs_all_passes():
    assert ops(optimize(ffn_block())) == [
        "embed",
        "rms_norm",
        "matmul",
        "matmul",
        "swiglu",
        "matmul_add",
    ]


def test_verifier_catches_use_before_definition():
    graph = ffn_block()
    nodes = list(graph.nodes)
    nodes[1], nodes[2] = nodes[2], nodes[1]  # the gate matmul now reads h before rms_norm
    with pytest.raises(GraphError, match="before it is defined"):
        verify(dataclasses.replace(graph, nodes=nodes))


def test_verifier_catches_shape_and_arity_errors():
    graph = ffn_block()
    embed, norm = graph.nodes[0], graph.nodes[1]
    bad_add = Node("add", graph.nodes[-1].out, (embed.out, graph.nodes[2].out))  # [T,8]+[T,24]
    with pytest.raises(GraphError, match="do not match"):
        verify(dataclasses.replace(graph, nodes=[*graph.nodes[:-1], bad_add]))
    unary_mul = Node("mul", graph.nodes[-1].out, (embed.out,))
    with pytest.raises(GraphError, match="operands, expected 2"):
        verify(dataclasses.replace(graph, nodes=[*graph.nodes[:-1], unary_mul]))
    twice = Node("rms_norm", norm.out, (embed.out,), norm.weights, norm.attrs)
    with pytest.raises(GraphError, match="defined twice"):
        verify(dataclasses.replace(graph, nodes=[*graph.nodes, twice]))
    with pytest.raises(GraphError, match="never defined"):
        verify(dataclasses.replace(graph, nodes=graph.nodes[:-1]))


def test_a_broken_pass_is_named():
    def drop_last(graph: Graph) -> Graph:
        return dataclasses.replace(graph, nodes=graph.nodes[:-1])

    with pytest.raises(GraphError, match="after pass drop-last"):
        optimize(ffn_block(), (Pass("drop-last", drop_last),))
