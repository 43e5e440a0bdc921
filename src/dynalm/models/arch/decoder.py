"""The pre-norm decoder-only transformer, written once; families differ by traits.

A builder is declarative: hyper-parameters and tensor types in, a DynaIR graph
out, nothing executed. Tensor names follow GGUF (llama.cpp) conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynalm.ir.graph import Graph, GraphBuilder, TensorType
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

    x = g.embed(tokens, "token_embd.weight", rows=hp.n_vocab)
    if family.embed_scale:
        x = g.scale(x, math.sqrt(hp.d_model))
    freq_factors = "rope_freqs.weight" if g.has_weight("rope_freqs.weight") else None

    for i in range(hp.n_layers):
        p = f"blk.{i}."
        local = family.swa_period > 0 and (i + 1) % family.swa_period != 0
        h = g.rms_norm(x, p + "attn_norm.weight", hp.norm_eps)
        q, k, v = (
            g.matmul(
                h,
                f"{p}attn_{n}.weight",
                f"{p}attn_{n}.bias" if g.has_weight(f"{p}attn_{n}.bias") else None,
                rows=heads * hp.head_dim,
            )
            for n, heads in zip("qkv", (hp.n_heads, hp.n_kv_heads, hp.n_kv_heads), strict=True)
        )
        if family.qk_norm:
            q = g.head_rms_norm(q, p + "attn_q_norm.weight", hp.norm_eps, hp.head_dim)
            k = g.head_rms_norm(k, p + "attn_k_norm.weight", hp.norm_eps, hp.head_dim)
        rope = dict(
            head_dim=hp.head_dim,
            rope_dim=hp.rope_dim,
            neox=family.neox_rope,
            base=family.local_rope_base if local else hp.rope_base,
            scale=1.0 if local else hp.rope_scale,
            freq_factors=freq_factors,
        )
        q, k = g.rope(q, positions, **rope), g.rope(k, positions, **rope)
        a = g.attention(
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
        a = g.matmul(a, p + "attn_output.weight", rows=hp.d_model)
        if family.sandwich_norms:
            a = g.rms_norm(a, p + "post_attention_norm.weight", hp.norm_eps)
        x = g.add(x, a)

        h = g.rms_norm(x, p + "ffn_norm.weight", hp.norm_eps)
        gate = g.matmul(h, p + "ffn_gate.weight", rows=hp.d_ff)
        gate = g.silu(gate) if family.activation == "silu" else g.gelu_tanh(gate)
        up = g.matmul(h, p + "ffn_up.weight", rows=hp.d_ff)
        f = g.matmul(g.mul(gate, up), p + "ffn_down.weight", rows=hp.d_model)
        if family.sandwich_norms:
            f = g.rms_norm(f, p + "post_ffw_norm.weight", hp.norm_eps)
        x = g.add(x, f)

    x = g.rms_norm(g.select_rows(x, logit_rows), "output_norm.weight", hp.norm_eps)
    head = "output.weight" if g.has_weight("output.weight") else "token_embd.weight"
    return g.finish(logits=g.matmul(x, head, rows=hp.n_vocab))
