"""Fixtures of the serve tests: the real model, loaded once per session (each test
module starts its own server on it, see `serving`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynalm.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf)
