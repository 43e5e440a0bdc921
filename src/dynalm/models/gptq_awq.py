"""GPTQ and AWQ 4-bit weights, repacked once at load into rows of the quant-format table.

Both store a linear layer's weight ``W [out, in]`` as 4-bit integers ``q`` with an fp16
``scale`` and an integer ``zero`` per (group of ``group_size`` input columns, output row):
``W[o, i] = scale[g(i), o] * (q[o, i] - zero[g(i), o])``.

* GPTQ (``checkpoint_format`` "gptq", AutoGPTQ's v1): ``qweight`` int32 ``[in / 8, out]``,
  eight values per word along the *input* dimension, value ``j`` in bits ``4j``;
  ``qzeros`` int32 ``[groups, out / 8]`` packed the same way along the output dimension,
  storing ``zero - 1`` (v1's offset: 1 is added back); ``scales`` fp16 ``[groups, out]``;
  ``g_idx`` int32 ``[in]``, the group of each input column. With act-order (``desc_act``)
  the groups are not contiguous: columns were quantised in a permuted order.
* AWQ (``version`` "gemm"): ``qweight`` int32 ``[in, out / 8]``, eight values per word
  along the *output* dimension in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]``
  (nibble ``k`` holds column ``8c + order[k]``); ``qzeros`` int32 ``[groups, out / 8]``
  packed the same way, no offset; ``scales`` fp16 ``[groups, out]``; groups contiguous.

The repack is exact: every 32-column block lies in one group (group sizes are multiples
of 32; act-order columns are first sorted by group, ``input_perm``), so it inherits its
group's scale and zero. Symmetric weights (every zero 8) become Q4_0 blocks (``d = scale``,
nibble ``q``: ``d * (q - 8)``). Asymmetric ones become Q5_0 blocks (``d = scale``,
``q5 = q - zero + 16`` in 0..31 since ``q`` is 0..15 and ``zero`` 0..16:
``d * (q5 - 16)``), not Q4_1: Q4_1 would store the offset ``-scale * zero`` as fp16,
which rounds away up to 2^-12 of it (scale x zero needs up to 16 significant bits), so it
would not be the model's weights any more; Q5_0 costs 22 bytes per 32 weights instead of
20 and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from dynalm.errors import ModelFormatError, UnsupportedModel, show

BLOCK = 32  # the quant table's block: Q4_0 and Q5_0
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_SHIFTS = np.arange(8, dtype=np.uint32) * 4
# Parts of a quantised linear layer, by the suffix of their names.
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class QuantConfig:
    """``quantization_config`` of a GPTQ or AWQ checkpoint, checked."""

    method: str  # "gptq" | "awq"
    group_size: int  # -1: one group over the whole input
    sym: bool
    desc_act: bool

    @property
    def ggml_type(self) -> int:
        """The quant table row the weights are repacked into (see the module doc)."""
        return int(GGMLQuantizationType.Q4_0 if self.sym else GGMLQuantizationType.Q5_0)


def read_quant_config(config: dict, where: str, example: str) -> QuantConfig | None:
    """The checked ``quantization_config`` of ``config`` (None when absent). ``where``
    names config.json, ``example`` a quantised tensor (for the refusals)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelFormatError(f"{where}: quantization_config {show(qc)} is not an object")
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise UnsupportedModel(
            f"{where}: quant_method {show(method)} ({example}) is not supported "
            "(supported: gptq, awq)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedModel(
            f"{where}: {method} with bits = {show(bits)} ({example}) is not supported (4-bit only)"
        )
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if type(group) is not int or not (group == -1 or (group > 0 and group % BLOCK == 0)):
        raise UnsupportedModel(
            f"{where}: {method} group_size = {show(group)} ({example}) is not supported "
            f"(-1 or a multiple of {BLOCK})"
        )
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise UnsupportedModel(
                f"{where}: GPTQ checkpoint_format {show(fmt)} ({example}) is not supported "
                "(the gptq layout only; exllama/marlin layouts are not)"
            )
        sym, desc_act = qc.get("sym", True), qc.get("desc_act", False)
        if type(sym) is not bool or type(desc_act) is not bool:
            raise ModelFormatError(f"{where}: sym / desc_act {show([sym, desc_act])} not booleans")
        return QuantConfig("gptq", group, sym, desc_act)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModel(
            f"{where}: AWQ version {show(version)} ({example}) is not supported (gemm only)"
        )
    zero_point = qc.get("zero_point", True)
    if zero_point is not True:
        raise UnsupportedModel(
            f"{where}: AWQ zero_point = {show(zero_point)} ({example}) is not supported"
        )
    return QuantConfig("awq", group, sym=False, desc_act=False)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 ``[..., n]`` -> uint8 ``[..., n, 8]``: nibble ``k`` of each word (bits 4k)."""
    return ((words.view(np.uint32)[..., None] >> _SHIFTS) & 0xF).astype(np.uint8)


@dataclass
class Unpacked:
    """A layer's weight as integers: ``q [out, in]``, per group and output row ``zeros``
    and ``scales`` ``[groups, out]``, and the group of each input column."""

    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray


# The SafeTensors dtypes each part may have (scales: as written by the quantisers).
PART_DTYPES = {
    "qweight": ("I32",),
    "qzeros": ("I32",),
    "scales": ("F16", "BF16", "F32"),
    "g_idx": ("I32", "I64", "I16", "U32", "U16"),
}


def layer_shape(
    method: str, name: str, parts: dict[str, tuple[str, tuple[int, ...]]], group_size: int
) -> tuple[int, int]:
    """The ``(out, in)`` shape of layer ``name`` from its parts' SafeTensors dtypes and
    shapes (``part -> (dtype, shape)``), each part checked against the layout of the module
    doc and against the others before any byte is read: a message names the tensor, what it
    is and what it should be. The only place the parts' shapes are checked (``unpack`` and
    ``repack`` rely on it)."""
    for part, (dtype, shape) in parts.items():
        if dtype not in PART_DTYPES[part]:
            raise ModelFormatError(
                f"{name}.{part} is {dtype} {list(shape)}, expected {'/'.join(PART_DTYPES[part])}"
            )
    dtype, shape = parts["qweight"]
    layout = "[in / 8, out]" if method == "gptq" else "[in, out / 8]"
    if len(shape) != 2 or 0 in shape:
        raise ModelFormatError(f"{name}.qweight is {dtype} {list(shape)}, expected {layout}")
    rows, cols = shape
    n_out, n_in = (cols, rows * 8) if method == "gptq" else (cols * 8, rows)
    if n_in % BLOCK or n_out % 8:
        raise ModelFormatError(
            f"{name}.qweight is {dtype} {list(shape)} ({layout}): {n_out} x {n_in}, expected "
            f"a multiple of {BLOCK} input columns and of 8 output rows"
        )
    group = n_in if group_size == -1 else group_size
    n_groups = -(-n_in // group)
    expected = {"qzeros": (n_groups, n_out // 8), "scales": (n_groups, n_out), "g_idx": (n_in,)}
    for part, want in expected.items():
        if part in parts and parts[part][1] != want:
            dtype, found = parts[part]
            raise ModelFormatError(
                f"{name}.{part} is {dtype} {list(found)}, expected {list(want)} for a "
                f"{n_out} x {n_in} weight in groups of {group} (qweight {list(shape)})"
            )
    return n_out, n_in


def unpack(method: str, name: str, parts: dict[str, np.ndarray], group_size: int) -> Unpacked:
    """Unpack a layer's ``qweight``/``qzeros``/``scales`` (/``g_idx``), their shapes
    checked by ``layer_shape``; ``name`` (the layer) is named in errors."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if method == "gptq":
        n_in, n_out = qweight.shape[0] * 8, qweight.shape[1]
        q = _nibbles(qweight).transpose(1, 0, 2).reshape(n_out, n_in)  # [in/8, out, 8]
        zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).astype(np.int16) + 1
    else:
        n_in, n_out = qweight.shape[0], qweight.shape[1] * 8
        order = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble order[j]
        q = _nibbles(qweight)[..., order].reshape(n_in, n_out).T
        zeros = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1).astype(np.int16)
    return Unpacked(q, zeros, scales, group_index(name, parts.get("g_idx"), n_in, group_size))


