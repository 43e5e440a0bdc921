"""The op table: every DynaIR op defined once.

An entry names the op's value operands (their dtype, and whether the kernel reads them with
a row stride, so that they may be views), its weight operands (tensors of the model file,
some optional), its attributes with their types and defaults, a shape rule and the dtype
rule: activations are ``f32``, index inputs ``i32``, and a weight may have any tensor type
of the quant-format table (every format has its matmul, embedding and vector kernels), the
result is ``f32``. The builder, the verifier, the text printer and parser, the executor's
binding and ``dynalm show`` all read this table; adding an op is one entry here plus its
kernels (and a line in the executor's binding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynalm.core.quant import QUANT_FORMATS
from dynalm.ir.graph import Dim, GraphError, TensorType

WEIGHT_DTYPES = frozenset(f.name for f in QUANT_FORMATS.values())
REQUIRED: Any = object()  # an attribute every node must have
ABSENT: Any = object()  # an attribute a node may lack (not filled in)
Names = tuple  # an attribute holding a tuple of tensor names (merged weights' parts)
ATTR_TYPES: dict[type, str] = {int: "int", float: "float", bool: "bool", Names: "names"}


@dataclass(frozen=True)
class Operand:
    name: str
    dtype: str = "f32"
    strided: bool = False  # the kernel reads rows at any stride: a view may be passed


@dataclass(frozen=True)
class WeightSlot:
    name: str
    optional: bool = False
    dtype: str | None = None  # an index tensor's dtype; None: any quant-format table row
    # how a device prepares it: matmul | embedding | vector | index | experts (a stack of
    # matmul weights [E, N, K], each prepared when first routed to)
    use: str = "vector"


MAX_ATTR_INT = 2**31 - 1  # an int attribute is a count, size or index: kernels take int32


@dataclass(frozen=True)
class Attr:
    name: str
    type: type
    default: Any = REQUIRED
    min: float | None = None  # the least value of a number (a float is also always finite)


Shapes = list[tuple[Dim, ...]]
ShapeRule = Callable[[Shapes, list, dict[str, Any]], tuple[Dim, ...]]


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[Operand, ...]
    shape: ShapeRule  # (operand shapes, weight shapes or None, attrs) -> result shape
    weights: tuple[WeightSlot, ...] = ()
    attrs: tuple[Attr, ...] = ()
    kernel: str = "numpy"  # the CPU kernel: jit | matmul | embedding | attention | numpy | copy
    view: bool = False  # its result may be marked a view of its operand (no copy)
    gate: str | None = None  # gated ops: the activation op they fuse with a mul
    doc: str = ""

    def attr(self, name: str) -> Attr | None:
        return next((a for a in self.attrs if a.name == name), None)


def _fail(message: str) -> GraphError:
    return GraphError(message)


def _width(shape: tuple[Dim, ...]) -> Dim:
    return shape[-1] if shape else 0


def _same(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    if any(s != shapes[0] for s in shapes[1:]):
        raise _fail("operands of different shapes " + ", ".join(_dims(s) for s in shapes))
    return shapes[0]


def _dims(shape: tuple[Dim, ...] | None) -> str:
    return "none" if shape is None else f"[{', '.join(str(d) for d in shape)}]"


def _expect(what: str, shape: tuple[Dim, ...] | None, expected: tuple[Dim, ...]) -> None:
    if shape is not None and tuple(shape) != tuple(expected):
        raise _fail(f"{what} is {_dims(shape)}, expected {_dims(expected)}")


def _rows(shape: tuple[Dim, ...]) -> Dim:
    if len(shape) != 2:
        raise _fail(f"expected rows of a matrix, found {_dims(shape)}")
    return shape[0]


def _heads(width: Dim, head_dim: int, heads: int | None = None) -> None:
    whole = isinstance(width, int) and head_dim >= 1 and width % head_dim == 0
    if not whole or (heads is not None and width != heads * head_dim):
        n = "whole heads" if heads is None else f"{heads} heads"
        raise _fail(f"a row of {width} is not {n} of {head_dim}")


def _embed(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    (ids,), (table,) = shapes, weights
    if len(ids) != 1 or len(table) != 2:
        raise _fail(f"embed takes ids [T] and a table [rows, width], found {_dims(ids)}")
    return (ids[0], table[1])


def _norm(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    _expect("the norm weight", weights[0], (_width(shapes[0]),))
    return shapes[0]


def _head_norm(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    _heads(_width(shapes[0]), attrs["head_dim"])
    _expect("the head norm weight", weights[0], (attrs["head_dim"],))
    return shapes[0]


def _matmul(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    x, w, bias = shapes[0], weights[0], weights[1]
    if len(x) != 2 or len(w) != 2 or w[1] != x[1]:
        raise _fail(f"{_dims(x)} x {_dims(w)}^T: the weight must be [rows, {_width(x)}]")
    _expect("the bias", bias, (w[0],))
    out = (x[0], w[0])
    if len(shapes) > 1:  # matmul_add's residual
        _expect("the residual", shapes[1], out)
    return out


def _rope(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    x, positions = shapes
    head_dim, rope_dim = attrs["head_dim"], attrs["rope_dim"]
    _heads(_width(x), head_dim)
    if not (2 <= rope_dim <= head_dim and rope_dim % 2 == 0):
        raise _fail(f"rope over {rope_dim} of {head_dim} dimensions")
    _expect("the positions", positions, x[:1])
    _expect("the frequency factors", weights[0], (rope_dim // 2,))
    _expect("the long-context frequency factors", weights[1], (rope_dim // 2,))
    if weights[1] is not None and (weights[0] is None or "orig_ctx" not in attrs):
        raise _fail("long-context factors need the short context's (freq_factors) and orig_ctx")
    yarn = ("ext_factor", "orig_ctx", "beta_fast", "beta_slow")
    if "ext_factor" in attrs and any(a not in attrs for a in yarn):
        raise _fail("YaRN (ext_factor) needs orig_ctx, beta_fast and beta_slow")
    return x


def _attention(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    n_heads, n_kv, head_dim = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    if n_kv < 1 or n_heads % n_kv:
        raise _fail(f"{n_heads} heads cannot share {n_kv} kv heads")
    for shape, heads in zip(shapes, (n_heads, n_kv, n_kv), strict=True):
        _heads(_width(shape), head_dim, heads)
        _expect("the rows of k and v", shape[:1], shapes[0][:1])
    _expect("the sinks", weights[0], (n_heads,))
    return (shapes[0][0], n_heads * head_dim)


def _layer_norm(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    _expect("the norm weight", weights[0], (_width(shapes[0]),))
    _expect("the norm bias", weights[1], (_width(shapes[0]),))
    return shapes[0]


def _encoder_attention(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    *qkv, last = shapes
    for shape in qkv:
        _heads(_width(shape), attrs["head_dim"], attrs["n_heads"])
        _expect("the rows of k and v", shape, qkv[0])
    if len(last) != 1:
        raise _fail(f"the sequences' last rows are [S], found {_dims(last)}")
    return qkv[0]


POOL_MODES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's {arch}.pooling_type numbers


def _pool(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    x, last = shapes
    if attrs["mode"] not in POOL_MODES:
        raise _fail(
            f"pooling mode {attrs['mode']} is not one of "
            + ", ".join(f"{n} ({name})" for n, name in POOL_MODES.items())
        )
    if len(x) != 2 or len(last) != 1:
        raise _fail(f"pool takes [T, width] and [S], found {_dims(x)}, {_dims(last)}")
    return (last[0], x[1])


def _select_rows(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    x, rows = shapes
    if len(x) != 2 or len(rows) != 1:
        raise _fail(f"select_rows takes [T, width] and [S], found {_dims(x)}, {_dims(rows)}")
    return (rows[0], x[1])


def _gather_cols(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    (x,), (index,) = shapes, weights
    if len(x) != 2 or len(index) != 1 or index[0] != x[1]:
        raise _fail(f"gather_cols of {_dims(x)} by an index {_dims(index)}: one per column")
    return x


def _split(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    (src,), start, width = shapes, attrs["start"], attrs["width"]
    if len(src) != 2 or start < 0 or width < 1 or start + width > _width(src):
        raise _fail(f"columns {start}+{width} of {_dims(src)}")
    return (src[0], width)


GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC numbers


def _top_k(route: tuple[Dim, ...], n_experts: Dim | None = None) -> int:
    """The k of a route ``[T, 2k]`` (ids, then weights), checked against the experts."""
    width = _width(route)
    if len(route) != 2 or not isinstance(width, int) or width < 2 or width % 2:
        raise _fail(f"a route is [T, 2 * top_k] (ids, then weights), found {_dims(route)}")
    if isinstance(n_experts, int) and width // 2 > n_experts:
        raise _fail(f"top_k {width // 2} of {n_experts} experts")
    return width // 2


def _moe_route(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    (logits,), k = shapes, attrs["top_k"]
    if len(logits) != 2:
        raise _fail(f"moe_route takes logits [T, experts], found {_dims(logits)}")
    if attrs["gating"] not in GATING:
        known = ", ".join(f"{n} ({name})" for n, name in GATING.items())
        raise _fail(f"gating {attrs['gating']} is not one of {known}")
    route = (logits[0], 2 * k)
    _top_k(route, logits[1])
    return route


def _expert_matmul(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    (x, route), (experts, bias) = shapes, weights
    if len(experts) != 3:
        raise _fail(f"the experts are [experts, rows, cols], found {_dims(experts)}")
    n_experts, n, k_in = experts
    k = _top_k(route, n_experts)
    _expect("the route's rows", route[:1], x[:1])
    if len(x) != 2 or x[1] not in (k_in, k * k_in):
        raise _fail(
            f"x is {_dims(x)}: one row of {k_in} for every slot or {k} slots' rows "
            f"({k * k_in}) for the experts {_dims(experts)}"
        )
    _expect("the experts' bias", bias, (n_experts, n))
    return (x[0], k * n)


def _moe_combine(shapes: Shapes, weights: list, attrs: dict) -> tuple[Dim, ...]:
    y, route = shapes
    k = _top_k(route)
    _expect("the route's rows", route[:1], y[:1])
    if len(y) != 2 or not isinstance(y[1], int) or y[1] % k:
        raise _fail(f"moe_combine of {_dims(y)}: not {k} slots of equal width")
    return (y[0], y[1] // k)


X = Operand("x")
_EPS = Attr("eps", float, min=0.0)
_HEAD_DIM = Attr("head_dim", int, min=1)
_MATMUL_WEIGHT = WeightSlot("weight", use="matmul")
_BIAS = WeightSlot("bias", optional=True)
_MERGED = (Attr("parts", Names, ABSENT), Attr("bias_parts", Names, ABSENT))

_TABLE = (
    OpDef("embed", (Operand("ids", "i32"),), _embed, (WeightSlot("table", use="embedding"),),
          kernel="embedding", doc="rows of the table by token id"),
    OpDef("rms_norm", (X,), _norm, (WeightSlot("weight"),), (_EPS,), kernel="jit",
          doc="x / rms(x) * weight, per row"),
    OpDef("head_rms_norm", (X,), _head_norm, (WeightSlot("weight"),),
          (_EPS, _HEAD_DIM), kernel="jit", doc="RMSNorm of each head's slice"),
    OpDef("matmul", (X,), _matmul, (_MATMUL_WEIGHT, _BIAS), _MERGED, kernel="matmul",
          doc="x @ weight^T (+ bias)"),
    OpDef("matmul_add", (X, Operand("residual")), _matmul, (_MATMUL_WEIGHT, _BIAS),
          _MERGED, kernel="matmul", doc="x @ weight^T (+ bias) + residual"),
    # LongRoPE (Phi-3): with long_factors, a context (the engine's --ctx) longer than
    # orig_ctx divides the frequencies by them instead of freq_factors, as llama.cpp picks;
    # attn_factor scales cos and sin (absent: 1; both absent print as before). YaRN (gpt-oss,
    # llama.cpp's rope_yarn): with ext_factor, the pairs between the correction dims of
    # beta_fast and beta_slow (over orig_ctx) ramp from extrapolated (unscaled) to
    # interpolated (positions / scale), cos and sin times 1 + 0.1 ln(scale) more
    OpDef("rope", (Operand("x", strided=True), Operand("positions", "i32")), _rope,
          (WeightSlot("freq_factors", optional=True), WeightSlot("long_factors", optional=True)),
          (_HEAD_DIM, Attr("rope_dim", int, min=2), Attr("base", float, min=0.0),
           Attr("neox", bool), Attr("scale", float, 1.0),
           Attr("attn_factor", float, ABSENT, min=0.0), Attr("orig_ctx", int, ABSENT, min=1),
           Attr("ext_factor", float, ABSENT, min=0.0), Attr("beta_fast", float, ABSENT),
           Attr("beta_slow", float, ABSENT)),
          kernel="jit", doc="rotary position embedding of each head's first rope_dim dims"),
    OpDef("attention",
          (Operand("q", strided=True), Operand("k", strided=True), Operand("v", strided=True)),
          _attention,
          # sinks (gpt-oss's): a learned logit per head, one more term of the softmax's
          # denominator (no value): the weights may sum to less than 1
          (WeightSlot("sinks", optional=True),),
          attrs=(Attr("layer", int, min=0), Attr("n_heads", int, min=1),
                 Attr("n_kv_heads", int, min=1), _HEAD_DIM, Attr("scale", float),
                 Attr("window", int, 0, min=0),
                 # a cap on the scaled scores s -> softcap tanh(s / softcap) (Gemma 2's);
                 # absent: none (so graphs without one print as before)
                 Attr("softcap", float, ABSENT, min=0.0)),
          kernel="attention", doc="writes k/v into the layer's KV pages, attends causally"),
    OpDef("add", (Operand("a"), Operand("b")), _same, kernel="jit", doc="a + b"),
    OpDef("mul", (Operand("a"), Operand("b")), _same, doc="a * b"),
    OpDef("scale", (X,), _same, attrs=(Attr("factor", float),), doc="x * factor"),
    OpDef("silu", (X,), _same, doc="x * sigmoid(x)"),
    OpDef("gelu_tanh", (X,), _same, doc="GELU, tanh approximation"),
    OpDef("swiglu", (Operand("gate"), Operand("up")), _same, kernel="jit", gate="silu",
          doc="silu(gate) * up"),
    OpDef("geglu", (Operand("gate"), Operand("up")), _same, kernel="jit", gate="gelu_tanh",
          doc="gelu_tanh(gate) * up"),
    # gpt-oss's experts (llama.cpp's ggml_swiglu_oai): g = min(gate, limit), u = up clamped
    # to [-limit, limit]; not fused from a mul (its up is shifted), a .lum file calls it
    OpDef("swiglu_oai", (Operand("gate"), Operand("up")), _same,
          attrs=(Attr("alpha", float), Attr("limit", float, min=0.0)), kernel="jit",
          doc="(u + 1) * g * sigmoid(alpha * g), g and u clamped by limit"),
    # the encoder's (bert.lum): sequences packed one after another, each ending at its row
    # of ``last`` (the step's logit_rows); no KV cache
    OpDef("layer_norm", (X,), _layer_norm, (WeightSlot("weight"), WeightSlot("bias")),
          (_EPS,), kernel="jit", doc="(x - mean) / std * weight + bias, per row"),
    OpDef("gelu", (X,), _same, kernel="jit", doc="GELU, erf form"),
    OpDef("encoder_attention", (Operand("q"), Operand("k"), Operand("v"), Operand("last", "i32")),
          _encoder_attention,
          attrs=(Attr("n_heads", int, min=1), _HEAD_DIM, Attr("scale", float)),
          kernel="jit", doc="bidirectional attention within each sequence of the step"),
    OpDef("pool", (X, Operand("last", "i32")), _pool, attrs=(Attr("mode", int, min=1),),
          kernel="jit", doc="per sequence: the mean of its rows (1), its first (2), last (3)"),
    OpDef("l2_norm", (X,), _same, kernel="jit", doc="x / |x| per row"),
    OpDef("tanh", (X,), _same, doc="tanh (a reranker's classification head)"),
    OpDef("select_rows", (X, Operand("rows", "i32")), _select_rows,
          doc="the rows listed (each sequence's last token)"),
    OpDef("gather_cols", (X,), _gather_cols, (WeightSlot("index", dtype="i32", use="index"),),
          doc="x[:, index]: columns in the order a weight's input was permuted at load"),
    # mixture of experts: a route row holds the chosen experts' ids (exact in f32), then
    # their weights; expert_matmul multiplies each slot's row by its expert's matrix
    OpDef("moe_route", (Operand("logits"),), _moe_route,
          attrs=(Attr("top_k", int, min=1), Attr("gating", int, min=1), Attr("normalize", bool),
                 Attr("scale", float, 1.0)),
          doc="the top_k experts of each row's gated logits (ids, then weights)"),
    OpDef("expert_matmul", (X, Operand("route")), _expert_matmul,
          (WeightSlot("experts", use="experts"), _BIAS), kernel="matmul",
          doc="each slot's row @ its expert's weight^T (+ bias)"),
    OpDef("moe_combine", (Operand("y"), Operand("route")), _moe_combine,
          doc="the slots' rows summed, each times its route weight"),
    OpDef("split", (X,), _split, attrs=(Attr("start", int, min=0), Attr("width", int, min=1),
                                        Attr("view", bool, ABSENT)),
          kernel="copy", view=True, doc="columns start..start+width (a view when marked)"),
)  # fmt: skip
OPS: dict[str, OpDef] = {op.name: op for op in _TABLE}
GATES = {op.name: op.gate for op in _TABLE if op.gate}  # a gated op's activation: swiglu -> silu


def op_def(name: str) -> OpDef:
    if name not in OPS:
        raise GraphError(f"unknown op '{name}' (known: {', '.join(OPS)})")
    return OPS[name]


def check_attrs(op: OpDef, attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with defaults filled in, each of its declared type (an int is a float), a
    float finite, an int within int32, a number at least the attribute's ``min``."""
    unknown = sorted(set(attrs) - {a.name for a in op.attrs})
    if unknown:
        raise GraphError(f"{op.name} has no attribute '{unknown[0]}'")
    out: dict[str, Any] = {}
    for a in op.attrs:
        if a.name not in attrs:
            if a.default is REQUIRED:
                raise GraphError(f"{op.name} needs the attribute {a.name}: {ATTR_TYPES[a.type]}")
            if a.default is not ABSENT:
                out[a.name] = a.default
            continue
        value = attrs[a.name]
        if a.type is float and type(value) is int:
            value = float(value)
        ok = type(value) is a.type or (a.type is Names and all(type(n) is str for n in value))
        if not ok or (a.type is Names and type(value) is not tuple):
            raise GraphError(
                f"{op.name}'s attribute {a.name} is {ATTR_TYPES[a.type]}, found {value!r}"
            )
        if a.type in (int, float):
            _check_number(op, a, value)
        out[a.name] = value
    return out


