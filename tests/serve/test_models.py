"""One server, many models (issue 26): loaded on demand (one load however many requests
wait for it), kept for their keep-alive, unloaded, and evicted least-recently-used under a
memory budget, never from under a request; a load that fails answers every waiter alike.

The models are the real SmolLM2 under several names (each load builds its own engine and
KV pool); `Store` is the loader a test server gets, counting what it loads.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import LiveServer, live_models, server_process

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import ModelFormatError
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.memory_plan import plan_memory
from dynalm.runtime.serve import models as models_module
from dynalm.runtime.serve.models import ModelManager, ModelService

A, B, C = "smollm2:135m", "smollm2:copy", "smollm2:third"
BROKEN = "broken:1"
STORE = [A, B, C, BROKEN]
CONFIG = {"ctx": 256, "max_num_seqs": 2}
BROKEN_MESSAGE = "broken.gguf: tensor 'blk.0.attn_q.weight' ends past the end of the file"


@dataclass
class _Prepared:
    size_bytes: int
    load: Callable[[], ModelService]


class Gate:
    """Lets an engine take ``steps`` steps, then holds it until `open`: a stream that stays
    open as long as a test needs, however fast the machine."""

    def __init__(self, steps: int) -> None:
        self.steps = threading.Semaphore(steps)
        self.opened = threading.Event()

    def wait(self) -> None:
        while not self.steps.acquire(timeout=0.02) and not self.opened.is_set():
            pass

    def open(self) -> None:
        self.opened.set()


class Store:
    """The loader: every name but BROKEN is the real model, each load its own engine; a
    load takes ``delay`` seconds, so that concurrent requests pile up behind it; the
    engines of a name in ``gates`` step only as its gate lets them."""

    def __init__(self, model: LoadedModel, delay: float = 0.0) -> None:
        self.model, self.delay = model, delay
        self.loads: Counter[str] = Counter()
        self.gates: dict[str, Gate] = {}
        self.size = plan_memory(model, EngineConfig(**CONFIG), CpuDevice()).device_bytes

    def prepare(self, name: str) -> _Prepared:
        self.loads[name] += 1
        time.sleep(self.delay)
        if name == BROKEN:
            raise ModelFormatError(BROKEN_MESSAGE)

        def load() -> ModelService:
            engine = Engine(self.model, CpuDevice(), EngineConfig(**CONFIG))
            step = engine.step

            def gated() -> object:
                if (gate := self.gates.get(name)) is not None:
                    gate.wait()
                return step()

            engine.step = gated  # type: ignore[method-assign]
            return ModelService(engine, self.model, [name])

        return _Prepared(self.size, load)


@contextmanager
def served(store: Store, names: list[str] | None = None, **limits: float) -> Iterator[LiveServer]:
    manager = ModelManager(store.prepare, names, catalog=lambda: list(STORE), **limits)
    with live_models(manager) as server:
        yield server


def complete(server: LiveServer, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    return server.http().post("/v1/completions", json=body | extra)


def loaded(server: LiveServer) -> list[str]:
    return sorted(s.name for s in server.api.models.loaded())


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextmanager
def open_stream(
    server: LiveServer, store: Store, model: str, max_tokens: int = 40
) -> Iterator[Iterator[str]]:
    """A greedy completion stream on ``model``, its first event read, its engine held (the
    model busy) until the test reads on."""
    gate = store.gates[model] = Gate(steps=2)  # the prompt, then the first token or two
    body = {
        "model": model,
        "prompt": "Count: one, two, three,",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with server.http().stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = next(lines)

            def events() -> Iterator[str]:
                yield first
                gate.open()
                yield from lines

            yield events()
    finally:
        gate.open()
        del store.gates[model]


def stream_text(lines: Iterator[str]) -> tuple[str, str | None]:
    """The text and finish reason of a completion stream's events."""
    text, reason = [], None
    for line in lines:
        if line == "data: [DONE]":
            return "".join(text), reason
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        text.append(choice["text"])
        reason = choice["finish_reason"] or reason
    raise AssertionError("the stream ended without [DONE]")


def greedy(server: LiveServer, model: str, max_tokens: int = 40) -> str:
    body = {"prompt": "Count: one, two, three,", "max_tokens": max_tokens, "ignore_eos": True}
    r = complete(server, model, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def on_loop(server: LiveServer, coroutine: object) -> object:
    """Run a manager coroutine on the server's event loop."""
    loop = server.api.models._loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=60)  # type: ignore[arg-type]


