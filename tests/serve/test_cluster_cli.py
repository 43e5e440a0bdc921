"""`dynalm serve MODEL --replicas 2 --router round-robin` as a user runs it: the command's
own local Ray cluster (127.0.0.1), its replicas built by `serve`'s own `prepare` (shipped to
them by Ray), answering, routed in turn, and stopped by SIGTERM. (A file of its own: the
cluster of test_cluster.py is gone before this one starts.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

try:
    import ray  # noqa: F401
except ImportError as e:  # printed by -rs: never a silent skip
    pytest.skip(
        f"Ray Serve is not installed ({e}): pip install '.[cluster]'", allow_module_level=True
    )

START_S = 180  # a local cluster, 2 engines loaded: ~25 s on 2 busy cores


def test_serve_replicas_round_robin_from_the_command_line(smollm2_gguf: Path) -> None:
    cmd = [sys.executable, "-m", "dynalm.cli", "serve", str(smollm2_gguf), "--port", "0",
           "--replicas", "2", "--router", "round-robin",
           "--ctx", "512", "--max-num-seqs", "2"]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ))
        try:
            deadline = time.monotonic() + START_S
            while not (m := re.search(r"on (http://\S+)/v1", _read(log))):
                assert proc.poll() is None, _read(log)
                assert time.monotonic() < deadline, _read(log)
                time.sleep(0.5)
            url = m.group(1)
            name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            body = {"model": name, "prompt": "The capital of France is", "max_tokens": 6,
                    "temperature": 0}  # fmt: skip
            texts = []
            for _ in range(4):
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            assert len(set(texts)) == 1 and texts[0], texts
            metrics = httpx.get(url + "/metrics", timeout=30).text
            routed = re.findall(
                r'dynalm:router_requests_total\{[^}]*policy="round-robin"[^}]*\} (\S+)', metrics
            )
            assert sorted(float(n) for n in routed) == [2.0, 2.0], metrics  # in turn
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert rc == 0, _read(log)


def _read(log: object) -> str:
    log.seek(0)  # type: ignore[attr-defined]
    return log.read()  # type: ignore[attr-defined]
