"""One request never stalls the others: while a huge body is refused and a long prompt is
tokenised and prefilled, ``/health`` and ``/metrics`` keep answering at once (a 20 MB body
once held the event loop for 19 s)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serving import LiveServer, live_server

from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve.asgi import MAX_BODY_BYTES


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    with live_server(smollm2, ctx=2048) as s:
        yield s


class Poller:
    """Polls a path in the background and keeps the slowest answer's latency."""

    def __init__(self, server: LiveServer, path: str) -> None:
        self.http, self.path = server.http(), path
        self.slowest, self.count = 0.0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.is_set():
            t0 = time.perf_counter()
            assert self.http.get(self.path).status_code == 200
            self.slowest = max(self.slowest, time.perf_counter() - t0)
            self.count += 1
            time.sleep(0.02)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


JSON = {"Content-Type": "application/json"}


def chat(text: str) -> bytes:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    return json.dumps(body).encode()


def test_health_and_metrics_answer_while_big_requests_run(server: LiveServer) -> None:
    http = server.http()

    def post(body: bytes) -> httpx.Response:
        return http.post("/v1/chat/completions", content=body, headers=JSON)

    with Poller(server, "/health") as health, Poller(server, "/metrics") as metrics:
        time.sleep(0.2)
        t0 = time.perf_counter()
        huge = post(chat("x" * 20_000_000))
        assert huge.status_code == 413
        # just under the body limit: text no context can hold, refused before tokenising
        big = post(chat("hi " * (MAX_BODY_BYTES // 3 - 40)))
        assert big.status_code == 400 and "characters" in big.json()["error"]["message"]
        refused = time.perf_counter() - t0
        # a prompt that fills most of the context: tokenised off the event loop, then prefilled
        t0 = time.perf_counter()
        long = post(chat("hello world " * 900))
        assert long.status_code == 200, long.text
        assert long.json()["usage"]["prompt_tokens"] > 1500
        prefill = time.perf_counter() - t0
    print(
        f"\n20 MB + 8 MiB bodies refused in {refused:.2f} s; a "
        f"{long.json()['usage']['prompt_tokens']}-token prompt answered in {prefill:.2f} s; "
        f"slowest /health {health.slowest * 1000:.0f} ms ({health.count} polls), "
        f"slowest /metrics {metrics.slowest * 1000:.0f} ms ({metrics.count} polls)"
    )
    assert refused < 5 and health.count > 10 and metrics.count > 10
    assert health.slowest < 2.0 and metrics.slowest < 2.0  # it was 19 s
