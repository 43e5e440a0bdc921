"""Running one of this directory's atheris (libFuzzer) harnesses for a bounded number of
inputs, as the fuzz tests do."""

from __future__ import annotations

import resource
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
    # libFuzzer's RSS limit reads the peak RSS getrusage reports, which on Linux the child
    # inherits from this (pytest's) process across fork and exec: 2 GB of models loaded by
    # earlier tests read as the fuzzer's own. The limit is what the harness may add.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    cmd = [sys.executable, str(Path(__file__).with_name(harness)), f"-runs={RUNS}"]
    cmd += ["-max_len=16384", "-seed=11", f"-rss_limit_mb={inherited_mb + 1024}"]
    cmd += [f"-artifact_prefix={tmp_path}/", str(corpus)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Done {RUNS} runs" in result.stderr
