"""`dynalm serve` as a process: it prints its URL, and on SIGTERM keeps its port open to
answer new requests with 503 while in-flight ones finish; what still runs after the grace
period is aborted with a proper end (a final chunk, ``[DONE]``), and it exits with status 0
and a clean log."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from serving import server_process

from dynalm.models.loader import LoadedModel


def assert_refused_while_draining(url: str, body: dict) -> None:
    late = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "shutting_down" and late.headers["Retry-After"]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 503


def test_sigterm_finishes_in_flight_and_exits_0(
    smollm2: LoadedModel, smollm2_gguf: Path, tmp_path: Path
) -> None:
    # Long enough (1,000 tokens) to still be running when SIGTERM comes, even when a loaded
    # machine starves this test process while the server generates.
    cmd = ["-m", "dynalm.cli", "serve", str(smollm2_gguf), "--port", "0", "--ctx", "1024"]
    with server_process(cmd, tmp_path / "stderr.txt") as server:
        no_eos = {str(t): -100 for t in smollm2.stop_token_ids}  # still running at the 503 check
        body = {
            "model": smollm2_gguf.stem,
            "prompt": "Once upon a time",
            "temperature": 0,
            "logit_bias": no_eos,
        }
        events = []
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**body, "max_tokens": 1000, "stream": True},
            timeout=120,
        ) as r:
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert_refused_while_draining(server.url, body)
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the in-flight request ran to its end
        assert server.proc.wait(timeout=60) == 0, server.stderr()
        assert "Traceback" not in server.stderr()


def test_sigterm_under_load_ends_every_stream(
    smollm2: LoadedModel, smollm2_gguf: Path, tmp_path: Path
) -> None:
    """8 long streams on 4 sequences (4 run, 4 wait); SIGTERM with a 2 s grace: every stream
    still ends with a final chunk (finish_reason "abort") and [DONE], nothing in the log."""
    args = ["-m", "dynalm.cli", "serve", str(smollm2_gguf), "--port", "0", "--ctx", "1024"]
    args += ["--max-num-seqs", "4", "--shutdown-grace", "2"]
    with server_process(args, tmp_path / "stderr.txt") as server:
        no_eos = {str(t): -100 for t in smollm2.stop_token_ids}  # answers run until aborted
        body = {"prompt": "Once upon a time", "temperature": 0, "logit_bias": no_eos}
        streams: list[list[str]] = [[] for _ in range(8)]
        generating = threading.Semaphore(0)

        def stream(events: list[str]) -> None:
            long = {**body, "max_tokens": 1000, "stream": True}  # far beyond the grace
            with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 2:
                            generating.release()

        threads = [threading.Thread(target=stream, args=(events,)) for events in streams]
        for t in threads:
            t.start()
        for _ in range(4):  # the running four are generating; the other four wait
            assert generating.acquire(timeout=60)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.3)
        assert_refused_while_draining(server.url, body)
        for t in threads:
            t.join(timeout=60)
        assert server.proc.wait(timeout=30) == 0, server.stderr()
        elapsed = time.monotonic() - t0
    for events in streams:
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert sum(len(events) > 2 for events in streams) >= 4  # some had generated text
    assert 2 <= elapsed < 20, elapsed  # the grace period, then a prompt end
    stderr = server.stderr()
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr
    print(f"\nSIGTERM with 8 streams: all ended with abort + [DONE], exit 0 after {elapsed:.1f} s")
