"""Element-wise programs: RMSNorm, RoPE, SwiGLU / GeGLU, add, and the rest of the op table's
element-wise ops (mul, scale, SiLU / GELU alone, a matmul's bias, column copies and gathers,
row gathers: the embedding lookup and ``select_rows``), so that every device runs one
definition of each op; and the encoder's (``bert.lum``): LayerNorm with bias, GELU (erf),
bidirectional attention within each sequence, pooling (mean / CLS / last) and L2
normalisation.

Each is specialised on its constant shapes (row width, head size, eps, rope layout) and
written as explicit vector loops of the backend's width (``target.lanes``) plus a 1-lane
tail, so odd sizes work and nothing depends on the auto-vectoriser (which would give up on
in-place calls such as ``out += residual``). ``exp`` is the language's polynomial (about
1 ulp), so SiLU and GELU vectorise instead of calling libm per element.

Kernel signature: ``void f(i64 *args, i64 lo, i64 hi)``, ``args`` a count (rows, or
elements for ``add``, ``mul``, ``scale``, ``act``, ``gated`` and ``gelu``) followed by the
arrays' addresses (``core.elementwise`` binds them), ``[lo, hi)`` the part of the count a
call runs: each row (element) is computed alone, so the pool splits a count over its
threads, and the GPU's grid over its, with the same results however it is split.
``select_experts`` alone is ``f(args)`` over its whole count (it counts what it reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import llvmlite.ir as ir

from dynalm.kernel.backends import Program
from dynalm.kernel.lang import F32, I32, I64, PTR, Kernel, Module, Var, const, vec

ARRAYS = {
    "add": 3, "mul": 3, "scale": 2, "act": 2, "gated": 3, "bias": 3, "columns": 3, "rows": 3,
    "rms_norm": 3, "rope": 5, "layer_norm": 4, "gelu": 2, "l2_norm": 2, "pool": 3,
    "encoder_attention": 5, "combine": 3, "moe_route": 2, "select_experts": 5, "expert_bias": 3,
}  # fmt: skip  # addresses after the count
# Programs of one call over their whole count, ``f(args)``: the rest take a part of it
SERIAL = frozenset({"select_experts"})
# pooling modes, numbered as llama.cpp's ``{arch}.pooling_type`` (0 none, 4 rank: not here)
POOL_MEAN, POOL_CLS, POOL_LAST = 1, 2, 3
# RMSNorm sums its squares in 8 lanes on every backend: the one reduction here, and its
# order is the contract (auto mode rounds the normalised activations to int8, where a
# last-bit difference can flip a rounding and, through the layers, a greedy token), so a
# model's outputs do not depend on the host's vector width. The rest is lane-wise and
# bitwise the same at any width.
SUM_LANES = 8
# The least sum a router's chosen weights are normalised by (llama.cpp's clamp: f16's
# smallest normal), here and in ``cpu_ops.moe_route``
MIN_WEIGHT_SUM = 6.103515625e-5


def _kernel(module: Module, kind: str) -> tuple[Kernel, ir.Value, ir.Value, list[ir.Value]]:
    """The program's one function ``f(block, lo, hi)``, over ``[lo, hi)`` of the block's
    count (the pool or the GPU's grid splits the count), and its arrays (the block's words
    after the count)."""
    k = module.kernel(f"{module.ir.name}_{kind}", (PTR, I64, I64))
    block, lo, hi = k.args
    _, *arrays = k.words(block, 1 + ARRAYS[kind])
    return k, lo, hi, [k.pointer(a) for a in arrays]


def _floats(k: Kernel, array: ir.Value, i: ir.Value, w: int) -> ir.Value:
    """``array[i : i + w]`` of an f32 array as ``<w x float>``."""
    return k.load(vec(F32, w), k.index(array, i, F32), align=4)


def _put(k: Kernel, value: ir.Value, array: ir.Value, i: ir.Value) -> None:
    k.store(value, k.index(array, i, F32), align=4)


def _copy(k: Kernel, out: ir.Value, dst: ir.Value, x: ir.Value, src: ir.Value, n: int) -> None:
    """``out[dst : dst + n] = x[src : src + n]`` at the backend's width."""
    k.lanes(
        k.i64(0),
        k.i64(n),
        k.target.lanes,
        lambda j, w: _put(k, _floats(k, x, k.add(src, j), w), out, k.add(dst, j)),
    )


def _elementwise(module: Module, kind: str, body: Callable[..., ir.Value]) -> None:
    """``out[i] = body(k, x[i], y[i])`` over ``count`` elements (``body(k, x[i])`` for a
    program of one input)."""
    k, lo, hi, (out, *ins) = _kernel(module, kind)
    k.lanes(
        lo,
        hi,
        k.target.lanes,
        lambda i, w: _put(k, body(k, *(_floats(k, a, i, w) for a in ins)), out, i),
    )
    k.ret()


def _build_add(module: Module) -> None:
    _elementwise(module, "add", lambda k, x, y: k.add(x, y))


def _build_mul(module: Module) -> None:
    _elementwise(module, "mul", lambda k, x, y: k.mul(x, y))


