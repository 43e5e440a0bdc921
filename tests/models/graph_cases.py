"""Model files whose DynaIR graphs the tests build: SmolLM2 and the tiny models of every
family (written as in `tiny_models`).

The graphs of ``PINNED`` are pinned as text in ``tests/models/graphs``: the texts were
printed by the Python decoder builder that the ``.lum`` families replaced (``decoder.py``
+ one row of family flags, before issue 13), and the ``.lum`` files must still build
exactly these graphs. qwen3 and olmo2 never had a Python builder.
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
}
CASES = ("smollm2", *TINY)
PINNED = ("smollm2", "tiny-llama", "tiny-llama-q8_0", "tiny-qwen2", "tiny-gemma3")


def case_path(name: str, smollm2: Path, tmp: Path) -> Path:
    """The GGUF file of case ``name`` (tiny ones are written into ``tmp``)."""
    if name == "smollm2":
        return smollm2
    family, qtype = TINY[name]
    return write_gguf(reference_model(SPECS[family]), SPECS[family], tmp / f"{name}.gguf", qtype)
