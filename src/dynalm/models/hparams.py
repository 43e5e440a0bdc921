"""Hyper-parameters of a transformer read from GGUF metadata (``{arch}.*`` keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dynalm.errors import ModelFormatError, UnsupportedModel


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


def read_hparams(metadata: dict[str, Any], n_vocab: int) -> HParams:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError("GGUF metadata has no general.architecture")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    def scalar(value: Any) -> Any:
        # Some files store per-layer arrays (e.g. head counts); we need them uniform.
        if hasattr(value, "__len__") and not isinstance(value, str):
            values = set(int(v) for v in value)
            if len(values) != 1:
                raise UnsupportedModel(
                    f"per-layer varying hyper-parameters are not supported: {value}"
                )
            return values.pop()
        return value

    d_model = int(get("embedding_length"))
    n_heads = int(scalar(get("attention.head_count")))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModel(
            f"key length {head_dim} != value length {value_dim} is not supported"
        )

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling in ("none", None) or factor == 1.0:
        rope_scale = 1.0
    elif scaling == "linear":
        rope_scale = factor
    else:
        raise UnsupportedModel(f"rope scaling type '{scaling}' is not supported yet")

    eps = metadata.get(f"{arch}.attention.layer_norm_rms_epsilon")
    if eps is None:
        eps = get("attention.layer_norm_epsilon")
    hp = HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=int(get("context_length")),
        d_model=d_model,
        n_layers=int(get("block_count")),
        d_ff=int(scalar(get("feed_forward_length"))),
        n_heads=n_heads,
        n_kv_heads=int(scalar(get("attention.head_count_kv", n_heads))),
        head_dim=head_dim,
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        norm_eps=float(eps),
        sliding_window=int(metadata.get(f"{arch}.attention.sliding_window", 0) or 0),
    )
    if hp.n_heads % hp.n_kv_heads:
        raise ModelFormatError(f"{hp.n_heads} heads is not a multiple of {hp.n_kv_heads} kv heads")
    return hp


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