# ---------------------------------------------------------------- loading


def test_two_models_are_served_at_once_with_one_metrics_exposition(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=-1) as server:
        with open_stream(server, store, A) as a, open_stream(server, store, B) as b:
            assert loaded(server) == [A, B]
            (text_a, reason_a), (text_b, reason_b) = stream_text(a), stream_text(b)
        assert reason_a == reason_b == "length" and text_a == text_b  # the same weights
        assert store.loads == Counter({A: 1, B: 1})

        models = server.http().get("/v1/models").json()["data"]
        assert [(m["id"], m["loaded"]) for m in models] == [
            (A, True), (B, True), (C, False), (BROKEN, False)
        ]  # fmt: skip
        assert models[0]["max_model_len"] == CONFIG["ctx"] and models[2]["max_model_len"] is None

        text = server.http().get("/metrics").text
        # one exposition: each family's HELP and TYPE once, the models told apart by label
        for name in ("dynalm:generation_tokens_total", "dynalm:num_requests_running",
                     "process_resident_memory_bytes"):  # fmt: skip
            assert text.count(f"# HELP {name} ") == 1 and text.count(f"# TYPE {name} ") == 1
        tokens = {
            s.labels["model_name"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "dynalm:generation_tokens_total"
        }
        assert tokens == {A: 40, B: 40}


def test_concurrent_first_requests_wait_for_one_load(smollm2: LoadedModel):
    store = Store(smollm2, delay=0.5)
    with served(store) as server, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: complete(server, A), range(4)))
        assert [r.status_code for r in answers] == [200] * 4
        assert store.loads == Counter({A: 1}) and server.api.models.loads == 1
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1


def test_a_failed_load_answers_every_waiter_with_its_error(smollm2: LoadedModel):
    store = Store(smollm2, delay=0.5)
    with served(store) as server, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: complete(server, BROKEN), range(3)))
        assert store.loads[BROKEN] == 1  # one load, its error to each
        for r in answers:
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["message"] == f"could not load the model '{BROKEN}': {BROKEN_MESSAGE}"
            assert error["code"] == "model_load_failed"
        # a failure is not remembered: the next request tries again; the server serves on
        assert complete(server, BROKEN).status_code == 500 and store.loads[BROKEN] == 2
        assert complete(server, A).status_code == 200
        assert loaded(server) == [A]


def test_an_unknown_model_is_404_listing_the_stores_models(smollm2: LoadedModel):
    with served(Store(smollm2)) as server:
        r = complete(server, "nope:1")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["message"] == (
            f"the model 'nope:1' does not exist (this server has {', '.join(STORE)})"
        )
        assert error["param"] == "model" and error["code"] == "model_not_found"
        # with no model named at start, a request must name one
        r = server.http().post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 400 and "name one in 'model'" in r.json()["error"]["message"]


def test_the_stores_listing_is_read_once_per_ttl_not_per_request(smollm2: LoadedModel, monkeypatch):
    listings = []

    def catalog() -> list[str]:
        listings.append(time.monotonic())
        return list(STORE)

    manager = ModelManager(Store(smollm2).prepare, catalog=catalog)
    for _ in range(50):
        assert manager.lookup(A) is None and A in manager.available()
    assert len(listings) == 1
    monkeypatch.setattr(models_module, "CATALOG_TTL_S", 0.0)  # a pull shows at the next look
    manager.available()
    assert len(listings) == 2


def test_a_given_model_unloaded_by_request_is_503_not_reloaded(smollm2: LoadedModel):
    service = Store(smollm2).prepare(A).load()
    with live_models(ModelManager.of([service])) as server:
        assert complete(server, A, keep_alive=0).status_code == 200
        wait_until(lambda: loaded(server) == [])
        r = complete(server, A)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "model_unloaded"
        assert error["message"] == (
            f"the model '{A}' was unloaded and this server cannot load it again "
            "(it was given to it loaded): restart the server"
        )
        assert server.http().get("/health").status_code == 200  # and it keeps serving


def test_models_named_at_start_are_the_only_ones_and_the_first_is_the_default(
    smollm2: LoadedModel,
):
    store = Store(smollm2)
    with served(store, [B, A]) as server:
        assert complete(server, C).status_code == 404
        r = server.http().post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == B
        assert server.api.models.default is not None and server.api.models.default.name == B
        ids = [m["id"] for m in server.http().get("/v1/models").json()["data"]]
        assert ids == [B, A]