def group_index(name: str, g_idx: np.ndarray | None, n_in: int, group_size: int) -> np.ndarray:
    """The group of each of the ``n_in`` input columns: ``g_idx`` (shape checked by
    ``layer_shape``), its values checked, or contiguous groups when there is none."""
    group = n_in if group_size == -1 else group_size
    if g_idx is None:
        return np.arange(n_in, dtype=np.int64) // group
    n_groups = -(-n_in // group)
    g_idx = g_idx.astype(np.int64)
    if not (g_idx.min() >= 0 and g_idx.max() < n_groups):
        bad = int(np.flatnonzero((g_idx < 0) | (g_idx >= n_groups))[0])
        raise ModelFormatError(
            f"{name}.g_idx[{bad}] = {g_idx[bad]}, expected a group in 0..{n_groups - 1}"
        )
    return g_idx


def input_perm(g_idx: np.ndarray) -> np.ndarray | None:
    """The input-column order that makes the groups contiguous (None: they already are)."""
    if (np.diff(g_idx) >= 0).all():
        return None
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def repack(u: Unpacked, ggml_type: int, name: str) -> np.ndarray:
    """The layer's weight as rows of Q4_0 or Q5_0 blocks (uint8 ``[out, row bytes]``), its
    input columns in ``input_perm`` order. Exact (see the module doc)."""
    perm = input_perm(u.g_idx)
    q, g = (u.q, u.g_idx) if perm is None else (u.q[:, perm], u.g_idx[perm])
    blocks_g = g.reshape(-1, BLOCK)
    if (blocks_g != blocks_g[:, :1]).any():
        raise UnsupportedModel(f"{name}: a group boundary falls inside a {BLOCK}-column block")
    gb = blocks_g[:, 0]  # group of each block
    scales = u.scales[gb].T.astype(np.float16)  # [out, blocks]
    if u.scales.dtype != np.float16 and not np.array_equal(scales, u.scales[gb].T):
        raise UnsupportedModel(f"{name}.scales are {u.scales.dtype}, not exactly fp16")
    zeros = np.repeat(u.zeros[gb].T, BLOCK, axis=1)  # [out, in], one per column
    if ggml_type == GGMLQuantizationType.Q4_0:
        if (zeros != 8).any():
            raise ModelFormatError(f"{name}: sym = true but some zero points are not 8")
        values = q
    else:
        values = (q.astype(np.int16) - zeros + 16).astype(np.uint8)
    return pack_blocks(values, scales, ggml_type)


def pack_blocks(values: np.ndarray, d: np.ndarray, ggml_type: int) -> np.ndarray:
    """Q4_0 (values 0..15) or Q5_0 (0..31) blocks from integers ``[out, in]`` and fp16
    scales ``[out, in / 32]`` (layouts as ``core.quant`` reads them)."""
    n_out, n_in = values.shape
    v = values.reshape(n_out, n_in // BLOCK, BLOCK)
    parts = [np.ascontiguousarray(d.astype("<f2")).view(np.uint8).reshape(*v.shape[:2], 2)]
    if ggml_type == GGMLQuantizationType.Q5_0:  # bit j of a little-endian u32: x[j]'s bit 4
        parts.append(np.packbits((v >> 4) & 1, axis=-1, bitorder="little"))
    parts.append((v[..., :16] & 0xF) | ((v[..., 16:] & 0xF) << 4))
    return np.concatenate(parts, axis=-1).reshape(n_out, -1)


def describe(qc: Any) -> str:
    """``gptq 4-bit g128 sym act-order``: a quantisation config in a few words."""
    group = "per-row" if qc.group_size == -1 else f"g{qc.group_size}"
    traits = ["sym" if qc.sym else "asym"] + (["act-order"] if qc.desc_act else [])
    return f"{qc.method} 4-bit {group} {' '.join(traits)}"
