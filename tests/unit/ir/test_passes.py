"""DynaIR rewrite passes on a small hand-built graph, and the verifier that guards them."""

from __future__ import annotations

import dataclasses

import pytest

from dynalm.ir.builder import GraphBuilder
from dynalm.ir.graph import Graph, Node, TensorType
from dynalm.ir.passes import (
    GraphError,
    Pass,
    fuse_gated,
    fuse_residual,
    merge_matmuls,
    optimize,
    verify,
    view_splits,
)
from dynalm.ir.planner import plan_buffers

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
    x = g.op("embed", g.input("tokens", "i32", ("T",)), weights=(g.weight("embd"),))
    h = g.op("rms_norm", x, weights=(g.weight("norm"),), eps=1e-5)
    gate = g.op("matmul", h, weights=(g.weight("gate"),))
    act = g.op(activation, gate)
    up = g.op("matmul", h, weights=(g.weight("up"),))
    f = g.op("matmul", g.op("mul", act, up), weights=(g.weight("down"),))
    out = g.op("add", x, f)
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
        "matmul",  # gate and up, merged
        "split",
        "split",
        "swiglu",
        "matmul_add",
    ]


def attention_inputs(v_dtype: str = "q4_1", biases: str = "qkv") -> Graph:
    """norm -> q/k/v matmuls (q wider than k/v) -> attention."""
    weights = {
        "embd": TensorType("f32", (50, D)),
        "norm": TensorType("f32", (D,)),
        "blk.0.attn_q.weight": TensorType("q4_1", (16, D)),
        "blk.0.attn_k.weight": TensorType("q4_1", (8, D)),
        "blk.0.attn_v.weight": TensorType(v_dtype, (8, D)),
    }
    weights.update(
        {f"blk.0.attn_{n}.bias": TensorType("f32", (16 if n == "q" else 8,)) for n in biases}
    )
    g = GraphBuilder("attn", weights)
    x = g.op("embed", g.input("tokens", "i32", ("T",)), weights=(g.weight("embd"),))
    h = g.op("rms_norm", x, weights=(g.weight("norm"),), eps=1e-5)
    q, k, v = (
        g.op(
            "matmul",
            h,
            weights=(
                g.weight(f"blk.0.attn_{n}.weight"),
                g.weight(f"blk.0.attn_{n}.bias") if n in biases else None,
            ),
        )
        for n in "qkv"
    )
    out = g.op("attention", q, k, v, layer=0, n_heads=2, n_kv_heads=1, head_dim=8, scale=0.35)
    return g.finish(out=out)


def test_matmuls_of_one_input_merge_into_one_and_split():
    graph = attention_inputs()
    out = merge_matmuls(graph)
    verify(out)
    assert ops(out) == ["embed", "rms_norm", "matmul", "split", "split", "split", "attention"]
    merged = out.nodes[2]
    assert merged.weights[0].name == "blk.0.attn_qkv.weight (merged)"
    assert merged.weights[0].type == TensorType("q4_1", (32, D))
    assert merged.weights[1].type == TensorType("f32", (32,))  # the biases, stacked too
    assert merged.attrs["parts"] == tuple(f"blk.0.attn_{n}.weight" for n in "qkv")
    assert merged.attrs["bias_parts"] == tuple(f"blk.0.attn_{n}.bias" for n in "qkv")
    assert merged.out.type.shape == ("T", 32)
    # the splits define the original q/k/v values, so the attention node is unchanged
    q, k, v = (n.out for n in graph.nodes[2:5])
    splits = out.nodes[3:6]
    assert [s.out for s in splits] == [q, k, v]
    assert [s.attrs["start"] for s in splits] == [0, 16, 24]
    assert all(s.args == (merged.out,) for s in splits)
    assert out.nodes[-1] == graph.nodes[-1]
    assert ops(graph).count("matmul") == 3  # the input graph is untouched
    assert "merged" in str(out)  # prints


def test_merge_needs_one_dtype_and_all_or_no_biases():
    out = merge_matmuls(attention_inputs(v_dtype="q8_0"))  # v differs: only q and k merge
    verify(out)
    assert ops(out).count("matmul") == 2 and ops(out).count("split") == 2
    assert out.nodes[2].attrs["parts"] == ("blk.0.attn_q.weight", "blk.0.attn_k.weight")
    out = merge_matmuls(attention_inputs(biases="q"))  # only q has a bias: no merge of q
    verify(out)
    assert ops(out)[2:4] == ["matmul", "matmul"] and len(out.nodes[2].weights) == 2
    assert out.nodes[3].attrs["parts"] == ("blk.0.attn_k.weight", "blk.0.attn_v.weight")
    assert out.nodes[3].weights[0].name == "blk.0.attn_kv.weight (merged)"


def test_splits_read_only_by_strided_operands_become_views():
    out = optimize(attention_inputs())
    splits = [n for n in out.nodes if n.op == "split"]
    assert len(splits) == 3 and all(s.attrs["view"] for s in splits)
    plan = plan_buffers(out)
    assert not any(s.out.id in plan.slot_of for s in splits)  # they read the merged buffer
    # swiglu reads dense rows: gate/up stay copies
    assert not any(n.attrs.get("view") for n in optimize(ffn_block()).nodes)


def test_verifier_catches_a_view_read_by_a_dense_operand():
    out = view_splits(merge_matmuls(attention_inputs()))
    q = out.nodes[3].out
    bad = Node("add", out.nodes[-1].out, (q, q))
    with pytest.raises(GraphError, match="cannot be the view"):
        verify(dataclasses.replace(out, nodes=[*out.nodes[:-1], bad]))


def test_verifier_catches_a_split_outside_its_source():
    out = merge_matmuls(attention_inputs())
    nodes = list(out.nodes)
    nodes[5] = dataclasses.replace(nodes[5], attrs={"start": 30, "width": 8})  # 30 + 8 > 32 columns
    with pytest.raises(GraphError, match="columns"):
        verify(dataclasses.replace(out, nodes=nodes))


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
    with pytest.raises(GraphError, match="different shapes"):
        verify(dataclasses.replace(graph, nodes=[*graph.nodes[:-1], bad_add]))
    unary_mul = Node("mul", graph.nodes[-1].out, (embed.out,))
    with pytest.raises(GraphError, match="takes 2 operands, found 1"):
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
