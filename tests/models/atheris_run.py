"""Running one of this directory's atheris (libFuzzer) harnesses for a bounded number of
inputs, as the fuzz tests do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUNS = 20_000


def fuzz(harness: str, seed: bytes, tmp_path: Path) -> None:
    """Mutate ``seed`` ``RUNS`` times through ``harness`` (a script beside this file); fail
    on any crash it reports (libFuzzer keeps the crashing input in ``tmp_path``)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    corpus.joinpath("seed").write_bytes(seed)
    cmd = [sys.executable, str(Path(__file__).with_name(harness)), f"-runs={RUNS}"]
    cmd += ["-max_len=16384", "-seed=11", f"-artifact_prefix={tmp_path}/", str(corpus)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Done {RUNS} runs" in result.stderr
