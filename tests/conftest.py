"""Shared fixtures: where the real test model lies.

`make test` pulls smollm2:135m into the git-ignored store `.models/` and exports
DYNALM_TEST_MODEL with its path; a missing model is an error, never a skip.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

_repack_dir: str | None = None
_RUN_SEED = "DYNALM_TEST_RUN_SEED"
_set_run_seed = False


def pytest_configure(config: pytest.Config) -> None:
    """Repacked weights go to a directory of this session's (unless $DYNALM_REPACK_CACHE
    says where): tests load many temporary GGUF files, whose entries would otherwise pile
    up in the shared cache of `make test`."""
    global _repack_dir, _set_run_seed
    # One random seed for the whole run, drawn before pytest-xdist starts its workers (which
    # inherit it): a test parametrised by a random draw must be collected alike by all.
    if _RUN_SEED not in os.environ:
        os.environ[_RUN_SEED] = str(random.SystemRandom().randrange(2**32))
        _set_run_seed = True
    if "DYNALM_REPACK_CACHE" not in os.environ:
        _repack_dir = tempfile.mkdtemp(prefix="dynalm-repack-")
        os.environ["DYNALM_REPACK_CACHE"] = _repack_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    if _repack_dir is not None:
        shutil.rmtree(_repack_dir, ignore_errors=True)
        os.environ.pop("DYNALM_REPACK_CACHE", None)
    if _set_run_seed:
        os.environ.pop(_RUN_SEED, None)


# Every test under these folders runs the real model or a real server: slow (make test-fast
# runs tests/unit and tests/kernels without them; make test runs everything).
SLOW_FOLDERS = ("models", "serve")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = [Path(__file__).parent / folder for folder in SLOW_FOLDERS]
    for item in items:
        if any(folder in item.path.parents for folder in slow):
            item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Print the machine the numbers are measured on (even under -q): numeric budgets must
    hold on every CPU (AVX2, AVX-512 and AMX hosts sum in other orders), so a failure
    report should name the CPU."""
    from dynalm.kernel import backends, cross
    from dynalm.show import cpu_description

    name, features = cpu_description()
    blas = os.environ.get("OPENBLAS_CORETYPE", "detected")
    lines = [
        f"cpu: {name} ({' '.join(features) or 'no vector features detected'}); "
        f"OpenBLAS core {blas}",
        f"kernel backends: {backends.select().name} selected; " + backends.coverage(),
        f"aarch64 backends: {cross.coverage()}",
    ]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in lines:
            reporter.write_line(line)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = os.environ.get("DYNALM_TEST_MODEL")
    if not path or not Path(path).is_file():
        raise RuntimeError(
            "DYNALM_TEST_MODEL must point at SmolLM2-135M-Instruct.Q4_1.gguf (run `make test`)"
        )
    return Path(path)
