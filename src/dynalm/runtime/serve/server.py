"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine.

Chat and completions share one path: an HTTP request becomes ``n`` engine requests per
prompt (`Generation`), merged into one stream of outputs; the two endpoints differ
only in how outputs are written (`ChatFormat`, `CompletionFormat`), either as
server-sent events or collected into one response.

A request is answered only once the engine has queued each of its engine requests, so
what the engine refuses at admission (prompt over the context, queue full) is the right
HTTP status instead of a broken stream; a stream's status and headers go out at that
moment, before the request waits for a slot or its prompt is prefilled. A client that
disconnects at any point cancels its engine requests; `AsyncEngine` then aborts them and
frees their pages.
SIGTERM / SIGINT: new requests get 503 with Retry-After (the port stays open while
draining), in-flight ones get ``SHUTDOWN_GRACE_S`` to finish; then they are aborted, so each
answer still ends properly (``finish_reason: "abort"``, ``data: [DONE]``), and the process
exits 0.

Hostile input is answered with 4xx, never 500 (`asgi`); tokenising, chat-template rendering,
grammar compiling and reading tool calls out of an answer run off the event loop, and text
that could not fit the context is refused before it is tokenised, so a huge prompt or answer
never stalls other clients or ``/health``. An answer whose grammar gave up fails (an error,
never ``finish_reason: "stop"`` with text that does not match).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynalm.errors import InvalidRequest, show
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    APIError,
    BodyLimit,
    Route,
    error_responses,
    install_error_handlers,
    install_openapi,
)
from dynalm.runtime.serve.chat_page import install_chat_page
from dynalm.runtime.serve.embeddings import install_embeddings
from dynalm.runtime.serve.generation import (
    ChatFormat,
    CompletionFormat,
    EventStream,
    run_generation,
)
from dynalm.runtime.serve.metrics import CONTENT_TYPE
from dynalm.runtime.serve.metrics import render as render_metrics
from dynalm.runtime.serve.models import ModelManager, ModelService, ServedModel
from dynalm.runtime.serve.ollama import install_ollama
from dynalm.runtime.serve.prompt_format import PromptEcho
from dynalm.runtime.serve.rerank import install_rerank
from dynalm.store.catalog import ModelStore

log = logging.getLogger(__name__)
S = TypeVar("S", bound=ServedModel)

HEAD_TIMEOUT_S = 30.0  # a request's line and headers must arrive within this, from its start
SHUTDOWN_GRACE_S = 30  # after SIGTERM, in-flight requests get this long before being aborted
_FLUSH_S = 5  # then this long to send their last chunks

# ---------------------------------------------------------------- the application


