"""The op table's rules, each with an example it refuses and the message it gives; and the
DynaIR text of a graph with every kind of attribute read back, or refused at line:col."""

from __future__ import annotations

import pytest
from test_passes import attention_inputs

from dynalm.ir.builder import GraphBuilder
from dynalm.ir.graph import GraphError, TensorType
from dynalm.ir.ops import OPS, check_attrs, infer
from dynalm.ir.passes import optimize
from dynalm.ir.text import IRSyntaxError, parse_graph, print_graph, read_graph


def t(dtype: str, *shape) -> TensorType:
    return TensorType(dtype, shape)


X, IDS = t("f32", "T", 64), t("i32", "T")
GOOD = {
    "embed": ([IDS], [t("q8_0", 300, 64)], {}),
    "rms_norm": ([X], [t("f32", 64)], {"eps": 1e-6}),
    "head_rms_norm": ([X], [t("f32", 16)], {"eps": 1e-6, "head_dim": 16}),
    "matmul": ([X], [t("q4_0", 32, 64), t("f32", 32)], {}),
    "matmul_add": ([X, t("f32", "T", 32)], [t("q4_k", 32, 64)], {}),
    "rope": ([X, IDS], [], {"head_dim": 16, "rope_dim": 16, "base": 1e4, "neox": True}),
    "attention": ([X, t("f32", "T", 32), t("f32", "T", 32)], [],
                  {"layer": 0, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "scale": 0.25}),
    "add": ([X, X], [], {}),
    "mul": ([X, X], [], {}),
    "scale": ([X], [], {"factor": 8.0}),
    "silu": ([X], [], {}),
    "gelu_tanh": ([X], [], {}),
    "swiglu": ([X, X], [], {}),
    "geglu": ([X, X], [], {}),
    "select_rows": ([X, t("i32", "S")], [], {}),
    "gather_cols": ([X], [t("i32", 64)], {}),
    "split": ([X], [], {"start": 16, "width": 48, "view": True}),
    "layer_norm": ([X], [t("f32", 64), t("f32", 64)], {"eps": 1e-12}),
    "gelu": ([X], [], {}),
    "encoder_attention": ([X, X, X, t("i32", "S")], [], {"n_heads": 4, "head_dim": 16,
                          "scale": 0.25}),
    "pool": ([X, t("i32", "S")], [], {"mode": 1}),
    "l2_norm": ([t("f32", "S", 64)], [], {}),
    "tanh": ([t("f32", "S", 64)], [], {}),
    "moe_route": ([t("f32", "T", 8)], [], {"top_k": 2, "gating": 1, "normalize": True}),
    "expert_matmul": ([X, t("f32", "T", 4)], [t("q4_k", 8, 96, 64), t("f32", 8, 96)], {}),
    "moe_combine": ([t("f32", "T", 192), t("f32", "T", 4)], [], {}),
}  # fmt: skip
ROUTE = t("f32", "T", 4)  # two experts' ids, then their weights
BAD = [
    ("embed", ([X], [t("q8_0", 300, 64)], {}), "operand ids is i32, found tensor<f32, [T, 64]>"),
    ("rms_norm", ([X], [t("f32", 63)], {"eps": 1e-6}), "norm weight is [63], expected [64]"),
    ("head_rms_norm", ([X], [t("f32", 16)], {"eps": 1e-6, "head_dim": 24}), "not whole heads"),
    ("matmul", ([X], [t("q4_0", 32, 63)], {}), "[T, 64] x [32, 63]^T: the weight must be"),
    ("matmul", ([X], [t("q4_0", 32, 64), t("f32", 31)], {}), "bias is [31], expected [32]"),
    ("matmul", ([X], [t("q9_9", 32, 64)], {}), "weight weight has no tensor type"),
    ("matmul", ([X], [], {}), "matmul needs the weight weight"),
    ("matmul_add", ([X, X], [t("q4_k", 32, 64)], {}), "residual is [T, 64], expected [T, 32]"),
    ("rope", ([X, IDS], [], {"head_dim": 16, "rope_dim": 18, "base": 1e4, "neox": True}),
     "rope over 18 of 16 dimensions"),
    ("rope", ([X, t("i32", "S")], [], {"head_dim": 16, "rope_dim": 16, "base": 1.0,
     "neox": True}), "positions is [S], expected [T]"),
    ("attention", ([X, X, X], [], {"layer": 0, "n_heads": 4, "n_kv_heads": 3, "head_dim": 16,
     "scale": 0.25}), "4 heads cannot share 3 kv heads"),
    ("attention", ([X, X, X], [], {"layer": 0, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
     "scale": 0.25}), "a row of 64 is not 2 heads of 16"),
    ("add", ([X, t("f32", "T", 32)], [], {}), "operands of different shapes [T, 64], [T, 32]"),
    ("mul", ([X], [], {}), "mul takes 2 operands, found 1"),
    ("select_rows", ([X, IDS], [X], {}), "select_rows takes 0 weights, found 1"),
    ("gather_cols", ([X], [t("i32", 63)], {}), "by an index [63]: one per column"),
    ("gather_cols", ([X], [t("f32", 64)], {}), "weight index is i32, found tensor<f32, [64]>"),
    ("split", ([X], [], {"start": 16, "width": 64}), "columns 16+64 of [T, 64]"),
    ("layer_norm", ([X], [t("f32", 64), t("f32", 63)], {"eps": 1e-12}),
     "norm bias is [63], expected [64]"),
    ("layer_norm", ([X], [t("f32", 64)], {"eps": 1e-12}), "layer_norm needs the weight bias"),
    ("encoder_attention", ([X, X, X, t("i32", "S")], [], {"n_heads": 3, "head_dim": 16,
     "scale": 0.25}), "a row of 64 is not 3 heads of 16"),
    ("encoder_attention", ([X, t("f32", "T", 32), X, t("i32", "S")], [], {"n_heads": 2,
     "head_dim": 32, "scale": 0.25}), "a row of 32 is not 2 heads of 32"),
    ("encoder_attention", ([X, X, X, t("i32", "S", 2)], [], {"n_heads": 4, "head_dim": 16,
     "scale": 0.25}), "the sequences' last rows are [S], found [S, 2]"),
    ("pool", ([X, t("i32", "S")], [], {"mode": 0}), "attribute mode must be in [1, "),
    ("pool", ([X, t("i32", "S")], [], {"mode": 4}),
     "pooling mode 4 is not one of 1 (mean), 2 (cls), 3 (last)"),
    ("pool", ([X, t("f32", "S")], [], {"mode": 1}), "operand last is i32"),
    ("moe_route", ([t("f32", "T", 8)], [], {"top_k": 9, "gating": 1, "normalize": True}),
     "top_k 9 of 8 experts"),
    ("moe_route", ([t("f32", "T", 8)], [], {"top_k": 0, "gating": 1, "normalize": True}),
     "attribute top_k must be in [1, "),
    ("moe_route", ([t("f32", "T", 8)], [], {"top_k": 2, "gating": 3, "normalize": True}),
     "gating 3 is not one of 1 (softmax), 2 (sigmoid)"),
    ("moe_route", ([t("f32", "T")], [], {"top_k": 1, "gating": 2, "normalize": False}),
     "moe_route takes logits [T, experts], found [T]"),
    ("expert_matmul", ([X, t("f32", "T", 5)], [t("q8_0", 8, 96, 64)], {}),
     "a route is [T, 2 * top_k] (ids, then weights), found [T, 5]"),
    ("expert_matmul", ([X, t("f32", "T", 6)], [t("q8_0", 2, 96, 64)], {}),
     "top_k 3 of 2 experts"),
    ("expert_matmul", ([X, ROUTE], [t("q8_0", 96, 64)], {}),
     "the experts are [experts, rows, cols], found [96, 64]"),
    ("expert_matmul", ([t("f32", "T", 96), ROUTE], [t("q8_0", 8, 96, 64)], {}),
     "x is [T, 96]: one row of 64 for every slot or 2 slots' rows (128)"),
    ("expert_matmul", ([X, t("f32", "S", 4)], [t("q8_0", 8, 96, 64)], {}),
     "the route's rows is [S], expected [T]"),
    ("expert_matmul", ([X, ROUTE], [t("q8_0", 8, 96, 64), t("f32", 96)], {}),
     "the experts' bias is [96], expected [8, 96]"),
    ("moe_combine", ([t("f32", "T", 191), ROUTE], [], {}),
     "moe_combine of [T, 191]: not 2 slots of equal width"),
    ("moe_combine", ([t("f32", "T", 192), t("f32", "T", 3)], [], {}),
     "a route is [T, 2 * top_k]"),
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_a_good_example(name: str):
    args, weights, attrs = GOOD[name]
    out = infer(OPS[name], args, weights, check_attrs(OPS[name], attrs))
    assert out.dtype == "f32"


@pytest.mark.parametrize(("name", "example", "message"), BAD)
def test_each_rule_refuses_with_what_was_expected_and_found(name, example, message):
    args, weights, attrs = example
    with pytest.raises(GraphError) as e:
        infer(OPS[name], args, weights, check_attrs(OPS[name], attrs))
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"eps": "1"}, "rms_norm's attribute eps is float, found '1'"),
        ({"eps": True}, "attribute eps is float, found True"),
        ({}, "rms_norm needs the attribute eps: float"),
        ({"eps": 1.0, "axis": 1}, "rms_norm has no attribute 'axis'"),
    ],
)
def test_attributes_are_typed(attrs: dict, message: str):
    with pytest.raises(GraphError, match=message):
        check_attrs(OPS["rms_norm"], attrs)
    assert check_attrs(OPS["rope"], GOOD["rope"][2])["scale"] == 1.0  # a default filled in


