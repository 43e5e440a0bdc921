"""`dynalm serve --replicas`: a 2-replica local Ray cluster (127.0.0.1, started and stopped
here, shared by the file's tests) behind the ordinary server, against the single-process
server's greedy answers; a replica killed mid-load; a cluster that cannot start."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from serving import MODEL, LiveServer, live_cluster, live_server

from dynalm.errors import QueueFull
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import RequestOutput
from dynalm.runtime.engine.sampling import SamplingParams

try:
    import ray
    from ray.serve.exceptions import RequestCancelledError

    from dynalm.runtime.serve import cluster, routing
except ImportError as e:  # printed by -rs: never a silent skip
    pytest.skip(
        f"Ray Serve is not installed ({e}): pip install '.[cluster]'", allow_module_level=True
    )

CONFIG = {"ctx": 1024, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def clustered(smollm2: LoadedModel, ray_local: None) -> Iterator[LiveServer]:
    with live_cluster(smollm2, **CONFIG) as server:
        yield server


@pytest.fixture(scope="module")
def single(smollm2: LoadedModel) -> Iterator[LiveServer]:
    with live_server(smollm2, **CONFIG) as server:
        yield server


CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0,
}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
              "temperature": 0}  # fmt: skip


def answer(server: LiveServer, path: str, body: dict) -> str:
    r = server.http().post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def events(server: LiveServer, path: str, body: dict) -> list[str]:
    """The data lines of a streamed answer, ``[DONE]`` included."""
    with server.http().stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def streamed_text(lines: list[str]) -> str:
    assert lines[-1] == "[DONE]"
    text = []
    for line in lines[:-1]:
        choice = json.loads(line)["choices"][0]
        text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMPLETION)])  # fmt: skip
def test_cluster_answers_equal_the_single_process_servers(
    clustered: LiveServer, single: LiveServer, path: str, body: dict
) -> None:
    expected = answer(single, path, body)
    assert expected
    assert answer(clustered, path, body) == expected
    assert streamed_text(events(clustered, path, body)) == expected


def test_cluster_refuses_what_the_single_process_server_refuses(clustered: LiveServer) -> None:
    r = clustered.http().post("/v1/completions", json={**COMPLETION, "max_tokens": 5000})
    assert r.status_code == 400, r.text
    assert "context" in r.json()["error"]["message"]


COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
}}}  # fmt: skip
STRUCTURED = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}}}),
    ("/v1/completions", {**COMPLETION, "guided_regex": "(Paris|Lyon|Rome)[.]"}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 64, "tools": [WEATHER],
                              "tool_choice": "required", "parallel_tool_calls": False}),
]  # fmt: skip


def test_structured_output_on_a_cluster_is_the_single_process_servers(
    clustered: LiveServer, single: LiveServer
) -> None:
    """The grammar crosses as text and the replica compiles it: a JSON schema, a regex and
    a required tool call answer as one process does; a bad schema is the ingress's 400."""
    for path, body in STRUCTURED:
        expected = single.http().post(path, json=body)
        got = clustered.http().post(path, json=body)
        assert expected.status_code == got.status_code == 200, (got.text, expected.text)
        want, have = expected.json()["choices"][0], got.json()["choices"][0]
        for choice in (want, have):  # a call's id is random: the rest is the answer
            for call in (choice.get("message") or {}).get("tool_calls") or ():
                call.pop("id")
        assert have.get("message", have.get("text")) == want.get("message", want.get("text"))
    call = have["message"]["tool_calls"][0]["function"]  # the last: one required call
    assert call["name"] == "weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    colour = json.loads(answer(clustered, *STRUCTURED[0]))
    assert colour["colour"] in COLOUR["properties"]["colour"]["enum"]
    assert answer(clustered, *STRUCTURED[1]) in ("Paris.", "Lyon.", "Rome.")
    schema = {"name": "b", "schema": {"type": 5}}
    bad = {**CHAT, "response_format": {"type": "json_schema", "json_schema": schema}}
    r = clustered.http().post("/v1/chat/completions", json=bad)
    assert r.status_code == 400, r.text
    assert r.json() == single.http().post("/v1/chat/completions", json=bad).json()