def _build_scale(module: Module, factor: float) -> None:
    _elementwise(module, "scale", lambda k, x: k.mul(x, factor))


def _activation(k: Kernel, g: ir.Value, activation: str) -> ir.Value:
    """act(g) = g * sigmoid(z): z = g for SiLU, and z = 2 sqrt(2/pi) (g + 0.044715 g^3) for
    tanh-GELU (0.5 (1 + tanh(y)) = sigmoid(2y)); tanh itself (a reranker's head) is
    ``Kernel.tanh``."""
    if activation == "tanh":
        return k.tanh(g)
    z = g
    if activation == "gelu_tanh":
        inner = k.add(g, k.mul(k.mul(k.mul(g, g), g), 0.044715))
        z = k.mul(inner, 2.0 * math.sqrt(2.0 / math.pi))
    e = k.exp(k.sub(const(z.type, 0.0), z))
    return k.b.fdiv(g, k.add(e, 1.0))


def _build_act(module: Module, activation: str) -> None:
    """out = act(x): the unfused activation (the gated programs' own, so a graph that
    fuses it with its mul computes the same values)."""
    _elementwise(module, "act", lambda k, x: _activation(k, x, activation))


def _build_gated(module: Module, activation: str, alpha: float = 1.0, limit: float = 0.0) -> None:
    """out = act(gate) * up (``_activation``); or gpt-oss's "swiglu_oai" (llama.cpp's
    ``ggml_swiglu_oai``): g = min(gate, limit), u = up clamped to [-limit, limit],
    out = g / (1 + exp(-alpha g)) * (u + 1)."""

    def oai(k: Kernel, g: ir.Value, up: ir.Value) -> ir.Value:
        g = k.fmin(g, limit)
        u = k.fmax(k.fmin(up, limit), -limit)
        glu = k.b.fdiv(g, k.add(k.exp(k.mul(g, -alpha)), 1.0))
        return k.mul(glu, k.add(u, 1.0))

    if activation == "swiglu_oai":
        _elementwise(module, "gated", oai)
    else:
        _elementwise(module, "gated", lambda k, g, up: k.mul(_activation(k, g, activation), up))


def _build_bias(module: Module, width: int) -> None:
    """Per row of ``width``: out = x + bias (a matmul's bias; ``out`` may be ``x``)."""
    k, lo, hi, (out, x, bias) = _kernel(module, "bias")

    def row(r: ir.Value) -> None:
        base = k.mul(r, width)

        def add(i: ir.Value, w: int) -> None:
            at = k.add(base, i)
            _put(k, k.add(_floats(k, x, at, w), _floats(k, bias, i, w)), out, at)

        k.lanes(k.i64(0), k.i64(width), k.target.lanes, add)

    k.loop(lo, hi, 1, row)
    k.ret()


def _build_combine(module: Module, width: int, top_k: int) -> None:
    """A mixture's weighted sum per row: ``out = sum_j route[k + j] * y[j*width ..]``
    (``route`` a row of ``2 top_k``: ids, then weights; ``y`` a row of ``top_k * width``),
    each product rounded, then added in slot order (``cpu_ops.moe_combine``)."""
    k, lo, hi, (out, y, route) = _kernel(module, "combine")

    def row(r: ir.Value) -> None:
        ys, weights = k.mul(r, top_k * width), k.add(k.mul(r, 2 * top_k), top_k)
        scalars = [k.load(F32, k.index(route, k.add(weights, j), F32), 0, 4) for j in range(top_k)]
        at = k.mul(r, width)

        def column(i: ir.Value, w: int) -> None:
            def term(j: int) -> ir.Value:
                at_j = k.add(k.add(ys, i), j * width)
                return k.mul(_floats(k, y, at_j, w), k.splat(scalars[j], w))

            acc = term(0)
            for j in range(1, top_k):
                acc = k.add(acc, term(j))
            _put(k, acc, out, k.add(at, i))

        k.lanes(k.i64(0), k.i64(width), k.target.lanes, column)

    k.loop(lo, hi, 1, row)
    k.ret()


