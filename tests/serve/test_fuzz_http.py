"""HTTP fuzzing: schemathesis (its CLI, in a process of its own) generates requests from the
live server's /openapi.json, valid and invalid ones, with a fixed seed and a bounded number
per operation, and checks every answer: no 5xx and no hang, invalid data refused, and status
codes, content types, headers (405: Allow) and bodies as the document says. Its check that
every schema-valid request succeeds is left out: the document cannot say which prompts fit
the context or which token ids the vocabulary has."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import LiveServer, live_server

from dynalm.models.loader import LoadedModel
from workload import assert_no_leak


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    # a small context keeps each generated answer short
    with live_server(smollm2, ctx=64, max_queue=32) as s:
        yield s


def test_schemathesis_finds_nothing(server: LiveServer, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"]
        + ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]
        + ["--max-examples", "15", "--seed", "1", "--generation-database", "none"]
        + ["--request-timeout", "30", "--no-color"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # where it keeps its cache
    )
    summary = run.stdout[run.stdout.rfind("SUMMARY") :]
    print(summary)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    assert " passed" in summary and "failure" not in summary
    # still healthy: it answers, and no request holds a KV page
    assert server.http().get("/health").status_code == 200
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
    assert_no_leak(server.engine)
