"""Model files whose DynaIR graphs the tests build: SmolLM2 and the tiny models of every
family (written as in `tiny_models`).

The graphs of ``PINNED`` are pinned as text in ``tests/models/graphs``: the texts were
printed by the Python decoder builder that the ``.lum`` families replaced (``decoder.py``
+ one row of family flags, before issue 13), and the ``.lum`` files must still build
exactly these graphs; so must gemma3.lum for Gemma 3 270M's layout (metadata and tensor
types alone, `gemma3_270m_layout`). qwen3, olmo2 and the mixtures of experts never had a
Python builder.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType
from tiny_models import SPECS, reference_model, write_gguf

GRAPHS = Path(__file__).parent / "graphs"
TINY = {
    "tiny-llama": ("llama", GGMLQuantizationType.F32),
    "tiny-llama-q8_0": ("llama", GGMLQuantizationType.Q8_0),
    "tiny-qwen2": ("qwen2", GGMLQuantizationType.F32),
    "tiny-gemma3": ("gemma3", GGMLQuantizationType.F32),
    "tiny-qwen3": ("qwen3", GGMLQuantizationType.F32),
    "tiny-olmo2": ("olmo2", GGMLQuantizationType.Q8_0),
    "tiny-qwen3moe": ("qwen3moe", GGMLQuantizationType.F32),
    "tiny-olmoe": ("olmoe", GGMLQuantizationType.Q8_0),
    "tiny-mixtral": ("mixtral", GGMLQuantizationType.Q8_0),
}
CASES = ("smollm2", *TINY)
PINNED = ("smollm2", "tiny-llama", "tiny-llama-q8_0", "tiny-qwen2", "tiny-gemma3")


def gemma3_270m_layout() -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """Metadata and tensor types (dtype name, numpy-order shape) laid out like Gemma 3 270M
    (18 layers, 4 heads of 256 sharing 1 kv head, window 512, tied head), no weights: the
    graph is built from the tensor directory alone."""
    d, heads, kv, hd, ff, n, vocab = 640, 4, 1, 256, 2048, 18, 262144
    metadata = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": d,
        "gemma3.block_count": n,
        "gemma3.feed_forward_length": ff,
        "gemma3.attention.head_count": heads,
        "gemma3.attention.head_count_kv": kv,
        "gemma3.attention.key_length": hd,
        "gemma3.attention.value_length": hd,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.sliding_window": 512,
        "gemma3.rope.freq_base": 1_000_000.0,
    }
    types = {"token_embd.weight": ("q8_0", (vocab, d)), "output_norm.weight": ("f32", (d,))}
    for i in range(n):
        p = f"blk.{i}."
        types |= {
            p + "attn_q.weight": ("q8_0", (heads * hd, d)),
            p + "attn_k.weight": ("q8_0", (kv * hd, d)),
            p + "attn_v.weight": ("q8_0", (kv * hd, d)),
            p + "attn_output.weight": ("q8_0", (d, heads * hd)),
            p + "ffn_gate.weight": ("q4_0", (ff, d)),
            p + "ffn_up.weight": ("q4_0", (ff, d)),
            p + "ffn_down.weight": ("q6_k", (d, ff)),
        }
        for norm, width in (
            ("attn_q_norm", hd),
            ("attn_k_norm", hd),
            ("attn_norm", d),
            ("post_attention_norm", d),
            ("ffn_norm", d),
            ("post_ffw_norm", d),
        ):
            types[f"{p}{norm}.weight"] = ("f32", (width,))
    return metadata, types


def case_path(name: str, smollm2: Path, tmp: Path) -> Path:
    """The GGUF file of case ``name`` (tiny ones are written into ``tmp``)."""
    if name == "smollm2":
        return smollm2
    family, qtype = TINY[name]
    return write_gguf(reference_model(SPECS[family]), SPECS[family], tmp / f"{name}.gguf", qtype)
