"""Hyper-parameters of a transformer read from GGUF metadata (``{arch}.*`` keys), checked
against each other and against the shapes of the tensors they describe.

Kernels are bound from these numbers and index buffers with them, so nothing here may
be trusted as written: a rope dimension larger than the head, a head count that does not
divide the q rows or a block count that disagrees with the layers present would make a
kernel read or write past a buffer. Every value is checked before any kernel exists, and
an error names the key, its value and what it contradicts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from dynalm.errors import ModelFormatError, UnsupportedModel, show
from dynalm.models.metadata import bad, integer, number, text


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    d_model: int
    n_layers: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_scale: float  # linear position scaling: positions are divided by this
    norm_eps: float
    sliding_window: int  # 0 = none
    # "none", "linear", or "yarn" (rope_scale its factor: a family applies it with rope's
    # YaRN attributes, or the model is refused, `models.arch.build_graph`)
    rope_scaling: str = "none"


_LAYER = re.compile(r"blk\.(\d+)\.")
# The largest vocabulary read: 8 x the largest of a released model (Gemma 3's 262,144). The
# tokenizer's tables cost ~300 bytes a token before the memory plan runs (a vocabulary
# padded to 30M rows took 10 GB), so the count is refused before any table is built: here
# (the embedding's rows), by the GGUF reader (a string array) and for tokenizer.json.
MAX_VOCAB = 1 << 21


def _rows(tensors: dict[str, tuple[int, ...]], name: str) -> int | None:
    """Rows (outermost dimension) of a 2-D tensor, None when absent."""
    shape = tensors.get(name)
    if shape is None:
        return None
    if len(shape) != 2:
        raise ModelFormatError(f"tensor {name!r} has shape {list(shape)}, expected 2 dimensions")
    return shape[0]


def read_hparams(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> HParams:
    """The hyper-parameters of a model whose tensor shapes (numpy order) are ``tensors``."""
    arch = text(metadata, "general.architecture")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    if "token_embd.weight" not in tensors:
        raise ModelFormatError("the file has no token_embd.weight tensor")
    n_vocab = _rows(tensors, "token_embd.weight")
    if n_vocab > MAX_VOCAB:
        raise ModelFormatError(
            f"token_embd.weight has {n_vocab} rows: a vocabulary of more than {MAX_VOCAB} "
            "tokens is refused"
        )
    width = tensors["token_embd.weight"][1]
    d_model = integer(metadata, key("embedding_length"), lo=1)
    if d_model != width:
        raise bad(key("embedding_length"), d_model, f"the width of token_embd.weight ({width})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != n_vocab:
        raise ModelFormatError(
            f"token_embd.weight has {n_vocab} rows but tokenizer.ggml.tokens has "
            f"{len(tokens)} tokens"
        )
    if key("vocab_size") in metadata:
        integer(metadata, key("vocab_size"), lo=n_vocab, hi=n_vocab)

    n_layers = integer(metadata, key("block_count"), lo=1)
    layers = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    if len(layers) != n_layers or layers != set(range(n_layers)):
        found = f"layers {min(layers)} to {max(layers)}" if layers else "no layers"
        raise ModelFormatError(
            f"{key('block_count')} = {n_layers} but the tensors are of {found} "
            f"({len(layers)} layers)"
        )

    n_heads = integer(metadata, key("attention.head_count"), lo=1, n_layers=n_layers)
    n_kv_heads = integer(
        metadata, key("attention.head_count_kv"), n_heads, lo=1, hi=n_heads, n_layers=n_layers
    )
    if n_heads % n_kv_heads:
        raise bad(
            key("attention.head_count_kv"),
            n_kv_heads,
            f"a divisor of {key('attention.head_count')} ({n_heads})",
        )
    if key("attention.key_length") in metadata:
        head_dim = integer(metadata, key("attention.key_length"), lo=1)
    elif d_model % n_heads:
        raise bad(key("attention.head_count"), n_heads, f"a divisor of the width {d_model}")
    else:
        head_dim = d_model // n_heads
    integer(metadata, key("attention.value_length"), head_dim, lo=head_dim, hi=head_dim)
    for name, heads, count in (
        ("blk.0.attn_q.weight", n_heads, "head_count"),
        ("blk.0.attn_k.weight", n_kv_heads, "head_count_kv"),
        ("blk.0.attn_v.weight", n_kv_heads, "head_count_kv"),
    ):
        rows = _rows(tensors, name)
        if rows is not None and rows != heads * head_dim:
            raise ModelFormatError(
                f"{name} has {rows} rows but {key('attention.' + count)} = {heads} heads "
                f"of {head_dim} need {heads * head_dim}"
            )

    rope_dim = integer(metadata, key("rope.dimension_count"), head_dim, lo=2, hi=head_dim)
    if rope_dim % 2:
        raise bad(key("rope.dimension_count"), rope_dim, "even")
    d_ff = integer(metadata, key("feed_forward_length"), lo=1, n_layers=n_layers)
    rows = _rows(tensors, "blk.0.ffn_up.weight")
    # without ffn_gate, ffn_up may be gate and up stacked (Phi-3's fused gate_up_proj)
    fused = "blk.0.ffn_gate.weight" not in tensors and rows == 2 * d_ff
    if rows is not None and rows != d_ff and not fused:
        raise bad(key("feed_forward_length"), d_ff, f"the rows of blk.0.ffn_up.weight ({rows})")

    # a mixture of experts (llama.cpp asserts as much at load): a token's experts are some
    # of the file's; the families' .lum files read the counts, the ops check them against
    # the expert tensors' shapes
    n_experts, used_key = integer(metadata, key("expert_count"), 0), key("expert_used_count")
    if n_experts and used_key not in metadata:
        raise ModelFormatError(
            f"{key('expert_count')} = {n_experts} but the metadata has no {used_key}"
        )
    used = integer(metadata, used_key, 0, n_layers=n_layers)
    if used > n_experts or (n_experts and not used):
        count = f"{key('expert_count')} ({n_experts})"
        none = f"0: no experts ({key('expert_count')} absent or 0)"
        raise bad(used_key, used, f"from 1 to {count}" if n_experts else none)

    scaling = text(metadata, key("rope.scaling.type"), "none")
    factor = metadata.get(key("rope.scaling.factor"), 0)
    # llama.cpp reads a factor of 0 as "not set"
    unset = type(factor) in (int, float) and factor == 0
    factor = 1.0 if unset else number(metadata, key("rope.scaling.factor"))
    if scaling == "none" or factor == 1.0:
        rope_scale = 1.0
    elif scaling in ("linear", "yarn"):
        rope_scale = factor
    else:
        raise UnsupportedModel(f"rope scaling type {show(scaling)} is not supported yet")

    eps_key = key("attention.layer_norm_rms_epsilon")
    if eps_key not in metadata:
        eps_key = key("attention.layer_norm_epsilon")
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=integer(metadata, key("context_length"), lo=1),
        d_model=d_model,
        n_layers=n_layers,
        d_ff=d_ff,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        rope_base=number(metadata, key("rope.freq_base"), 10000.0),
        rope_scale=rope_scale,
        norm_eps=number(metadata, eps_key, hi=1.0),
        sliding_window=integer(metadata, key("attention.sliding_window"), 0),
        rope_scaling=scaling if rope_scale != 1.0 else "none",
    )


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