def test_text_of_merged_weights_views_and_every_attribute_kind_reads_back():
    graph = optimize(attention_inputs())
    text = print_graph(graph)
    assert 'parts=["blk.0.attn_q.weight"' in text and "view=true" in text and "scale=0.35" in text
    assert parse_graph(text) == graph
    assert read_graph(text) == graph


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace("= embed", "= embedd"), "<dynair>:2:29: unknown op 'embedd'"),
        (lambda s: s.replace("eps=1e-05", "eps=true"), "eps is a number, found true"),
        (lambda s: s.replace("eps=1e-05", "epsilon=1.0"), "rms_norm has no attribute 'epsilon'"),
        (lambda s: s.replace("start=16", "start=1.5"), "start is an integer, found 1.5"),
        (lambda s: s.replace("rms_norm %1", "rms_norm %9"), "<dynair>:3:38: %9 is used before"),
        (lambda s: s.replace("tensor<f32, [T, 8]> = rms", "tensor<f32, [T, 8> = rms"),
         "<dynair>:3:24: unexpected '>', expected ',' or ']'"),
        (lambda s: s.replace("= rms_norm %1", "= rms_norm %0"),
         "<dynair>:3:3: node 1 (rms_norm -> %2): rms_norm's operand x is f32"),
    ],
)  # fmt: skip
def test_bad_text_is_refused_at_line_and_column(edit, message: str):
    text = print_graph(optimize(attention_inputs()))
    with pytest.raises(IRSyntaxError) as e:
        read_graph(edit(text))
    assert message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_dynamic_and_named_dims_read_back():
    g = GraphBuilder("dyn", {})
    x = g.input("x", "f32", ("?", 8))
    graph = g.finish(y=g.op("scale", g.op("silu", x), factor=-0.5))
    text = print_graph(graph)
    assert "tensor<f32, [?, 8]> = silu %0" in text and "factor=-0.5" in text
    assert read_graph(text) == graph


def test_a_mixture_of_experts_reads_back():
    weights = {
        "router": t("f32", 8, 64),
        "up": t("q4_k", 8, 96, 64),
        "bias": t("f32", 8, 96),
        "down": t("q8_0", 8, 64, 96),
    }
    g = GraphBuilder("moe", weights)
    x = g.input("x", "f32", ("T", 64))
    logits = g.op("matmul", x, weights=(g.weight("router"),))
    route = g.op("moe_route", logits, top_k=2, gating=2, normalize=False, scale=2.5)
    up = g.op("expert_matmul", x, route, weights=(g.weight("up"), g.weight("bias")))
    down = g.op("expert_matmul", up, route, weights=(g.weight("down"),))
    graph = g.finish(y=g.op("moe_combine", down, route))
    text = print_graph(graph)
    assert "moe_route %1, top_k=2, gating=2, normalize=false, scale=2.5" in text, text
    assert "tensor<f32, [T, 192]> = expert_matmul %0, %2" in text, text
    assert '@"up": tensor<q4_k, [8, 96, 64]>, @"bias": tensor<f32, [8, 96]>' in text
    assert read_graph(text) == graph
