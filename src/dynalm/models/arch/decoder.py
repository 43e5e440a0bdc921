"""The pre-norm decoder-only transformer, written once; families differ by traits.

A builder is declarative: hyper-parameters and tensor types in, a DynaIR graph
out, nothing executed. Tensor names follow GGUF (llama.cpp) conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynalm.ir.builder import GraphBuilder
from dynalm.ir.graph import Graph, TensorType, Value, Weight
from dynalm.models.hparams import HParams


@dataclass(frozen=True)
class Family:
    """What sets one architecture apart from the plain llama decoder."""

    neox_rope: bool = False  # rotate (x[i], x[i+d/2]) instead of adjacent pairs
    activation: str = "silu"  # gate activation of the gated FFN: silu | gelu_tanh
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (gemma)
    sandwich_norms: bool = False  # extra norms after attention and FFN (gemma2/3)
    qk_norm: bool = False  # RMSNorm over each head of q and k (gemma3, qwen3)
    swa_period: int = 0  # every swa_period-th layer is global, the others local (gemma3: 6)
    local_rope_base: float = 10000.0  # rope base of the sliding-window layers


def build_decoder(
    name: str, family: Family, hp: HParams, weight_types: dict[str, TensorType]
) -> Graph:
    g = GraphBuilder(name, weight_types)
    tokens = g.input("tokens", "i32", ("T",))
    positions = g.input("positions", "i32", ("T",))
    logit_rows = g.input("logit_rows", "i32", ("S",))

    def opt(name: str) -> Weight | None:
        return g.weight(name) if g.has_weight(name) else None

    def norm(x: Value, weight: str) -> Value:
        return g.op("rms_norm", x, weights=(g.weight(weight),), eps=hp.norm_eps)

    def matmul(x: Value, weight: str, rows: int, bias: str = "") -> Value:
        w = g.weight(weight, rows, None)
        return g.op("matmul", x, weights=(w, opt(bias) if bias else None))

    x = g.op("embed", tokens, weights=(g.weight("token_embd.weight", hp.n_vocab, None),))
    if family.embed_scale:
        x = g.op("scale", x, factor=math.sqrt(hp.d_model))
    freq_factors = opt("rope_freqs.weight")

    for i in range(hp.n_layers):
        p = f"blk.{i}."
        local = family.swa_period > 0 and (i + 1) % family.swa_period != 0
        h = norm(x, p + "attn_norm.weight")
        q, k, v = (
            matmul(h, f"{p}attn_{n}.weight", heads * hp.head_dim, f"{p}attn_{n}.bias")
            for n, heads in zip("qkv", (hp.n_heads, hp.n_kv_heads, hp.n_kv_heads), strict=True)
        )
        if family.qk_norm:
            head = dict(eps=hp.norm_eps, head_dim=hp.head_dim)
            q = g.op("head_rms_norm", q, weights=(g.weight(p + "attn_q_norm.weight"),), **head)
            k = g.op("head_rms_norm", k, weights=(g.weight(p + "attn_k_norm.weight"),), **head)
        rope = dict(
            head_dim=hp.head_dim,
            rope_dim=hp.rope_dim,
            base=family.local_rope_base if local else hp.rope_base,
            neox=family.neox_rope,
            scale=1.0 if local else hp.rope_scale,
        )
        q = g.op("rope", q, positions, weights=(freq_factors,), **rope)
        k = g.op("rope", k, positions, weights=(freq_factors,), **rope)
        a = g.op(
            "attention",
            q,
            k,
            v,
            layer=i,
            n_heads=hp.n_heads,
            n_kv_heads=hp.n_kv_heads,
            head_dim=hp.head_dim,
            scale=1.0 / math.sqrt(hp.head_dim),
            window=hp.sliding_window if local else 0,
        )
        a = matmul(a, p + "attn_output.weight", hp.d_model)
        if family.sandwich_norms:
            a = norm(a, p + "post_attention_norm.weight")
        x = g.op("add", x, a)

        h = norm(x, p + "ffn_norm.weight")
        gate = matmul(h, p + "ffn_gate.weight", hp.d_ff)
        gate = g.op(family.activation, gate)
        up = matmul(h, p + "ffn_up.weight", hp.d_ff)
        f = matmul(g.op("mul", gate, up), p + "ffn_down.weight", hp.d_model)
        if family.sandwich_norms:
            f = norm(f, p + "post_ffw_norm.weight")
        x = g.op("add", x, f)

    x = norm(g.op("select_rows", x, logit_rows), "output_norm.weight")
    head = "output.weight" if g.has_weight("output.weight") else "token_embd.weight"
    return g.finish(logits=matmul(x, head, hp.n_vocab))