def _build_moe_route(
    module: Module, n_experts: int, top_k: int, gating: int, normalize: bool, scale: float
) -> None:
    """A mixture's router per row of ``n_experts`` logits (``cpu_ops.moe_route``): gated
    (1: softmax, its sum in expert order; 2: each logit's sigmoid), the ``top_k`` most
    probable experts picked one by one by their logits (highest first, ties to the lower
    id), their ids (as f32) then weights (over their sum in pick order if ``normalize``,
    times ``scale``) into a row of ``2 top_k``."""
    k, lo, hi, (out, logits) = _kernel(module, "moe_route")
    # the gated weights; the logits of the experts not picked yet
    probs, left = k.stack(4 * n_experts), k.stack(4 * n_experts)
    minus_inf = const(F32, float("-inf"))

    def at(array: ir.Value, i: ir.Value) -> ir.Value:
        return k.load(F32, k.index(array, i, F32), 0, 4)

    def put(value: ir.Value, array: ir.Value, i: ir.Value) -> None:
        k.store(value, k.index(array, i, F32), 0, 4)

    def row(r: ir.Value) -> None:
        x, y = k.index(logits, k.mul(r, n_experts), F32), k.index(out, k.mul(r, 2 * top_k), F32)
        if gating == 1:
            most, total = k.var(minus_inf, F32), k.var(0.0, F32)
            k.loop(0, n_experts, 1, lambda i: most.set(k.fmax(most.get(), at(x, i))))

            def exp(i: ir.Value) -> None:
                e = k.exp(k.sub(at(x, i), most.get()))
                put(e, probs, i)
                total.set(k.add(total.get(), e))

            k.loop(0, n_experts, 1, exp)
            gate = lambda i: k.b.fdiv(at(probs, i), total.get())  # noqa: E731
        else:
            gate = lambda i: k.b.fdiv(const(F32, 1.0), k.add(k.exp(k.mul(at(x, i), -1.0)), 1.0))  # noqa: E731

        def gated(i: ir.Value) -> None:
            put(gate(i), probs, i)
            put(at(x, i), left, i)

        k.loop(0, n_experts, 1, gated)
        weights = []
        for j in range(top_k):
            best, pick = k.var(minus_inf, F32), k.var(0)

            def scan(i: ir.Value, best: Var = best, pick: Var = pick) -> None:
                v = at(left, i)
                better = k.b.fcmp_ordered(">", v, best.get())
                best.set(k.select(better, v, best.get()))
                pick.set(k.select(better, i, pick.get()))

            k.loop(0, n_experts, 1, scan)
            put(minus_inf, left, pick.get())
            put(k.convert(pick.get(), F32), y, k.i64(j))
            weights.append(at(probs, pick.get()))
        if normalize:
            total = k.fmax(k.total(weights), MIN_WEIGHT_SUM)
            weights = [k.b.fdiv(w, total) for w in weights]
        for j, w in enumerate(weights):
            put(k.mul(w, scale), y, k.i64(top_k + j))

    k.loop(lo, hi, 1, row)
    k.ret()


def _pairs(
    k: Kernel,
    lo: ir.Value,
    hi: ir.Value,
    top_k: int,
    n_experts: int,
    route: ir.Value,
    body: Callable,
) -> None:
    """``body(f, e)`` for each (token t, slot j), t in ``[lo, hi)``, of a route ``[., 2
    top_k]``: f = t top_k + j, e = the slot's expert id (clamped to the experts)."""

    def token(t: ir.Value) -> None:
        def slot(j: ir.Value) -> None:
            e = k.load(F32, k.index(route, k.add(k.mul(t, 2 * top_k), j), F32), 0, 4)
            e = k.smin(k.smax(k.convert(e, I64), 0), n_experts - 1)
            body(k.add(k.mul(t, top_k), j), e)

        k.loop(0, top_k, 1, slot)

    k.loop(lo, hi, 1, token)


def _build_select_experts(module: Module, n_experts: int, top_k: int, stride: int) -> None:
    """A small step's experts into a grouped matmul's argument blocks, a group per (token,
    slot) pair f: ``weights[f * stride] = table[e]``, e the pair's expert in the route
    ``[count, 2 top_k]``, ``miss(e)`` giving the address where the table holds 0 (an
    expert not prepared yet: the caller prepares it); then ``counter += (pairs, 1)``
    (experts read, calls)."""
    # one call over all the pairs (``f(block)``): it counts what the step reads
    k = module.kernel(f"{module.ir.name}_select_experts", (PTR,))
    rows, *arrays = k.words(k.args[0], 1 + ARRAYS["select_experts"])
    weights, route, table, counter, miss = (k.pointer(a) for a in arrays)

    def pair(f: ir.Value, e: ir.Value) -> None:
        address = k.var(k.load(I64, k.index(table, e, I64), 0, 8))
        unknown = k.b.icmp_signed("==", address.get(), k.i64(0))
        k.branch(unknown, lambda: address.set(k.call_at(miss, I64, e)))
        k.store(address.get(), k.index(weights, k.mul(f, stride), I64), 0, 8)

    _pairs(k, k.i64(0), rows, top_k, n_experts, route, pair)
    for i, step in enumerate((k.mul(rows, top_k), k.i64(1))):
        word = k.index(counter, i, I64)
        k.store(k.add(k.load(I64, word, 0, 8), step), word, 0, 8)
    k.ret()


def _build_expert_bias(module: Module, width: int, n_experts: int, top_k: int) -> None:
    """A small step's expert biases: row f of ``out`` ([count top_k, width]) += row e of
    ``bias`` ([n_experts, width]), e pair f's expert in the route ``[count, 2 top_k]``."""
    k, lo, hi, (out, bias, route) = _kernel(module, "expert_bias")

    def pair(f: ir.Value, e: ir.Value) -> None:
        base, source = k.mul(f, width), k.mul(e, width)

        def add(i: ir.Value, w: int) -> None:
            at = k.add(base, i)
            _put(k, k.add(_floats(k, out, at, w), _floats(k, bias, k.add(source, i), w)), out, at)

        k.lanes(k.i64(0), k.i64(width), k.target.lanes, add)

    _pairs(k, lo, hi, top_k, n_experts, route, pair)
    k.ret()