def test_the_prefix_router_sends_a_repeated_prompt_where_it_went(clustered: LiveServer) -> None:
    stats = routing.STATS[cluster.APP]
    assert stats.policy == "prefix"
    before = (Counter(stats.routed), stats.prompt_tokens, stats.matched_tokens)
    prompt = "You are a terse assistant for a shipping company. " * 8 + "Where is my parcel?"
    body = {**COMPLETION, "prompt": prompt, "max_tokens": 2}
    for _ in range(4):  # one at a time: the loads stay balanced
        answer(clustered, "/v1/completions", body)
    routed = Counter(stats.routed)
    routed.subtract(before[0])
    assert sorted(routed.values()) == [0, 4] or list(+routed.values()) == [4], routed
    prompt_tokens = stats.prompt_tokens - before[1]
    # the three repeats matched the whole prompt (the first: at most what earlier tests sent)
    assert stats.matched_tokens - before[2] >= 3 * prompt_tokens // 4


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """``(labels, value)`` of each sample of metric ``name`` in an exposition."""
    return [(ln[len(name) : ln.index("}") + 1], float(ln.rsplit(" ", 1)[1]))
            for ln in text.splitlines() if ln.startswith(name + "{")]  # fmt: skip


def test_metrics_have_each_replicas_engine_and_the_routers(clustered: LiveServer) -> None:
    answer(clustered, "/v1/completions", COMPLETION)
    deadline = time.monotonic() + 3 * 5 * cluster.STATS_PERIOD_S  # polls: controller, router
    while True:
        text = clustered.http().get("/metrics").text
        queried = _samples(text, "dynalm:prefix_cache_queries_total")
        if len(queried) == 2 and sum(n for _, n in queried) > 0:
            break  # both replicas reported, after a request
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    replicas = {labels.split('replica="')[1].split('"')[0] for labels, _ in queried}
    assert len(replicas) == 2, queried
    routed = _samples(text, "dynalm:router_requests_total")
    stats = routing.STATS[cluster.APP]
    assert {labels.split('replica="')[1].split('"')[0] for labels, _ in routed} == replicas
    assert sum(n for _, n in routed) == sum(stats.routed.values())
    assert all('policy="prefix"' in labels for labels, _ in routed)
    (_, prompt), (_, matched) = (_samples(text, f"dynalm:router_{m}_total")[0]
                                 for m in ("prompt_tokens", "prefix_match_tokens"))  # fmt: skip
    assert 0 < matched < prompt
    assert _samples(text, "dynalm:router_hot_spreads_total")[0][1] == stats.hot_spreads
    tree = _samples(text, "dynalm:router_tree_tokens")
    assert {labels.split('replica="')[1].split('"')[0] for labels, _ in tree} <= replicas
    assert sum(n for _, n in tree) > 0


def test_a_client_that_leaves_aborts_its_request_on_the_replica(clustered: LiveServer) -> None:
    """Closing the stream cancels the replica's: its engine stops at once, not after the
    900 tokens asked (>= 9 s at this model's <= 100 tokens/s on one thread)."""
    body = {**COMPLETION, "max_tokens": 900, "ignore_eos": True, "stream": True}
    clustered.wait_idle()
    with clustered.http().stream("POST", "/v1/completions", json=body) as r:
        assert next(ln for ln in r.iter_lines() if ln.startswith("data: "))  # it runs
    left = time.monotonic()
    clustered.settle()  # the replicas' stats of now: running only if it was not aborted
    while clustered.engine.stats.num_running:
        assert time.monotonic() - left < 6, clustered.engine.stats  # a whole run: >= 9 s
        time.sleep(0.2)


