"""Many clients at once against a real server, through the official ``openai`` client:
concurrent greedy requests get the tokens each gets alone, a shared system prompt comes
from the prefix cache (``cached_tokens``) with the same answer, and cancelling 8 of 32
concurrent streams leaks no KV page."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving import MODEL, LiveServer, live_server

from dynalm.models.loader import LoadedModel
from workload import SYSTEM, TEXTS, assert_no_leak


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    with live_server(smollm2, ctx=1024, max_num_seqs=16) as s:
        yield s


def ask(client: openai.OpenAI, question: str, system: str | None = None, max_tokens: int = 12):
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )


class MostRunning:
    """The largest number of requests the engine ran in one step while in use."""

    def __init__(self, server: LiveServer):
        self._server, self.most = server, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            self.most = max(self.most, self._server.engine.stats.num_running)
            time.sleep(0.002)

    def __enter__(self) -> MostRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def test_concurrent_greedy_requests_get_the_tokens_each_gets_alone(server: LiveServer) -> None:
    client = server.client()
    alone = [ask(client, q).choices[0].message.content for q in TEXTS]
    with MostRunning(server) as running, ThreadPoolExecutor(len(TEXTS)) as pool:
        together = [r.choices[0].message.content for r in pool.map(lambda q: ask(client, q), TEXTS)]
    assert running.most >= 4  # they did share steps
    assert together == alone
    assert len(set(alone)) == len(TEXTS)  # different requests, different answers


def test_a_shared_system_prompt_comes_from_the_prefix_cache(server: LiveServer) -> None:
    client = server.client()
    server.wait_idle()
    server.engine.reset_prefix_cache()
    uncached = ask(client, "Can I print in colour?", SYSTEM, max_tokens=16)
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
    server.engine.reset_prefix_cache()
    first = ask(client, "When do you open?", SYSTEM, max_tokens=16)
    cached = ask(client, "Can I print in colour?", SYSTEM, max_tokens=16)
    assert first.usage.prompt_tokens >= 300
    assert cached.usage.prompt_tokens_details.cached_tokens >= 288
    assert cached.choices[0].message.content == uncached.choices[0].message.content


def test_32_concurrent_streams_with_8_cancelled_leak_no_page(server: LiveServer) -> None:
    server.wait_idle()
    # no end-of-turn token: every answer runs to max_tokens unless its client leaves
    no_eos = {str(t): -100 for t in server.engine.model.stop_token_ids}
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "logit_bias": no_eos}
    questions = [f"{TEXTS[i % len(TEXTS)]} (question {i})" for i in range(32)]

    def finish(question: str) -> str | None:
        stream = server.client().chat.completions.create(
            messages=[{"role": "user", "content": question}], stream=True, **body
        )
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
        return reasons[-1]

    def cancel(question: str) -> str | None:
        messages = [{"role": "user", "content": question}]
        with (
            server.http() as http,
            http.stream(
                "POST", "/v1/chat/completions", json={**body, "messages": messages, "stream": True}
            ) as r,
        ):
            contents = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    contents += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                if contents == 2:
                    return None  # leaving the block closes the connection mid-stream
        return "finished"

    with MostRunning(server) as running, ThreadPoolExecutor(32) as pool:
        jobs = [pool.submit(cancel if i % 4 == 3 else finish, q) for i, q in enumerate(questions)]
        results = [job.result() for job in jobs]
    assert running.most == 16  # the batch was full (max_num_seqs)
    assert results.count("length") == 24 and results.count(None) == 8
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
    assert_no_leak(server.engine)  # evicting the prefix cache frees the whole pool
