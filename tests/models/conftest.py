"""Fixtures of the model tests: the transformers reference, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference(smollm2_gguf: Path):
    """SmolLM2 in transformers, its weights dequantised from the GGUF to fp32: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    ref = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return ref.eval()
