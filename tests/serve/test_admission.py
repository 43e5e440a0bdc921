"""Admission control: a full waiting queue answers 503 with Retry-After at once, and
the requests already admitted are unaffected."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from serving import MODEL, LiveServer, live_server

from dynalm.models.loader import LoadedModel

PROMPT = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    # one running sequence and one waiting request fill the server
    with live_server(smollm2, ctx=256, max_num_seqs=1, max_queue=1) as s:
        yield s


def test_queue_full_is_503_with_retry_after(server: LiveServer) -> None:
    http = server.http()
    # it must still run when the others arrive: no end-of-turn token allowed
    never_stop = {str(t): -100 for t in server.service.model.stop_token_ids}
    long = {**PROMPT, "max_tokens": 200, "stream": True, "logit_bias": never_stop}
    with http.stream("POST", "/v1/completions", json=long) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # keep it: a dropped iterator closes the connection
        next(lines)  # admitted and generating

        queued: dict[str, int] = {}
        waiter = threading.Thread(
            target=lambda: queued.update(
                status=server.http()
                .post("/v1/completions", json={**PROMPT, "max_tokens": 2})
                .status_code
            )
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while server.engine.stats.num_waiting < 1:
            assert time.monotonic() < deadline, (server.engine.stats, queued)
            time.sleep(0.02)

        t0 = time.monotonic()
        refused = http.post("/v1/completions", json={**PROMPT, "max_tokens": 2})
        assert time.monotonic() - t0 < 5  # refused at once, not after a wait
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "queue_full"
    # leaving the stream disconnects it: the waiting request gets its turn
    waiter.join(timeout=60)
    assert queued["status"] == 200
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
