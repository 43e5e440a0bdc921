"""Fixtures of the model tests: the test model loaded, a CPU device, and the transformers
reference (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path) -> LoadedModel:
    """SmolLM2 loaded (once per test module)."""
    return load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def device() -> CpuDevice:
    return CpuDevice("auto")


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