# ---------------------------------------------------------------- keep-alive and unloading


def assert_freed(refs: list[weakref.ref]) -> None:
    """The unloaded model's engine and KV pool are gone (nothing holds them) once its
    shutdown, which runs in a worker thread after the model leaves the loaded list, ends."""

    def freed() -> bool:
        gc.collect()
        return [r() for r in refs] == [None] * len(refs)

    wait_until(freed, timeout=10)


def test_an_idle_model_unloads_when_its_keep_alive_expires(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=1.0) as server:
        assert complete(server, A).status_code == 200
        service = server.api.models.loaded()[0]
        expires = service.expires_at
        assert expires is not None and 0 < expires - time.time() <= 1.0
        refs = [weakref.ref(service.engine), weakref.ref(service.engine.pool)]
        del service
        wait_until(lambda: loaded(server) == [])
        assert time.time() >= expires
        assert_freed(refs)
        assert complete(server, A).status_code == 200 and store.loads[A] == 2  # loaded again


def test_keep_alive_zero_unloads_after_the_answer_and_negative_keeps(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=1.0) as server:
        assert complete(server, A, keep_alive=0).status_code == 200
        wait_until(lambda: A not in loaded(server), timeout=10)
        chat = {"model": B, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        r = server.http().post("/v1/chat/completions", json=chat | {"keep_alive": "-1"})
        assert r.status_code == 200
        r = server.http().post(
            "/v1/chat/completions", json=chat | {"model": C, "keep_alive": "10m"}
        )
        assert r.status_code == 200
        expires = {s.name: s.expires_at for s in server.api.models.loaded()}
        assert expires[B] is None and 590 < expires[C] - time.time() <= 600  # type: ignore[operator]
        time.sleep(1.5)  # past the server's keep-alive: both stay
        assert loaded(server) == [B, C]


def test_a_bad_keep_alive_is_400_naming_it(smollm2: LoadedModel):
    with served(Store(smollm2)) as server:
        for bad in ("5 minutes", True, [1], "1e999"):
            r = complete(server, A, keep_alive=bad)
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["param"] == "keep_alive" and error["message"].startswith("keep_alive: ")
        assert loaded(server) == []  # refused before any load


def test_unload_waits_for_the_requests_holding_the_model(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=-1) as server:
        models = server.api.models
        with open_stream(server, store, A) as lines:
            assert on_loop(server, models.unload(A)) is True
            assert loaded(server) == [A]  # not from under the stream
            text, reason = stream_text(lines)
        assert reason == "length" and text == greedy(server, B)  # nothing lost
        wait_until(lambda: A not in loaded(server))
        assert on_loop(server, models.unload(A)) is False  # not loaded
        assert on_loop(server, models.unload(B)) is True and loaded(server) == []


# ---------------------------------------------------------------- memory budget


def test_an_idle_model_is_evicted_to_make_room(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=-1, max_memory=store.size * 3 // 2) as server:
        assert complete(server, A).status_code == 200
        refs = [weakref.ref(s.engine.pool) for s in server.api.models.loaded()]
        assert complete(server, B).status_code == 200
        assert loaded(server) == [B]
        assert_freed(refs)
        # least recently used first: A is older than C
        assert complete(server, A).status_code == 200 and loaded(server) == [A]


def test_max_loaded_evicts_the_least_recently_used(smollm2: LoadedModel):
    with served(Store(smollm2), keep_alive=-1, max_loaded=2) as server:
        for model in (A, B, A, C):  # B is now the least recently used
            assert complete(server, model).status_code == 200
        assert loaded(server) == [A, C]


def test_a_busy_model_is_never_evicted_503_names_what_is_busy(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, keep_alive=-1, max_memory=store.size * 3 // 2) as server:
        expected = greedy(server, A)
        with open_stream(server, store, A) as lines:
            r = complete(server, B)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            message = r.json()["error"]["message"]
            assert re.fullmatch(
                rf"cannot load '{B}' now: it needs \d+ MiB and \d+ MiB of the \d+ MiB budget "
                rf"\(--max-memory\) is free; the loaded models are all in use: "
                rf"{A} \(\d+ MiB, 1 request\(s\) running\)",
                message,
            ), message
            assert r.json()["error"]["code"] == "no_room_for_model"
            text, reason = stream_text(lines)
        assert (text, reason) == (expected, "length")
        assert complete(server, B).status_code == 200 and loaded(server) == [B]  # A idle now


def test_a_model_too_large_for_the_budget_is_503(smollm2: LoadedModel):
    store = Store(smollm2)
    with served(store, max_memory=store.size // 2) as server:
        r = complete(server, A)
        assert r.status_code == 503
        assert re.fullmatch(
            rf"cannot load '{A}': it needs \d+ MiB, more than the whole memory budget of "
            r"\d+ MiB \(--max-memory\)",
            r.json()["error"]["message"],
        )


def test_a_stream_kept_open_while_another_model_loads_under_pressure_ends_intact(
    smollm2: LoadedModel,
):
    store = Store(smollm2)
    with served(store, keep_alive=-1, max_memory=store.size * 5 // 2) as server:
        expected = greedy(server, A, max_tokens=60)
        assert complete(server, B).status_code == 200  # now A, then B, idle: room for two
        with open_stream(server, store, A, max_tokens=60) as lines:
            # C needs room: B (idle) goes, A (streaming) stays and keeps streaming
            assert complete(server, C).status_code == 200
            assert loaded(server) == [A, C]
            text, reason = stream_text(lines)
        assert (text, reason) == (expected, "length")


# ---------------------------------------------------------------- the command line


def write_store(root: Path, gguf: Path, names: list[str]) -> None:
    """A model store holding ``gguf`` under each of ``names`` (copied manifests)."""
    for name in names:
        model, tag = name.split(":")
        directory = root / "models" / model / tag
        directory.mkdir(parents=True)
        (directory / gguf.name).symlink_to(gguf)
        manifest = {
            "name": model,
            "tag": tag,
            "filename": gguf.name,
            "sha256": None,
            "size": gguf.stat().st_size,
            "source": "test",
            "pulled_at": "2026-01-01T00:00:00Z",
        }
        (directory / "manifest.json").write_text(json.dumps(manifest))


def test_dynalm_serve_with_no_model_serves_the_store_on_demand(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch
):
    write_store(tmp_path / "store", smollm2_gguf, ["tiny:a", "tiny:b"])
    monkeypatch.setenv("DYNALM_HOME", str(tmp_path / "store"))
    args = ["-m", "dynalm.cli", "serve", "--port", "0", "--ctx", "256", "--max-loaded", "1"]
    with server_process([*args, "--keep-alive", "30s"], tmp_path / "stderr.txt") as server:
        assert "serving tiny:a, tiny:b on" in server.stderr()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            ids = [(m["id"], m["loaded"]) for m in http.get("/v1/models").json()["data"]]
            assert ids == [("tiny:a", False), ("tiny:b", False)]
            body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
            for model in ("tiny:a", "tiny:b"):
                r = http.post("/v1/completions", json=body | {"model": model})
                assert r.status_code == 200 and r.json()["model"] == model
            # --max-loaded 1: tiny:b's load unloaded tiny:a
            ids = [(m["id"], m["loaded"]) for m in http.get("/v1/models").json()["data"]]
            assert ids == [("tiny:a", False), ("tiny:b", True)]


def test_dynalm_serve_several_models_preloads_them(smollm2_gguf: Path, tmp_path: Path):
    copy = tmp_path / "other.gguf"
    copy.symlink_to(smollm2_gguf)  # a second name for the model (no copy to repack)
    args = ["-m", "dynalm.cli", "serve", str(smollm2_gguf), str(copy), "--port", "0"]
    with (
        server_process([*args, "--ctx", "256"], tmp_path / "stderr.txt") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        models = {m["id"]: m["loaded"] for m in http.get("/v1/models").json()["data"]}
        assert models == {smollm2_gguf.stem: True, "other": True}
        body = {"model": "other", "prompt": "Hi", "max_tokens": 1}
        assert http.post("/v1/completions", json=body).status_code == 200


def test_dynalm_serve_refuses_a_model_larger_than_max_memory_at_start(smollm2_gguf: Path):
    args = ["serve", str(smollm2_gguf), "--port", "0", "--max-memory", "16MiB"]
    result = subprocess.run(
        [sys.executable, "-m", "dynalm.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert re.fullmatch(
        rf"error: {smollm2_gguf.stem} needs \d+ MiB, more than the memory budget of 16 MiB "
        r"\(--max-memory\)\n",
        result.stderr,
    ), result.stderr
