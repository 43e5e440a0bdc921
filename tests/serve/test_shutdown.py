"""`dynalm serve` as a process: it prints its URL, and on SIGTERM refuses new work,
lets the in-flight stream finish and exits with status 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def test_sigterm_finishes_in_flight_and_exits_0(smollm2_gguf: Path, tmp_path: Path) -> None:
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynalm.cli", "serve", str(smollm2_gguf), "--port", "0"]
            + ["--ctx", "256"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=dict(os.environ),
        )
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no URL on stderr"
            time.sleep(0.1)
        url = m.group(1)
        body = {"model": smollm2_gguf.stem, "prompt": "Once upon a time", "temperature": 0}
        events = []
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={**body, "max_tokens": 12, "stream": True},
            timeout=120,
        ) as r:
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:  # no new work: the port is closed, or a 503
                late = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1})
                assert late.status_code == 503
            except httpx.TransportError:
                pass
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the in-flight request ran to its end
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
