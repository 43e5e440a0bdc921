"""GPTQ and AWQ checkpoints written by the tests, from the formats' documented layouts and
independently of DynaLM's unpacker (``dynalm.models.gptq_awq``).

`quantize` rounds a weight ``W [out, in]`` to 4-bit integers per group of input columns
(asymmetric: ``scale = (max - min) / 15``, integer ``zero``; symmetric: ``zero = 8``),
with act-order a random permutation deciding which columns share a group, as GPTQ's
``desc_act`` does (``g_idx[i]`` = the group of column ``i``). It returns the dequantised
weight the reference model must use. `pack_gptq` and `pack_awq` store the integers:

* GPTQ v1: ``qweight[i // 8, o]`` holds ``q[o, i]`` in bits ``4 * (i % 8)``; ``qzeros[g, o // 8]``
  holds ``zero - 1`` in bits ``4 * (o % 8)``; ``scales[g, o]`` fp16; ``g_idx[i]`` int32.
* AWQ GEMM: ``qweight[i, o // 8]`` holds ``q[o, i]`` in nibble ``k`` where
  ``[0, 2, 4, 6, 1, 3, 5, 7][k] == o % 8``; ``qzeros`` packed the same way (no offset).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import PreTrainedModel

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(
    w: np.ndarray, group: int, sym: bool, act_order: bool, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    n_out, n_in = w.shape
    size = n_in if group == -1 else group
    order = rng.permutation(n_in) if act_order else np.arange(n_in)
    g_idx = np.empty(n_in, np.int32)
    g_idx[order] = np.arange(n_in) // size
    n_groups = -(-n_in // size)
    scales = np.empty((n_groups, n_out), np.float16)
    zeros = np.empty((n_groups, n_out), np.int64)
    q = np.empty((n_out, n_in), np.int64)
    for g in range(n_groups):
        cols = g_idx == g
        x = w[:, cols]
        if sym:
            s = np.maximum(np.abs(x).max(axis=1), 1e-3) / 7.5
            z = np.full(n_out, 8)
        else:
            lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
            s = np.maximum(hi - lo, 1e-3) / 15
            z = np.clip(np.round(-lo / s), 1, 15).astype(np.int64)  # v1 stores zero - 1 >= 0
        s16 = s.astype(np.float16)
        scales[g], zeros[g] = s16, z
        q[:, cols] = np.clip(np.round(x / s16.astype(np.float32)[:, None]) + z[:, None], 0, 15)
    deq = scales.astype(np.float32)[g_idx].T * (q - zeros[g_idx].T)
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx, "dequantized": deq}


def _pack(values: np.ndarray, order: list[int] | None = None) -> np.ndarray:
    """Pack ``[..., 8k]`` 4-bit values, eight to an int32 along the last axis; value ``j``
    of each eight goes to nibble ``order.index(j)`` (default: nibble ``j``)."""
    v = values.reshape(*values.shape[:-1], -1, 8).astype(np.uint32)
    if order is not None:
        v = v[..., order]  # nibble k holds value order[k]
    words = np.zeros(v.shape[:-1], np.uint32)
    for k in range(8):
        words |= v[..., k] << np.uint32(4 * k)
    return words.view(np.int32)


def pack_gptq(qt: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "qweight": _pack(qt["q"].T.reshape(-1, 8, qt["q"].shape[0]).swapaxes(1, 2)).reshape(
            -1, qt["q"].shape[0]
        ),
        "qzeros": _pack((qt["zeros"] - 1) & 0xF),
        "scales": qt["scales"],
        "g_idx": qt["g_idx"],
    }


def pack_awq(qt: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "qweight": _pack(qt["q"].T, AWQ_ORDER),
        "qzeros": _pack(qt["zeros"], AWQ_ORDER),
        "scales": qt["scales"],
    }


def quantize_linears(
    tensors: dict[str, np.ndarray], method: str, group: int, sym: bool, act_order: bool, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """HF-named fp32 ``tensors`` with each linear layer's weight replaced by its packed
    parts; and the dequantised weights, by their names."""
    rng = np.random.default_rng(seed)
    out, dequantized = {}, {}
    for name, w in tensors.items():
        stem = name.removesuffix(".weight")
        if not stem.endswith(LINEARS) or not name.endswith(".weight"):
            out[name] = w
            continue
        qt = quantize(w, group, sym, act_order, rng)
        packed = pack_gptq(qt) if method == "gptq" else pack_awq(qt)
        out |= {f"{stem}.{part}": a for part, a in packed.items()}
        dequantized[name] = qt["dequantized"].astype(np.float32)
    return out, dequantized


def write_checkpoint(
    path: Path, tensors: dict[str, np.ndarray], method: str, group: int, sym: bool, act_order: bool
) -> None:
    """``tensors`` as ``path``'s only SafeTensors file, and config.json's quantization_config."""
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
              "desc_act": act_order, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}  # fmt: skip
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))


def write_quantized(
    model: PreTrainedModel,
    path: Path,
    method: str,
    group: int,
    sym: bool = False,
    act_order: bool = False,
    seed: int = 0,
) -> None:
    """Replace ``path``'s (a `save_pretrained` directory of ``model``) weights with a GPTQ or
    AWQ checkpoint of its linear layers, and put the dequantised weights into ``model``."""
    state = {n: p.detach().to(torch.float32).numpy().copy() for n, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors, dequantized = quantize_linears(state, method, group, sym, act_order, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in dequantized:
                param.copy_(torch.from_numpy(dequantized[name]))
    write_checkpoint(path, tensors, method, group, sym, act_order)