def _build_columns(
    module: Module, width: int, src_stride: int, dst_stride: int, gather: bool
) -> None:
    """Per row: ``width`` columns of ``x`` (rows ``src_stride`` floats apart) into ``out``
    (rows ``dst_stride`` apart): the next ones from ``x``'s address (a split's copy: the
    address is its first column's), or with ``gather`` those an int32 ``index`` names
    (``gather_cols``: its index is a permutation, ``gptq_awq.input_perm``'s argsort)."""
    k, lo, hi, (out, x, index) = _kernel(module, "columns")

    def row(r: ir.Value) -> None:
        src, dst = k.mul(r, src_stride), k.mul(r, dst_stride)
        if gather:

            def column(j: ir.Value) -> None:
                at = k.convert(k.load(I32, k.index(index, j, I32), align=4), I64)
                value = k.load(F32, k.index(x, k.add(src, at), F32), align=4)
                _put(k, value, out, k.add(dst, j))

            k.loop(0, width, 1, column)
        else:
            _copy(k, out, dst, x, src, width)

    k.loop(lo, hi, 1, row)
    k.ret()


def _build_rows(module: Module, width: int, src_stride: int, dst_stride: int, n_src: int) -> None:
    """Per output row ``r``: ``width`` floats of ``x``'s row ``index[r]`` (int64; rows
    ``src_stride`` floats apart, ``n_src`` of them) into ``out``'s row ``r`` (``dst_stride``
    apart): the embedding lookup (``x`` the dense table, ``index`` the token ids) and
    ``select_rows`` (``x`` the hidden states, ``index`` the rows whose logits are wanted).
    The ids are checked on the host; an index outside ``[0, n_src)`` reads row ``n_src - 1``
    (unsigned min) rather than memory outside ``x``."""
    k, lo, hi, (out, x, index) = _kernel(module, "rows")

    def row(r: ir.Value) -> None:
        at = k.load(I64, k.index(index, r, I64), align=8)
        last = k.i64(n_src - 1)
        at = k.select(k.b.icmp_unsigned("<", at, last), at, last)
        _copy(k, out, k.mul(r, dst_stride), x, k.mul(at, src_stride), width)

    k.loop(lo, hi, 1, row)
    k.ret()


def _build_rms_norm(module: Module, width: int, eps: float) -> None:
    """Per row: out = x / sqrt(mean(x^2) + eps) * w (the reference's order of operations;
    the squares summed in ``SUM_LANES`` lanes, the scaling at the backend's width)."""
    k, lo, hi, (out, x, weight) = _kernel(module, "rms_norm")
    lanes, d = k.target.lanes, k.i64(width)

    def row(r: ir.Value) -> None:
        base = k.mul(r, d)
        acc = {w: k.var(const(vec(F32, w), 0.0)) for w in (SUM_LANES, 1)}

        def square(i: ir.Value, w: int) -> None:
            v = _floats(k, x, k.add(base, i), w)
            acc[w].set(k.add(acc[w].get(), k.mul(v, v)))

        k.lanes(k.i64(0), d, SUM_LANES, square)
        tail = k.b.extract_element(acc[1].get(), const(I32, 0))
        total = k.call(
            f"llvm.vector.reduce.fadd.v{SUM_LANES}f32",
            F32,
            tail,
            acc[SUM_LANES].get(),
            flags=("reassoc",),
        )
        ms = k.add(k.b.fdiv(total, const(F32, float(width))), eps)
        inv = k.b.fdiv(const(F32, 1.0), k.call("llvm.sqrt.f32", F32, ms))

        def scale(i: ir.Value, w: int) -> None:
            at = k.add(base, i)
            y = k.mul(k.mul(_floats(k, x, at, w), k.splat(inv, w)), _floats(k, weight, i, w))
            _put(k, y, out, at)

        k.lanes(k.i64(0), d, lanes, scale)

    k.loop(lo, hi, 1, row)
    k.ret()


