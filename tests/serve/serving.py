"""A real DynaLM server on 127.0.0.1 for the serve tests: uvicorn in a background
thread on a free port, the real engine and the real SmolLM2 model (`live_server`; models
loaded on demand by a `ModelManager`: `live_models`), or a server process
(`server_process`) for what only a process shows: signals, exit status, its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.serve.asgi import BODY_TIMEOUT_S, MAX_BODY_BYTES
from dynalm.runtime.serve.models import ModelManager, ModelService
from dynalm.runtime.serve.server import (
    HEAD_TIMEOUT_S,
    OpenAIServer,
    bind_socket,
    make_server,
    url_of,
)
from dynalm.store.catalog import ModelStore

MODEL = "smollm2:135m"


@dataclass
class LiveServer:
    url: str
    api: OpenAIServer
    api_key: str | None

    @property
    def service(self) -> ModelService:
        """The one model this test server has."""
        service = self.api.models.default
        assert service is not None
        return service

    @property
    def engine(self) -> Engine:
        return self.service.engine

    def client(self) -> openai.OpenAI:
        # no retries: a test must see the first answer, 503s included
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def settle(self) -> None:
        """On a cluster, until the replicas' engine stats (``/metrics``, ``engine.stats``)
        are those of now: Serve's controller polls them every second, then broadcasts."""
        if on_cluster(self):
            from dynalm.runtime.serve.cluster import STATS_PERIOD_S

            time.sleep(3 * STATS_PERIOD_S)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine has no running or waiting request (aborts land at a step); on
        a cluster, the replicas' engines as they report (every second, see `cluster`)."""
        self.settle()
        deadline = time.monotonic() + timeout
        while (s := self.engine.stats).num_running or s.num_waiting:
            assert time.monotonic() < deadline, f"engine still busy: {s}"
            time.sleep(0.05)


@contextmanager
def live_server(
    model: LoadedModel,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    host: str = "127.0.0.1",
    store: ModelStore | None = None,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    **config: int,
) -> Iterator[LiveServer]:
    engine = Engine(model, CpuDevice(), EngineConfig(**config))
    manager = ModelManager.of([ModelService(engine, model, [MODEL, model.path.stem])])
    with live_models(
        manager,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        host=host,
        store=store,
        head_timeout_s=head_timeout_s,
    ) as server:
        yield server


@contextmanager
def live_models(
    models: ModelManager,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    host: str = "127.0.0.1",
    store: ModelStore | None = None,
    head_timeout_s: float = HEAD_TIMEOUT_S,
) -> Iterator[LiveServer]:
    """A live server of the models ``models`` manages (`live_server`: one model)."""
    # never the user's store: /api/delete and /api/pull (fuzzed too) must not touch it
    empty = tempfile.TemporaryDirectory(prefix="dynalm-store-")
    store = store or ModelStore(Path(empty.name), catalog={})
    api = OpenAIServer(
        models,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        store=store,
    )
    sock = bind_socket(host, 0)
    server = make_server(api, head_timeout_s=head_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(url_of(sock), api, api_key)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        empty.cleanup()


# ------------------------------------------------------------ the same tests on a cluster

SERVERS = ["one process", "cluster"]  # a module's `server` fixture, parametrised by these
CLUSTER_REPLICAS = 2
_SERVER_OPTIONS = ("api_key", "max_body_bytes", "body_timeout_s", "host", "store", "head_timeout_s")


@dataclass
class _Replica:
    """What a replica loads: a picklable stand-in of `serve`'s prepared model (the engine
    of `live_server`, one thread)."""

    path: str
    names: list[str]
    config: dict[str, int]

    def load(self) -> ModelService:
        from dynalm.models.loader import load_model

        model = load_model(Path(self.path))
        engine = Engine(model, CpuDevice(threads=1), EngineConfig(**self.config))
        return ModelService(engine, model, self.names)


@dataclass
class ClusterPrepare:
    """`serve`'s ``prepare`` for the replicas: every name gives the one model."""

    path: str
    names: list[str]
    config: dict[str, int]

    def __call__(self, name: str) -> _Replica:
        return _Replica(self.path, self.names, self.config)


@contextmanager
def live_cluster(
    model: LoadedModel,
    *,
    replicas: int = CLUSTER_REPLICAS,
    router: str = "prefix",
    prepare: Callable[[str], Any] | None = None,
    **kw: Any,
) -> Iterator[LiveServer]:
    """`live_server` (the same server options and engine config in ``kw``) with its engine
    on ``replicas`` Ray Serve replicas (``dynalm serve --replicas``) of the Ray cluster this
    process is connected to (see `ray_local`); the app deleted after. The replicas load
    ``model`` (or what ``prepare``, picklable, gives)."""
    import ray
    from ray import serve

    from dynalm.runtime.serve import cluster, routing

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on their path
    if not ray.is_initialized():  # the first, or a test of its own cluster ended this one
        cluster.connect(None, CLUSTER_REPLICAS)
    names = [MODEL, model.path.stem]
    options = {k: kw.pop(k) for k in _SERVER_OPTIONS if k in kw}
    config: dict[str, int] = kw
    try:
        prepare = prepare or ClusterPrepare(str(model.path), names, config)
        handle = cluster.deploy(prepare, MODEL, replicas, 1, router)
        service = cluster.ClusterModelService(model, EngineConfig(**config), names, handle)
        with live_models(ModelManager.of([service]), **options) as server:
            yield server
    finally:
        serve.delete(cluster.APP)
        # Ray Serve keeps this process's router for the next app of that name: its counts,
        # what /metrics shows and the tests read, start over
        if (stats := routing.STATS.get(cluster.APP)) is not None:
            stats.__init__(stats.policy)  # type: ignore[misc]


@contextmanager
def served(request: pytest.FixtureRequest, model: LoadedModel, **kw: Any) -> Iterator[LiveServer]:
    """`live_server`, or `live_cluster` when the fixture's param (one of `SERVERS`) says so."""
    if request.param == "cluster":
        request.getfixturevalue("ray_local")  # skips, saying why, without Ray
        with live_cluster(model, **kw) as server:
            yield server
    else:
        with live_server(model, **kw) as server:
            yield server


def on_cluster(server: LiveServer) -> bool:
    return type(server.service).__name__ == "ClusterModelService"


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def stderr(self) -> str:
        return self.log.read_text()


@contextmanager
def server_process(args: list[str], log: Path) -> Iterator[ServerProcess]:
    """Run a server command (``args`` after the Python interpreter) until it prints its URL;
    kill it at the end if it still runs."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=stderr, env=dict(os.environ)
        )
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on (http://\S+:\d+)/v1", log.read_text())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no URL on stderr"
            time.sleep(0.1)
        yield ServerProcess(proc, m.group(1), log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