class OpenAIServer:
    """The endpoints over the models of a `ModelManager`; `app` is the ASGI application."""

    def __init__(
        self,
        models: ModelManager,
        *,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        store: ModelStore | None = None,
    ) -> None:
        self.models = models
        self.store = store or ModelStore()  # what /api/tags lists, /api/pull fills
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.draining = False  # set on SIGTERM: refuse new work while in-flight requests end
        self.app = self._build_app()

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.models.start()
        try:
            yield
        finally:
            self.draining = True
            # uvicorn has let in-flight responses finish (or cancelled them): abort leftovers
            await asyncio.to_thread(self.models.shutdown, drain=False)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="DynaLM", lifespan=self._lifespan)
        app.router.route_class = Route
        app.add_middleware(BodyLimit, limit=self.max_body_bytes, timeout_s=self.body_timeout_s)
        install_error_handlers(app)
        install_openapi(app)
        guarded = [Depends(self._authorize)]
        generation = error_responses(400, 401, 404, 408, 413, 500, 503)
        lookup = error_responses(400, 401, 404, 408, 413)

        def answer(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
            sse = {"schema": {"type": "string"}}  # with "stream": true, server-sent events
            return {200: {"model": model, "content": {"text/event-stream": sse}}}

        app.post(
            "/v1/chat/completions",
            dependencies=guarded,
            response_model=None,
            responses={**answer(p.ChatCompletion), **generation},
        )(self.chat_completions)
        app.post(
            "/v1/completions",
            dependencies=guarded,
            response_model=None,
            responses={**answer(p.Completion), **generation},
        )(self.completions)
        app.get("/v1/models", dependencies=guarded, responses=error_responses(401))(
            self.list_models
        )
        app.post("/tokenize", dependencies=guarded, responses=lookup)(self.tokenize)
        app.post("/detokenize", dependencies=guarded, responses=lookup)(self.detokenize)
        app.get("/health", responses=error_responses(503))(self.health)
        app.get(
            "/metrics",
            response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        )(self.prometheus)

        install_ollama(app, self, guarded)
        install_embeddings(app, self.serving, guarded)
        install_rerank(app, self.serving, guarded)
        install_chat_page(app)
        return app

    # --- checks

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )

    def _check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    async def serving(
        self,
        name: str | None,
        work: Callable[[S], Awaitable[Response]],
        keep_alive: float | None = None,
        kind: type[S] = ModelService,  # type: ignore[assignment]
    ) -> Response:
        """Run ``work`` on the model a request names (loaded if need be), holding that model
        until the response has ended: a stream hands its hold to the stream, which lets go
        when it closes. ``keep_alive``: the request's (None: the server's); ``kind``: what
        the endpoint needs (a generation model, or an embedding model): another is a 400."""
        self._check_open()
        service = await self.models.acquire(name, keep_alive)
        handed = False
        try:
            if not isinstance(service, kind):
                raise InvalidRequest(
                    f"the model '{p.clip(service.name, 100)}' is {service.serves} "
                    f"({service.model.hparams.arch}); this endpoint needs {kind.serves}"
                )
            response = await work(service)
            if isinstance(response, EventStream):
                response.on_close(functools.partial(self.models.release, service))
                handed = True
            return response
        finally:
            if not handed:
                self.models.release(service)

    # --- endpoints

    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: the model's chat template renders the messages."""

        async def work(service: ModelService) -> Response:
            source = service.model.chat_template.source
            plan = await asyncio.to_thread(tools.plan, body, source)
            ids = await asyncio.to_thread(
                service.chat_ids, body.messages, True, plan, body.reasoning_effort
            )
            guide = await asyncio.to_thread(service.guide, body, plan)
            fmt = ChatFormat(service.name, service.tokenizer, body.logprobs, plan)
            return await run_generation(request, service, body, [ids], fmt, guide)

        return await self.serving(body.model, work, body.keep_alive)

    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        """OpenAI's (legacy) completions: raw prompts, strings or token ids, one or a batch."""

        async def work(service: ModelService) -> Response:
            prompts = await asyncio.to_thread(service.prompt_ids, body.prompts)
            guide = await asyncio.to_thread(service.guide, body)
            texts = None
            if body.echo:  # the prompt as given; token ids as their text
                decode = service.tokenizer.decode
                texts = await asyncio.to_thread(
                    lambda: [x if isinstance(x, str) else decode(x) for x in body.prompts]
                )
            echo = PromptEcho(
                texts=texts,
                echo_top=body.logprobs,
                vllm_top=body.prompt_logprobs,
            )
            fmt = CompletionFormat(
                service.name, service.tokenizer, body.logprobs is not None, echo, prompts, body.n
            )
            return await run_generation(request, service, body, prompts, fmt, guide)

        return await self.serving(body.model, work, body.keep_alive)

    async def list_models(self) -> p.ModelList:
        """Every model a request may name; those loaded now say so, with their context."""
        loaded = {name: s for s in self.models.loaded() for name in s.names}
        cards = []
        for name in self.models.available():
            if (service := loaded.get(name)) is None:
                cards.append(p.ModelCard(id=name, loaded=False))
            elif name == service.name:  # a loaded model once, by its first name
                cards.append(p.ModelCard(id=name, max_model_len=service.ctx))
        return p.ModelList(data=cards)

    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        """Token ids of a prompt, or of messages rendered with the chat template."""

        async def work(service: ModelService) -> Response:
            if body.messages is not None:
                job = service.chat_ids, body.messages, body.add_generation_prompt
            else:
                job = service.encode, body.prompt or "", body.add_special_tokens
            ids = await asyncio.to_thread(*job)
            answer = p.TokenizeResponse(count=len(ids), max_model_len=service.ctx, tokens=ids)
            return JSONResponse(answer.model_dump(mode="json"))

        return await self.serving(body.model, work)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        async def work(service: ModelService) -> Response:
            service.check_ids(body.tokens, "tokens")
            text = await asyncio.to_thread(service.tokenizer.decode, body.tokens)
            return JSONResponse(p.DetokenizeResponse(prompt=text).model_dump(mode="json"))

        return await self.serving(body.model, work)

    async def health(self) -> p.Health:
        self._check_open()
        return p.Health()

    async def prometheus(self) -> Response:
        """The process's metrics and each loaded model's, labelled by model_name."""
        body = render_metrics([s.metrics for s in self.models.loaded()])
        return Response(body, media_type=CONTENT_TYPE)


