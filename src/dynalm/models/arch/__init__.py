"""Architectures: one row of traits per family over the shared decoder builder.

To add a family: name its traits here (see :class:`Family`); if it needs an op the
decoder lacks, add the op to DynaIR and to the device's kernels first.
"""

from __future__ import annotations

from dynalm.errors import UnsupportedModel, show
from dynalm.ir.graph import Graph, TensorType
from dynalm.models.arch.decoder import Family, build_decoder
from dynalm.models.hparams import HParams

# llama covers Llama 2/3, Mistral and SmolLM2. llama.cpp's converter permutes
# llama's q/k rows so that rope rotates adjacent pairs; qwen2 and gemma keep NeoX
# order. Gemma's converter stores RMSNorm weights as (1 + w), so a plain RMSNorm
# on the stored weight is gemma's (1 + w) norm.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(neox_rope=True),
    "gemma3": Family(
        neox_rope=True,
        activation="gelu_tanh",
        embed_scale=True,
        sandwich_norms=True,
        qk_norm=True,
        swa_period=6,
    ),
}


def family_of(arch: str) -> Family:
    if arch not in FAMILIES:
        raise UnsupportedModel(
            f"unknown architecture {show(arch)} (supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[arch]


def build_graph(hp: HParams, weight_types: dict[str, TensorType]) -> Graph:
    return build_decoder(hp.arch, family_of(hp.arch), hp, weight_types)
