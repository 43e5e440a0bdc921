"""Fixtures of the serve tests: the real model, loaded once per session (each test
module starts its own server on it, see `serving`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynalm.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local Ray cluster (127.0.0.1, 2 CPUs) for this test process's `live_cluster`s,
    started on first use (again if a test left it) and stopped at the end of the session;
    skipped, saying why, without Ray."""
    from dynalm.errors import ClusterUnavailable
    from dynalm.runtime.serve import cluster

    try:
        ray, _ = cluster.ray_modules()
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    yield  # `live_cluster` connects (a new local cluster) when this process is not
    if ray.is_initialized():
        cluster.shutdown()