# ---------------------------------------------------------------- running it


class UvicornServer(uvicorn.Server):
    """uvicorn that drains on a signal: the port stays open and new requests get 503 while
    in-flight ones finish, for at most ``shutdown_grace_s``; then what still runs is aborted
    (each answer ends with ``finish_reason: "abort"``), and the process exits normally (plain
    uvicorn stops listening at once, cancels late responses mid-body, and re-raises the
    signal, so SIGTERM would end the process with status 143)."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, shutdown_grace_s: float) -> None:
        super().__init__(config)
        self.api = api
        self.grace = shutdown_grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.api.draining = True
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread (tests run servers in threads)
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def _requests_end(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every request in progress to end; False if some still run."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.server_state.tasks and not self.force_exit:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.api.draining = True
        if not await self._requests_end(self.grace) and not self.force_exit:
            log.warning("aborting the requests still running after %s s", self.grace)
            self.api.models.abort_all()
            await self._requests_end(_FLUSH_S)
        await super().shutdown(sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket (port 0 picks a free one); fails early if taken. ``host``
    is an IPv4 address or name, or an IPv6 address, bare (``::1``, ``::``) or in the brackets
    of a URL (``[::1]``)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it each keep-alive response (and stream chunk) waited ~40 ms for a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening before the URL is printed: a client that connects while the server still
        # starts (the lifespan can take seconds on a cold kernel cache) waits in the backlog
        # instead of being refused.
        sock.listen(2048)
    except socket.gaierror as e:  # not an address, and no name resolves to one
        sock.close()
        raise InvalidRequest(f"--host {show(host, 100)}: {e.strerror}") from None
    except OSError:
        sock.close()
        raise
    return sock


class HeadDeadline(HttpToolsProtocol):
    """uvicorn's HTTP protocol with a deadline on each request's head (request line and
    headers): uvicorn times out only idle keep-alive connections, so a client that opened a
    connection, or began a request, and never finished its headers held a connection for
    good (slowloris). Past ``HEAD_TIMEOUT_S`` it gets a 408 and the connection is closed;
    the body has its own deadline (`asgi.BodyLimit`)."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # between a pipelined request's head and its response: not ours to cut
        if not self.transport.is_closing():
            self.transport.write(_HEAD_TIMEOUT_RESPONSE)
            self.transport.close()


_HEAD_TIMEOUT_BODY = b"the request's headers did not arrive in time\n"
_HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY)
)


def make_server(
    api: OpenAIServer,
    *,
    verbose: bool = False,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    head_timeout_s: float = HEAD_TIMEOUT_S,
) -> UvicornServer:
    protocol = type("HeadDeadline", (HeadDeadline,), {"head_timeout_s": head_timeout_s})
    config = uvicorn.Config(
        api.app,
        http=protocol,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        lifespan="on",
        timeout_graceful_shutdown=_FLUSH_S,  # after our own drain (`UvicornServer.shutdown`)
    )
    return UvicornServer(config, api, shutdown_grace_s)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(
    models: ModelManager,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    verbose: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
) -> None:
    """Serve until SIGTERM / SIGINT; the URL goes to stderr once the port is bound."""
    api = OpenAIServer(models, api_key=api_key, max_body_bytes=max_body_bytes)
    sock = bind_socket(host, port)
    names = ", ".join(models.available()) or "the store's models (none yet)"
    print(f"serving {names} on {url_of(sock)}/v1 (Ctrl-C stops)", file=sys.stderr)
    make_server(api, verbose=verbose, shutdown_grace_s=shutdown_grace_s).run(sockets=[sock])