def _check_number(op: OpDef, a: Attr, value: float) -> None:
    if a.type is int:
        lo, hi = -MAX_ATTR_INT if a.min is None else int(a.min), MAX_ATTR_INT
        if not lo <= value <= hi:
            found = f"about 2**{value.bit_length() - 1}" if abs(value) > 2**64 else value
            raise GraphError(
                f"{op.name}'s attribute {a.name} must be in [{lo}, {hi}], found {found}"
            )
    elif not math.isfinite(value) or (a.min is not None and value < a.min):
        want = "finite" if a.min is None else f"finite and at least {a.min:g}"
        raise GraphError(f"{op.name}'s attribute {a.name} must be {want}, found {value!r}")


def infer(
    op: OpDef, args: list[TensorType], weights: list[TensorType | None], attrs: dict[str, Any]
) -> TensorType:
    """The result type of ``op`` on these operands (the dtype and shape rules), or a
    ``GraphError`` saying what was expected and what was found."""
    if len(args) != len(op.operands):
        raise GraphError(f"{op.name} takes {len(op.operands)} operands, found {len(args)}")
    if len(weights) > len(op.weights):
        raise GraphError(f"{op.name} takes {len(op.weights)} weights, found {len(weights)}")
    weights = weights + [None] * (len(op.weights) - len(weights))
    for operand, t in zip(op.operands, args, strict=True):
        if t.dtype != operand.dtype:
            raise GraphError(f"{op.name}'s operand {operand.name} is {operand.dtype}, found {t}")
    for slot, t in zip(op.weights, weights, strict=True):
        if t is None and not slot.optional:
            raise GraphError(f"{op.name} needs the weight {slot.name}")
        if t is not None and slot.dtype is not None and t.dtype != slot.dtype:
            raise GraphError(f"{op.name}'s weight {slot.name} is {slot.dtype}, found {t}")
        if t is not None and slot.dtype is None and t.dtype not in WEIGHT_DTYPES:
            raise GraphError(f"{op.name}'s weight {slot.name} has no tensor type, found {t}")
    shapes = [t.shape for t in args]
    weight_shapes = [None if t is None else t.shape for t in weights]
    return TensorType("f32", op.shape(shapes, weight_shapes, attrs))