def _build_rope(
    module: Module, n_heads: int, head_dim: int, rope_dim: int, neox: bool, stride: int
) -> None:
    """Rotate each head's first ``rope_dim`` dims by the token's angles; NeoX pairs
    (i, i + rope_dim/2), the GGUF llama layout pairs (2i, 2i + 1); the rest is copied.
    The rows of ``x`` are ``stride`` floats apart (a column range of a wider buffer)."""
    k, lo, hi, (out, x, pos, cos, sin) = _kernel(module, "rope")
    lanes, half = k.target.lanes, rope_dim // 2

    def token(t: ir.Value) -> None:
        angle0 = k.mul(k.load(I64, k.index(pos, t, I64), align=8), half)

        def head(h: ir.Value) -> None:
            base = k.mul(k.add(k.mul(t, n_heads), h), head_dim)
            src = k.add(k.mul(t, stride), k.mul(h, head_dim))

            def pair(i: ir.Value, w: int) -> None:
                c = _floats(k, cos, k.add(angle0, i), w)
                s = _floats(k, sin, k.add(angle0, i), w)
                if neox:
                    xa = _floats(k, x, k.add(src, i), w)
                    xb = _floats(k, x, k.add(k.add(src, half), i), w)
                else:
                    both = _floats(k, x, k.add(src, k.mul(i, 2)), 2 * w)
                    xa, xb = (k.shuffle(both, range(o, 2 * w, 2)) for o in (0, 1))
                ya = k.sub(k.mul(xa, c), k.mul(xb, s))
                yb = k.add(k.mul(xb, c), k.mul(xa, s))
                if neox:
                    _put(k, ya, out, k.add(base, i))
                    _put(k, yb, out, k.add(k.add(base, half), i))
                else:
                    mix = [j // 2 + (j % 2) * w for j in range(2 * w)]
                    _put(k, k.shuffle(ya, mix, yb), out, k.add(base, k.mul(i, 2)))

            k.lanes(k.i64(0), k.i64(half), lanes, pair)
            if rope_dim < head_dim:
                k.lanes(
                    k.i64(rope_dim),
                    k.i64(head_dim),
                    lanes,
                    lambda i, w: _put(k, _floats(k, x, k.add(src, i), w), out, k.add(base, i)),
                )

        k.loop(0, n_heads, 1, head)

    k.loop(lo, hi, 1, token)
    k.ret()


def _row_sum(
    k: Kernel, base: ir.Value, width: int, term: Callable[[ir.Value], ir.Value]
) -> ir.Value:
    """The sum over one row of ``term(values)``, in ``SUM_LANES`` lanes then a 1-lane tail
    (the order RMSNorm sums in, whatever the backend's width)."""
    acc = {w: k.var(const(vec(F32, w), 0.0)) for w in (SUM_LANES, 1)}

    def step(i: ir.Value, w: int) -> None:
        acc[w].set(k.add(acc[w].get(), term(k.add(base, i), w)))

    k.lanes(k.i64(0), k.i64(width), SUM_LANES, step)
    tail = k.b.extract_element(acc[1].get(), const(I32, 0))
    return k.call(
        f"llvm.vector.reduce.fadd.v{SUM_LANES}f32",
        F32,
        tail,
        acc[SUM_LANES].get(),
        flags=("reassoc",),
    )


def _build_layer_norm(module: Module, width: int, eps: float) -> None:
    """Per row: out = (x - mean) / sqrt(var + eps) * w + b (var: the biased variance, as
    torch's LayerNorm; two passes over the row, so no cancellation of large means)."""
    k, lo, hi, (out, x, weight, bias) = _kernel(module, "layer_norm")
    lanes, n = k.target.lanes, float(width)

    def row(r: ir.Value) -> None:
        base = k.mul(r, k.i64(width))
        mean = k.b.fdiv(_row_sum(k, base, width, lambda at, w: _floats(k, x, at, w)), const(F32, n))

        def square(at: ir.Value, w: int) -> ir.Value:
            d = k.sub(_floats(k, x, at, w), k.splat(mean, w))
            return k.mul(d, d)

        var = k.b.fdiv(_row_sum(k, base, width, square), const(F32, n))
        inv = k.b.fdiv(const(F32, 1.0), k.call("llvm.sqrt.f32", F32, k.add(var, eps)))

        def scale(i: ir.Value, w: int) -> None:
            at = k.add(base, i)
            d = k.mul(k.sub(_floats(k, x, at, w), k.splat(mean, w)), k.splat(inv, w))
            _put(k, k.fma(d, _floats(k, weight, i, w), _floats(k, bias, i, w)), out, at)

        k.lanes(k.i64(0), k.i64(width), lanes, scale)

    k.loop(lo, hi, 1, row)
    k.ret()


# erf(z) = 1 - t (a1 + t (a2 + ...)) exp(-z^2), t = 1 / (1 + p z), z >= 0: Abramowitz and
# Stegun 7.1.26, absolute error below 1.5e-7 (GELU's error is below 1e-7 |x|)
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(k: Kernel, z: ir.Value) -> ir.Value:
    ty = z.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    a = k.call(f"llvm.fabs.{suffix}", ty, z)
    t = k.b.fdiv(const(ty, 1.0), k.add(k.mul(a, _ERF_P), 1.0))
    poly = const(ty, _ERF_A[-1])
    for c in reversed(_ERF_A[:-1]):
        poly = k.add(k.mul(poly, t), c)
    e = k.exp(k.sub(const(ty, 0.0), k.mul(a, a)))
    y = k.sub(const(ty, 1.0), k.mul(k.mul(poly, t), e))
    return k.call(f"llvm.copysign.{suffix}", ty, y, z)


def _build_gelu(module: Module) -> None:
    """out = x / 2 (1 + erf(x / sqrt 2)) (BERT's exact GELU)."""
    k, lo, hi, (out, x) = _kernel(module, "gelu")

    def body(i: ir.Value, w: int) -> None:
        v = _floats(k, x, i, w)
        y = k.mul(k.mul(v, 0.5), k.add(_erf(k, k.mul(v, 1.0 / math.sqrt(2.0))), 1.0))
        _put(k, y, out, i)

    k.lanes(lo, hi, k.target.lanes, body)
    k.ret()


def _build_l2_norm(module: Module, width: int) -> None:
    """Per row: out = x / max(|x|, 1e-12) (torch's ``F.normalize``, as sentence-transformers'
    Normalize module)."""
    k, lo, hi, (out, x) = _kernel(module, "l2_norm")

    def row(r: ir.Value) -> None:
        base = k.mul(r, k.i64(width))
        total = _row_sum(
            k, base, width, lambda at, w: k.mul(_floats(k, x, at, w), _floats(k, x, at, w))
        )
        norm = k.call(
            "llvm.maxnum.f32", F32, k.call("llvm.sqrt.f32", F32, total), const(F32, 1e-12)
        )
        inv = k.b.fdiv(const(F32, 1.0), norm)
        k.lanes(
            k.i64(0),
            k.i64(width),
            k.target.lanes,
            lambda i, w: _put(
                k, k.mul(_floats(k, x, k.add(base, i), w), k.splat(inv, w)), out, k.add(base, i)
            ),
        )

    k.loop(lo, hi, 1, row)
    k.ret()


def _sequence(k: Kernel, last: ir.Value, s: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Sequence ``s``'s first and last rows of the step: sequences lie one after the other,
    and ``last`` holds each one's last row (int64), so it starts after the previous one's."""
    end = k.load(I64, k.index(last, s, I64), align=8)
    prev = k.load(I64, k.index(last, k.smax(k.sub(s, 1), k.i64(0)), I64), align=8)
    start = k.select(k.b.icmp_signed("==", s, k.i64(0)), k.i64(0), k.add(prev, 1))
    return start, end


def _build_pool(module: Module, width: int, mode: int) -> None:
    """Per sequence: the mean of its rows (``POOL_MEAN``), its first row (``POOL_CLS``) or
    its last (``POOL_LAST``)."""
    k, lo, hi, (out, x, last) = _kernel(module, "pool")
    lanes, d = k.target.lanes, k.i64(width)

    def seq(s: ir.Value) -> None:
        start, end = _sequence(k, last, s)
        dst = k.mul(s, d)
        if mode != POOL_MEAN:
            src = k.mul(start if mode == POOL_CLS else end, d)
            k.lanes(
                k.i64(0),
                d,
                lanes,
                lambda i, w: _put(k, _floats(k, x, k.add(src, i), w), out, k.add(dst, i)),
            )
            return
        k.lanes(
            k.i64(0), d, lanes, lambda i, w: _put(k, const(vec(F32, w), 0.0), out, k.add(dst, i))
        )

        def add_row(t: ir.Value) -> None:
            src = k.mul(t, d)

            def acc(i: ir.Value, w: int) -> None:
                at = k.add(dst, i)
                _put(k, k.add(_floats(k, out, at, w), _floats(k, x, k.add(src, i), w)), out, at)

            k.lanes(k.i64(0), d, lanes, acc)

        k.loop(start, k.add(end, 1), 1, add_row)
        n = k.convert(k.add(k.sub(end, start), 1), F32)
        inv = k.b.fdiv(const(F32, 1.0), n)
        k.lanes(
            k.i64(0),
            d,
            lanes,
            lambda i, w: _put(
                k, k.mul(_floats(k, out, k.add(dst, i), w), k.splat(inv, w)), out, k.add(dst, i)
            ),
        )

    k.loop(lo, hi, 1, seq)
    k.ret()


def _sequence_of(k: Kernel, last: ir.Value, t: ir.Value, first: ir.Value) -> ir.Value:
    """The sequence of row ``t``: the first ``s >= first`` whose last row is at or after
    ``t`` (``last`` increases and its final entry is the step's last row, so the scan
    stops within the step's sequences)."""
    b = k.b
    pre = b.block
    head, step, end = (b.append_basic_block() for _ in range(3))
    b.branch(head)
    b.position_at_end(head)
    s = b.phi(I64)
    s.add_incoming(first, pre)
    before = k.lt(k.load(I64, k.index(last, s, I64), align=8), t)
    b.cbranch(before, step, end)
    b.position_at_end(step)
    s.add_incoming(k.add(s, 1), step)
    b.branch(head)
    b.position_at_end(end)
    return s


def _transposed_sums(k: Kernel, vectors: list[ir.Value]) -> ir.Value:
    """One vector of ``n`` lanes whose lane ``i`` is the sum of ``vectors[i]``'s ``n``
    lanes (``n`` a power of two): pairs of vectors are folded by shuffles, halving the
    count while each vector holds the partial sums of twice as many of them."""
    n = len(vectors)
    g = 1  # each vector holds g of the sums, lane l: part l // g of sum l % g
    while len(vectors) > 1:
        first, second = [], []
        for lane in range(n):
            key, part = lane % (2 * g), lane // (2 * g)
            src = (0 if key < g else n) + 2 * part * g + key % g
            first.append(src)
            second.append(src + g)
        vectors = [
            k.add(k.shuffle(a, first, b), k.shuffle(a, second, b))
            for a, b in zip(vectors[::2], vectors[1::2], strict=True)
        ]
        g *= 2
    return vectors[0]


# Query rows of one sequence that encoder attention computes together: each key's and
# value's slice is loaded once for both (a sequence's keys and values of one head, 64 KB at
# 256 tokens of head_dim 32, stream from L2 for every row), with each row's sums in the
# order one row alone takes.
ATTENTION_ROWS = 2
# Accumulator registers the weighted sum of the values keeps live: the head's slices are
# taken in groups that fit them, a pass over the keys each (AVX2 has 16 registers).
ATTENTION_ACCS = 8


def _build_encoder_attention(
    module: Module, n_heads: int, head_dim: int, scale: float, max_keys: int
) -> None:
    """Bidirectional attention: each query of a sequence attends to every key of that
    sequence (no mask; sequences of different lengths packed one after another, no
    padding), over the query rows ``[lo, hi)``. Per head, ``ATTENTION_ROWS`` rows at a time
    where they are of one sequence (else one): the queries' slices stay in registers while
    the scores of the sequence's keys go to a buffer of ``max_keys`` a row (the step's rows:
    no sequence is longer); then their softmax weights, ``lanes`` at a time, and the weighted
    sum of the values, accumulated in registers and stored once. A row's every sum is taken
    in the same order whether it is computed alone or beside another (bitwise the same)."""
    k, lo, hi, (out, q, key, val, last) = _kernel(module, "encoder_attention")
    lanes, width = k.target.lanes, n_heads * head_dim
    whole = head_dim - head_dim % lanes
    pieces = [(o, lanes) for o in range(0, whole, lanes)] + [(o, 1) for o in range(whole, head_dim)]
    scores = k.stack(4 * max_keys * ATTENTION_ROWS)  # row r's at r * max_keys
    seq = k.var(k.i64(0))  # rows come in order: a row's sequence is at or after the last one's
    done = k.var(k.i64(0))  # the rows before it are computed (the second of a pair is)

    def lane_sum(v: ir.Value, w: int) -> ir.Value:
        if w == 1:
            return k.b.extract_element(v, const(I32, 0))
        return k.call(
            f"llvm.vector.reduce.fadd.v{w}f32", F32, const(F32, 0.0), v, flags=("reassoc",)
        )

    def slices(array: ir.Value, row: ir.Value, h: ir.Value) -> list[ir.Value]:
        at = k.add(k.mul(row, k.i64(width)), k.mul(h, k.i64(head_dim)))
        return [_floats(k, array, k.add(at, o), w) for o, w in pieces]

    def rows(h: ir.Value, t: ir.Value, m: int, start: ir.Value, end: ir.Value) -> None:
        """Query rows t .. t + m - 1 of the sequence [start, end]."""
        stop, n = k.add(end, 1), k.sub(k.add(end, 1), start)
        ts = [k.add(t, r) for r in range(m)]
        qs = [slices(q, row, h) for row in ts]
        # each row's largest score: a lane's own in score_block (a running vector max: a
        # reduction per block is a serial chain of NaN-aware scalar maxes, which cost as
        # much as the softmax), folded once the scores are done (max is exact: the same)
        best = [k.var(const(F32, -3.0e38), F32) for _ in range(m)]
        most = [k.var(const(vec(F32, lanes), -3.0e38)) for _ in range(m)]

        def at(r: int, j: ir.Value) -> ir.Value:  # key j's score of row r in the buffer
            return k.add(k.sub(j, start), r * max_keys)

        def dot(qr: list[ir.Value], kv: list[ir.Value]) -> dict[int, ir.Value]:
            acc: dict[int, ir.Value] = {}
            for (_, w), qv, kp in zip(pieces, qr, kv, strict=True):
                acc[w] = k.fma(qv, kp, acc[w]) if w in acc else k.mul(qv, kp)
            return acc

        def score(j: ir.Value) -> None:
            kv = slices(key, j, h)
            for r in range(m):
                acc = dot(qs[r], kv)
                sc = k.mul(k.total([lane_sum(v, w) for w, v in acc.items()]), scale)
                _put(k, sc, scores, at(r, j))
                best[r].set(k.call("llvm.maxnum.f32", F32, best[r].get(), sc))

        def score_block(j: ir.Value) -> None:  # keys j .. j + lanes - 1
            dots: list[list[ir.Value]] = [[] for _ in range(m)]
            for b in range(lanes):
                kv = slices(key, k.add(j, b), h)
                for r in range(m):
                    (acc,) = dot(qs[r], kv).values()  # (whole vectors: one width)
                    dots[r].append(acc)
            for r in range(m):
                sc = k.mul(_transposed_sums(k, dots[r]), k.splat(scale, lanes))
                _put(k, sc, scores, at(r, j))
                most[r].set(k.call(f"llvm.maxnum.v{lanes}f32", sc.type, most[r].get(), sc))

        # lanes keys at a time where the head is whole vectors (one sum of lanes dot
        # products per lanes keys), then key by key
        rest = start
        if whole == head_dim and lanes > 1:
            rest = k.loop(start, stop, lanes, score_block)
        k.loop(rest, stop, 1, score)
        if whole == head_dim and lanes > 1:
            for r in range(m):
                v = k.call(f"llvm.vector.reduce.fmax.v{lanes}f32", F32, most[r].get())
                best[r].set(k.call("llvm.maxnum.f32", F32, best[r].get(), v))
        inv = []
        for r in range(m):
            sums = {w: k.var(const(vec(F32, w), 0.0)) for w in (lanes, 1)}

            def weigh(i: ir.Value, w: int, r: int = r, sums: dict = sums) -> None:
                i = k.add(i, r * max_keys)
                p = k.exp(k.sub(_floats(k, scores, i, w), k.splat(best[r].get(), w)))
                _put(k, p, scores, i)
                sums[w].set(k.add(sums[w].get(), p))

            k.lanes(k.i64(0), n, lanes, weigh)
            total = k.total([lane_sum(v.get(), w) for w, v in sums.items()])
            inv.append(k.b.fdiv(const(F32, 1.0), total))
        # the head's slices in groups whose accumulators fit the registers, a pass over
        # the values each; per row two sets of sums, of the even and the odd keys: two
        # chains of FMAs, not one
        group = max(1, ATTENTION_ACCS // (2 * m))
        for g in range(0, len(pieces), group):
            part = pieces[g : g + group]
            accs = [[[k.var(const(vec(F32, w), 0.0)) for _, w in part] for _ in range(m)]
                    for _ in range(2)]  # fmt: skip

            def gather(j: ir.Value, sets: list, part: list = part) -> None:
                ps = [k.load(F32, k.index(scores, at(r, j), F32), align=4) for r in range(m)]
                va = k.add(k.mul(j, k.i64(width)), k.mul(h, k.i64(head_dim)))
                for i, (o, w) in enumerate(part):
                    vv = _floats(k, val, k.add(va, o), w)
                    for r in range(m):
                        a = sets[r][i]
                        a.set(k.fma(k.splat(ps[r], w), vv, a.get()))

            def gather_pair(j: ir.Value, accs: list = accs, gather: Callable = gather) -> None:
                gather(j, accs[0])
                gather(k.add(j, 1), accs[1])

            rest = k.loop(start, stop, 2, gather_pair)
            k.loop(rest, stop, 1, lambda j, accs=accs, gather=gather: gather(j, accs[0]))
            for r in range(m):
                qa = k.add(k.mul(ts[r], k.i64(width)), k.mul(h, k.i64(head_dim)))
                for (o, w), a, b in zip(part, accs[0][r], accs[1][r], strict=True):
                    y = k.mul(k.add(a.get(), b.get()), k.splat(inv[r], w))
                    _put(k, y, out, k.add(qa, o))

    def head(h: ir.Value) -> None:
        seq.set(k.i64(0))
        done.set(lo)

        def token(t: ir.Value) -> None:
            def compute() -> None:
                seq.set(_sequence_of(k, last, t, seq.get()))
                start, end = _sequence(k, last, seq.get())
                step = ATTENTION_ROWS
                # the rows t .. t + step - 1 are of one sequence and in [lo, hi)
                together = k.b.and_(k.lt(k.add(t, step - 1), hi), k.lt(k.add(t, step - 2), end))

                def many() -> None:
                    rows(h, t, step, start, end)
                    done.set(k.add(t, step))

                def one() -> None:
                    rows(h, t, 1, start, end)
                    done.set(k.add(t, 1))

                k.branch(together, many, one)

            k.branch(k.ge(t, done.get()), compute)

        k.loop(lo, hi, 1, token)

    # head by head: the keys and values of one head stay in the caches across the rows
    k.loop(0, n_heads, 1, head)
    k.ret()


PROGRAMS = {
    "add": Program("ew_add", _build_add),
    "mul": Program("ew_mul", _build_mul),
    "scale": Program("ew_scale", _build_scale),
    "act": Program("ew_act", _build_act),
    "gated": Program("ew_gated", _build_gated),
    "bias": Program("ew_bias", _build_bias),
    "combine": Program("ew_combine", _build_combine),
    "moe_route": Program("ew_moe_route", _build_moe_route),
    "select_experts": Program("ew_select_experts", _build_select_experts),
    "expert_bias": Program("ew_expert_bias", _build_expert_bias),
    "columns": Program("ew_columns", _build_columns),
    "rows": Program("ew_rows", _build_rows),
    "rms_norm": Program("ew_rms_norm", _build_rms_norm),
    "rope": Program("ew_rope", _build_rope),
    "layer_norm": Program("ew_layer_norm", _build_layer_norm),
    "gelu": Program("ew_gelu", _build_gelu),
    "l2_norm": Program("ew_l2_norm", _build_l2_norm),
    "pool": Program("ew_pool", _build_pool),
    "encoder_attention": Program("ew_encoder_attention", _build_encoder_attention),
}
