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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

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

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine has no running or waiting request (aborts land at a step)."""
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
