"""Shared fixtures: where the real test model lies.

`make test` pulls smollm2:135m into the git-ignored store `.models/` and exports
DYNALM_TEST_MODEL with its path; a missing model is an error, never a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = os.environ.get("DYNALM_TEST_MODEL")
    if not path or not Path(path).is_file():
        raise RuntimeError(
            "DYNALM_TEST_MODEL must point at SmolLM2-135M-Instruct.Q4_1.gguf (run `make test`)"
        )
    return Path(path)