def test_a_killed_replica_ends_its_streams_and_the_rest_are_retried(
    clustered: LiveServer,
) -> None:
    stats = routing.STATS[cluster.APP]
    before = Counter(stats.routed)
    # two prompts no test sent before (where they go: the smallest share of the tree)
    prompts = ["Once upon a time, in a quiet village,", "The history of the bicycle begins"]
    streams: list[list[str]] = [[], []]
    first = [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        body = {**COMPLETION, "prompt": prompts[i], "max_tokens": 400, "ignore_eos": True}
        with clustered.http().stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    streams[i].append(ln[6:])
                    first[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):
        t.start()
        assert first[i].wait(60)
    routed = Counter(stats.routed)
    routed.subtract(before)
    replica, running = (+routed).most_common(1)[0]  # the one running 2 streams, or 1 of 2
    assert sum(routed.values()) == 2, routed
    assert stats.tree_tokens[replica] > 0
    victim = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].endswith(replica))  # fmt: skip
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
    # requests sent now: whichever lands on the dead replica is retried on the other
    after = [answer(clustered, "/v1/completions", COMPLETION) for _ in range(3)]
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a stream hangs after its replica died"
    ended = [s[-2] for s in streams]
    assert all(s[-1] == "[DONE]" for s in streams)
    errors = [json.loads(e)["error"] for e in ended if "error" in json.loads(e)]
    assert len(errors) == running, ended  # the others finished, as asked
    assert "replica" in errors[0]["message"], errors
    assert len(set(after)) == 1 and after[0]
    deadline = time.monotonic() + 30  # Serve tells the router within a few seconds
    while replica in stats.tree_tokens:  # the dead replica's prefixes, forgotten
        assert time.monotonic() < deadline, stats.tree_tokens
        time.sleep(0.5)


def test_a_bad_ray_address_is_one_error_line(smollm2_gguf: Path) -> None:
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "dynalm.cli", "serve", str(smollm2_gguf), "--replicas", "2",
         "--ray-address", "ray://127.0.0.1:1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: no Ray cluster answers at ray://127.0.0.1:1"
    ), result.stderr
    assert time.monotonic() - t0 < 30


JOIN_S = 2.0  # the test's bound on ray.init (the command's is cluster.JOIN_TIMEOUT_S)


def test_a_port_that_answers_but_is_no_ray_cluster_is_one_error_line() -> None:
    """A listener that accepts and says nothing (Ray's ray.init would retry forever):
    `connect` gives up after its bounded wait, with one line naming the address."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        code = (
            "import sys, typer; from dynalm.cli import user_errors; "
            "from dynalm.runtime.serve import cluster; "
            f"cluster.JOIN_TIMEOUT_S = {JOIN_S}\n"
            "try:\n"
            "    with user_errors(False): cluster.connect(sys.argv[1], 1)\n"
            "except typer.Exit as e: sys.exit(e.exit_code)"
        )
        t0 = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60
        )
        took = time.monotonic() - t0
    assert result.returncode == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"error: the Ray cluster at {address} did not answer within {JOIN_S:g} s: is it a Ray "
        "head's address (GCS, port 6379, or ray:// and the client server's port, 10001)?"
    ], result.stderr
    # the wait, plus starting Python and importing Ray (~3 s on 2 busy cores); the process
    # ends though ray.init's thread still waits
    assert took < JOIN_S + 20, took


class _Stream:
    """A replica's stream as the ingress sees it: queued, one output, then nothing until
    cancelled, when it raises as Ray Serve's does."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[object]:
        return self._items()

    async def _items(self) -> AsyncIterator[object]:
        yield cluster._QUEUED
        yield RequestOutput("r", "Hi", [1], False, None, 3, 0, 1)
        await self.cancelled.wait()
        raise RequestCancelledError("r")

    def cancel(self) -> None:
        self.cancelled.set()


class _Handle:
    """A deployment handle whose every call is one `_Stream`."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.generate = self

    def options(self, stream: bool) -> _Handle:
        return self

    def remote(self, *args: object) -> _Stream:
        self.streams.append(_Stream())
        return self.streams[-1]


def test_abort_all_ends_each_request_with_abort_and_refuses_new_ones(
    smollm2: LoadedModel,
) -> None:
    """What a server's shutdown past its grace period calls: as an engine's abort_all."""

    async def run() -> None:
        handle = _Handle()
        engine = cluster.RemoteEngine(smollm2, EngineConfig(**CONFIG), handle)
        stream = engine.generate("r", [1, 2, 3], SamplingParams())
        first = await anext(stream)
        assert first.text == "Hi" and engine.has_unfinished()
        engine.abort_all()
        rest = [out async for out in stream]
        assert [(o.finished, o.finish_reason, o.completion_tokens) for o in rest] == [
            (True, "abort", 1)
        ]
        assert handle.streams[0].cancelled.is_set() and not engine.has_unfinished()
        with pytest.raises(QueueFull, match="shutting down"):
            await anext(engine.generate("s", [1], SamplingParams()))

    asyncio.run(run())
