"""gpt-oss's Hugging Face directory as llama.cpp's converter writes it (``GptOssModel``),
for `hf_dir`: the config's keys gpt-oss.lum reads, and each layer's experts in the
converter's ``ffn_{gate,up,down}_exps`` layout, ``[expert, out, in]``.

A directory stores a layer's experts in one of two layouts:

* ``save_pretrained``'s (an unquantised model): ``gate_up_proj`` ``[E, d_model, 2 ff]`` and
  ``down_proj`` ``[E, ff, d_model]``, each expert's matrix ``[in, out]``, the gate and up
  columns interleaved (even the gate, odd the up, and so in ``gate_up_proj_bias``);
* the released checkpoints' MXFP4: ``{gate_up,down}_proj_blocks`` ``[E, out, in / 32, 16]``
  (two 4-bit e2m1 indices a byte, element ``2j`` in the low nibble, ``2j + 1`` in the high)
  and ``_scales`` ``[E, out, in / 32]`` (an e8m0 exponent byte, value ``2**(s - 127)``):
  transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``) dequantises them.

ggml's MXFP4 block (GGUF type 39) is the same scale byte and the same 16 indices, the
exponent read as ``2**(e - 128)`` of doubled e2m1 values (so the byte is unchanged) and the
nibbles in Q4_0's order (element ``j`` in byte ``j``'s low nibble, ``j + 16`` in its high):
`mxfp4_rows` moves the nibbles, with no dequantisation. Both layouts are made one expert at a
time, when a route first selects it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dynalm.errors import ModelFormatError, UnsupportedModel, show

BLOCK = 32  # MXFP4 elements per block (one scale byte)
# llama.cpp's graph hard-codes its clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE), as gpt-oss.lum
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# the YaRN fields gpt-oss.lum reads (as the converter's keys); others are refused by name
_YARN_FIELDS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
    "truncate",  # llama.cpp (so gpt-oss.lum) truncates the correction range either way
}


def metadata(config: dict[str, Any], where: Path, arch: str) -> dict[str, Any]:
    """The keys the converter adds for gpt-oss (``set_gguf_parameters``): the sliding window
    and the experts' width; the config's traits gpt-oss.lum fixes are checked."""
    window = config.get("sliding_window")
    if type(window) is not int or window <= 0:
        raise ModelFormatError(f"{where}: sliding_window = {show(window)}, expected a positive int")
    n_layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if types is not None and isinstance(n_layers, int):
        # gpt-oss.lum (as llama.cpp's load_swa_pattern(ml, 2)): layer i slides when i is even
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        if types != want:
            raise UnsupportedModel(
                f"{where}: layer_types {show(types)} is not supported (the even layers "
                "sliding_attention, the odd ones full_attention)"
            )
    for name, value in SWIGLU.items():
        if config.get(name, value) != value:
            raise UnsupportedModel(
                f"{where}: {name} = {show(config[name])} is not supported (gpt-oss's {value}, "
                "which llama.cpp's graph and gpt-oss.lum fix)"
            )
    return {
        f"{arch}.attention.sliding_window": window,
        f"{arch}.expert_feed_forward_length": config.get("intermediate_size"),
    }


def yarn(scaling: dict[str, Any], where: Path, arch: str) -> dict[str, Any]:
    """A YaRN ``rope_scaling`` as the converter's keys (``TextModel.set_gguf_parameters``)."""
    other = sorted(set(scaling) - _YARN_FIELDS)
    if other:
        raise UnsupportedModel(
            f"{where}: YaRN's {', '.join(other)} not supported (gpt-oss.lum reads factor, "
            "beta_fast, beta_slow, original_max_position_embeddings)"
        )
    if "original_max_position_embeddings" not in scaling or "factor" not in scaling:
        raise ModelFormatError(
            f"{where}: YaRN rope scaling {show(scaling)} has no factor or "
            "original_max_position_embeddings"
        )
    meta = {
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.factor": scaling["factor"],
        f"{arch}.rope.scaling.original_context_length": scaling["original_max_position_embeddings"],
    }
    for field in ("beta_fast", "beta_slow"):
        if scaling.get(field) is not None:
            meta[f"{arch}.rope.scaling.yarn_{field}"] = scaling[field]
    return meta


def expert_shapes(config: dict[str, Any], where: Path, packed: bool) -> dict[str, tuple[int, ...]]:
    """Each expert tensor's shape in ``packed`` (MXFP4) or the dense layout, by config.json."""
    dims = {}
    for name in ("num_local_experts", "hidden_size", "intermediate_size"):
        value = config.get(name)
        if type(value) is not int or value <= 0:
            raise ModelFormatError(f"{where}: {name} = {show(value)}, expected a positive int")
        dims[name] = value
    e, d, ff = dims.values()
    shapes = {"gate_up_proj_bias": (e, 2 * ff), "down_proj_bias": (e, d)}
    if not packed:
        return shapes | {"gate_up_proj": (e, d, 2 * ff), "down_proj": (e, ff, d)}
    for name, n in (("hidden_size", d), ("intermediate_size", ff)):
        if n % BLOCK:
            raise ModelFormatError(
                f"{where}: {name} = {n} is not a multiple of MXFP4's block of {BLOCK}"
            )
    return shapes | {
        "gate_up_proj_blocks": (e, 2 * ff, d // BLOCK, BLOCK // 2),
        "gate_up_proj_scales": (e, 2 * ff, d // BLOCK),
        "down_proj_blocks": (e, d, ff // BLOCK, BLOCK // 2),
        "down_proj_scales": (e, d, ff // BLOCK),
    }


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One expert's rows of MXFP4 blocks in the checkpoint's layout (``blocks`` uint8
    ``[N, G, 16]``, ``scales`` uint8 ``[N, G]``) as ggml's, uint8 ``[N, G * 17]``: each block
    its scale byte, then its 32 indices in Q4_0's nibble order."""
    n, g, _ = blocks.shape
    indices = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(n, g, BLOCK)
    out = np.empty((n, g, 1 + BLOCK // 2), np.uint8)
    out[:, :, 0] = scales
    out[:, :, 1:] = indices[:, :, : BLOCK // 2] | (indices[:, :, BLOCK // 2 :] << 4)
    return out.reshape(n, g * (1 + BLOCK // 2))
