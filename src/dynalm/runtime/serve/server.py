"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine.

Chat and completions share one path: an HTTP request becomes ``n`` engine requests per
prompt (`_Generation`), merged into one stream of outputs; the two endpoints differ
only in how outputs are written (`_ChatFormat`, `_CompletionFormat`), either as
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
import dataclasses
import functools
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from dynalm.errors import InvalidRequest, show
from dynalm.models.tokenizer import Tokenizer
from dynalm.runtime.engine.engine import RequestOutput, TokenLogprob
from dynalm.runtime.engine.guided import Guide
from dynalm.runtime.engine.prompt_logprobs import ScoredLogprob
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    APIError,
    BodyLimit,
    ClientGone,
    Route,
    error_responses,
    install_error_handlers,
    install_openapi,
)
from dynalm.runtime.serve.chat_page import install_chat_page
from dynalm.runtime.serve.embeddings import install_embeddings
from dynalm.runtime.serve.metrics import CONTENT_TYPE
from dynalm.runtime.serve.models import ModelManager, ModelService
from dynalm.runtime.serve.prompt_format import PromptEcho, joined, legacy_logprobs

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 30  # after SIGTERM, in-flight requests get this long before being aborted
_FLUSH_S = 5  # then this long to send their last chunks

T = TypeVar("T")


# ---------------------------------------------------------------- one HTTP request


@dataclass
class _Choice:
    """What one engine request produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[ScoredLogprob] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.text)
        self.chars += len(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        self.finish_reason = out.finish_reason


_QUEUED = object()  # on a `_Generation`'s queue: the engine has taken that engine request


class _Generation:
    """The engine requests behind one HTTP request (``n`` per prompt), merged into one stream.

    Each engine request is pumped by its own task into one queue; `close` cancels the
    tasks, which makes `AsyncEngine.generate` abort whatever has not finished.
    """

    def __init__(
        self,
        service: ModelService,
        request_id: str,
        jobs: Sequence[tuple[list[int], SamplingParams]],
        n: int,
        options: dict[str, Any],
        complete: Callable[[_Choice, RequestOutput], bool] | None = None,
    ) -> None:
        """``options``: what `Engine.add_request` takes beyond prompt and parameters;
        ``complete``: whether a choice's answer is whole already (the rest would be a loop),
        so its engine request ends there with finish_reason "stop"."""
        self.n = n
        self.choices = [_Choice(i) for i in range(len(jobs))]
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._ready: deque[tuple[int, object]] = deque()
        self._live = len(jobs)
        self._complete = complete
        self._cut: set[int] = set()  # choices ended by `complete`: their late outputs are dropped
        self._tasks = [
            asyncio.create_task(
                self._pump(service, i, f"{request_id}-{i}", prompt, params, options)
            )
            for i, (prompt, params) in enumerate(jobs)
        ]

    async def _pump(
        self,
        service: ModelService,
        index: int,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        options: dict[str, Any],
    ) -> None:
        tracker = service.metrics.track()
        if (guide := options.get("guide")) is not None:  # each sequence follows its own copy
            options = {**options, "guide": guide.copy()}
        queued = functools.partial(self._queue.put_nowait, (index, _QUEUED))
        try:
            assert service.async_engine is not None  # started with the server
            stream = service.async_engine.generate(
                request_id, prompt, params, queued=queued, **options
            )
            async for out in stream:
                tracker.observe(out)
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, None))
        except asyncio.CancelledError:
            tracker.aborted()
            raise
        except Exception as e:  # handed to the consumer, which turns it into a response
            self._queue.put_nowait((index, e))

    async def admitted(self) -> None:
        """Wait until the engine has queued every engine request; raise the first refusal."""
        waiting = set(range(len(self.choices)))
        while waiting:
            index, out = item = await self._queue.get()
            if isinstance(out, Exception):
                raise out
            if out is _QUEUED:
                waiting.discard(index)
            else:  # an output that overtook its engine request's own marker
                self._ready.append(item)

    async def outputs(self) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Every output in arrival order, with the choice it updated, until all finish."""
        while self._live:
            index, out = self._ready.popleft() if self._ready else await self._queue.get()
            if out is _QUEUED or index in self._cut:
                continue
            if out is None:
                self._live -= 1
                continue
            if isinstance(out, Exception):
                raise out
            choice = self.choices[index]
            choice.add(out)
            yield choice, out
            if not out.finished and self._complete is not None and self._complete(choice, out):
                self._tasks[index].cancel()  # aborts its engine request
                self._cut.add(index)
                self._live -= 1
                end = dataclasses.replace(
                    out,
                    text="",
                    token_ids=[],
                    finished=True,
                    finish_reason="stop",
                    logprobs=None if out.logprobs is None else [],
                    prompt_logprobs=None,
                )
                choice.add(end)
                yield choice, end

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    def close(self) -> None:
        """Cancel whatever still runs (synchronous: it may run inside a cancelled scope)."""
        for task in self._tasks:
            task.cancel()

    def usage(self) -> p.Usage:
        # n copies of a prompt count it once, as OpenAI does; the first copy's numbers stand
        firsts = self.choices[:: self.n]
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        return p.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=p.PromptTokensDetails(
                cached_tokens=sum(c.cached_tokens for c in firsts)
            ),
        )


# ---------------------------------------------------------------- response formats


class _Format:
    """How one endpoint writes outputs: streamed chunks and the collected response."""

    id_prefix = ""

    def __init__(self, model_name: str, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.tokenizer = tokenizer
        self.logprobs = logprobs

    def _common(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        data = self.tokenizer.token_bytes(token_id)
        return data.decode("utf-8", errors="replace"), list(data)

    def opening(self, index: int) -> BaseModel | None:
        """The chunk that opens a choice's stream, if the format has one."""
        return None

    def complete(self, choice: _Choice, out: RequestOutput) -> bool:
        """Whether ``choice``'s answer is whole after ``out`` (see `_Generation`)."""
        return False

    def chunk(
        self,
        choice: _Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None = None,
    ) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        raise NotImplementedError

    def response(self, gen: _Generation) -> BaseModel:
        raise NotImplementedError


class _ChatFormat(_Format):
    id_prefix = "chatcmpl"

    def __init__(
        self, model_name: str, tokenizer: Tokenizer, logprobs: bool, plan: tools.ToolPlan | None
    ) -> None:
        super().__init__(model_name, tokenizer, logprobs)
        self.plan = plan  # with tools: calls are read out of the text
        self._tool_streams: dict[int, tools.ToolStream] = {}

    def complete(self, choice: _Choice, out: RequestOutput) -> bool:
        # a repeated call is a loop: looked for only when a token may have closed a call
        return (
            self.plan is not None
            and out.text.rstrip().endswith(">")
            and self.plan.looping("".join(choice.text))
        )

    def _delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta and finish reason (calls go out whole at the end)."""
        if self.plan is None:
            return ({"content": text} if finish_reason is None else {}), finish_reason
        stream = self._tool_streams.setdefault(index, self.plan.stream())
        if finish_reason is None:
            content = stream.push(text)
            return ({"content": content} if content else {}), None
        rest, calls = stream.finish()
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = tools.call_deltas(calls)
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return delta, finish_reason

    def _message(self, choice: _Choice) -> tuple[p.AssistantMessage, str | None]:
        text, reason = "".join(choice.text), choice.finish_reason
        if self.plan is None:
            return p.AssistantMessage(content=text), reason
        content, calls = self.plan.parse(text)
        if not calls:
            return p.AssistantMessage(content=text), reason
        reason = "tool_calls" if reason == "stop" else reason
        return p.AssistantMessage(content=content, tool_calls=calls), reason

    def _logprobs(self, lps: Sequence[TokenLogprob] | None) -> p.ChatLogprobs | None:
        if not self.logprobs or lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token, data = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": data}

        return p.ChatLogprobs(
            content=[
                p.ChatTokenLogprob(
                    **entry(lp.token_id, lp.logprob),
                    top_logprobs=[p.TopLogprob(**entry(t, v)) for t, v in lp.top_logprobs],
                )
                for lp in lps
            ]
        )

    def opening(self, index: int) -> BaseModel:
        delta = {"role": "assistant", "content": ""}
        return p.ChatCompletionChunk(
            **self._common(), choices=[p.ChatStreamChoice(index=index, delta=delta)]
        )

    def chunk(
        self,
        choice: _Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None = None,
    ) -> BaseModel | None:
        delta, finish_reason = self._delta(choice.index, text, finish_reason)
        if not delta and finish_reason is None and not logprobs:
            return None
        streamed = p.ChatStreamChoice(
            index=choice.index,
            delta=delta,
            logprobs=self._logprobs(logprobs),
            finish_reason=finish_reason,
        )
        return p.ChatCompletionChunk(**self._common(), choices=[streamed])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.ChatCompletionChunk(**self._common(), choices=[], usage=usage)

    def response(self, gen: _Generation) -> BaseModel:
        choices = [
            p.ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._logprobs(c.logprobs),
                finish_reason=reason,
            )
            for c in gen.choices
            for message, reason in [self._message(c)]
        ]
        return p.ChatCompletion(**self._common(), choices=choices, usage=gen.usage())


class _CompletionFormat(_Format):
    id_prefix = "cmpl"

    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        logprobs: bool,
        echo: PromptEcho,
        prompts: list[list[int]],
        n: int,
    ) -> None:
        super().__init__(model_name, tokenizer, logprobs)
        self.echo, self.prompts, self.n = echo, prompts, n
        self._opened: set[int] = set()  # the choices whose first chunk went out

    def _choice(
        self,
        choice: _Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        offset: int,
        finish_reason: str | None,
        first: bool,
    ) -> p.CompletionChoice:
        """A choice's text from ``offset`` on; its first also carries what the request asked
        to see of the prompt (echo, prompt_logprobs)."""
        prompt = choice.index // self.n
        echoed = self.echo.text(prompt)
        out = p.CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=self._logprobs(logprobs, len(echoed) + offset, len(text)),
            finish_reason=finish_reason,
        )
        if first:
            scored = choice.prompt_logprobs or []
            out.text = echoed + text
            echo_logprobs = self.echo.logprobs(
                self.tokenizer, prompt, self.prompts[prompt], scored
            )
            out.logprobs = joined(echo_logprobs, out.logprobs)
            out.prompt_logprobs = self.echo.vllm(self.tokenizer, scored)
        return out

    def _logprobs(
        self, lps: Sequence[TokenLogprob] | None, offset: int, chars: int
    ) -> p.CompletionLogprobs | None:
        """The legacy format of tokens whose text is ``chars`` characters from ``offset``."""
        if not self.logprobs or lps is None:
            return None
        return legacy_logprobs(self.tokenizer, lps, offset, offset + chars)

    def chunk(
        self,
        choice: _Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None = None,
    ) -> BaseModel:
        first = choice.index not in self._opened
        self._opened.add(choice.index)
        offset = choice.chars - len(text)
        streamed = self._choice(choice, text, logprobs, offset, finish_reason, first)
        return p.Completion(**self._common(), choices=[streamed])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.Completion(**self._common(), choices=[], usage=usage)

    def response(self, gen: _Generation) -> BaseModel:
        choices = [
            self._choice(c, "".join(c.text), c.logprobs, 0, c.finish_reason, first=True)
            for c in gen.choices
        ]
        return p.Completion(**self._common(), choices=choices, usage=gen.usage())


def _event(data: BaseModel | dict[str, Any]) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


async def _sse(gen: _Generation, fmt: _Format, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's event stream: an opening chunk per choice, content, a finishing chunk per
    choice, the usage chunk if asked, ``[DONE]``. A failure after the headers went out
    can only be reported in the stream."""
    try:
        for choice in gen.choices:
            if (opening := fmt.opening(choice.index)) is not None:
                yield _event(opening)
        async for choice, out in gen.outputs():
            if out.text or out.logprobs:
                chunk = fmt.chunk(choice, out.text, out.logprobs)
                if chunk is not None:  # None: the text is held back (a tool call may begin)
                    yield _event(chunk)
            if out.finished:  # (tool calls are read here: off the event loop)
                reason = out.finish_reason or "stop"
                yield _event(await asyncio.to_thread(fmt.chunk, choice, "", None, reason))
        if include_usage:
            yield _event(fmt.usage_chunk(gen.usage()))
    except Exception as e:
        yield _event(APIError.of(e).body())
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that cancels its engine requests however the response ends."""

    def __init__(self, gen: _Generation, content: AsyncIterator[str]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._gen = gen
        self._closed: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the stream has ended, however it ended."""
        self._closed.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()
            for callback in self._closed:
                callback()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise `ClientGone`."""

    async def disconnected() -> None:
        # the body is read by now, so the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    finished = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not finished:
        raise ClientGone
    return task.result()


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
    ) -> None:
        self.models = models
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
        install_embeddings(app, self)
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
        self, name: str | None, work: Callable[[ModelService], Awaitable[Response]]
    ) -> Response:
        """Run ``work`` on the model a request names, holding that model until the response
        has ended: a stream hands its hold to the stream, which lets go when it closes."""
        self._check_open()
        service = await self.models.acquire(name)
        handed = False
        try:
            response = await work(service)
            if isinstance(response, _EventStream):
                response.on_close(functools.partial(self.models.release, service))
                handed = True
            return response
        finally:
            if not handed:
                self.models.release(service)

    # --- generation

    async def generate(
        self,
        request: Request,
        service: ModelService,
        req: p.SamplingRequest,
        prompts: list[list[int]],
        fmt: _Format,
        guide: Guide | None = None,
    ) -> Response:
        """Run ``prompts`` (``req.n`` copies each) and answer in ``fmt``: a stream as soon as
        the engine has queued them, or the collected response."""
        count, most = len(prompts) * req.n, service.engine.config.max_queue
        if count > most:  # more than could ever wait at once: retrying would not help
            raise InvalidRequest(
                f"{len(prompts)} prompt(s) x n={req.n} ask for {count} completions; "
                f"this server takes at most {most} in one request"
            )
        jobs = [
            (prompt, service.params(req, prompt, j)) for prompt in prompts for j in range(req.n)
        ]
        options = {
            "logprobs": req.top_logprob_count,
            "stop_ids": frozenset() if req.ignore_eos else None,  # None: the model's own
            "guide": guide,
            "prompt_logprobs": req.prompt_logprob_count,
        }
        gen = _Generation(service, fmt.id, jobs, req.n, options, fmt.complete)
        try:
            await _until_disconnect(request, gen.admitted())
            if req.stream:
                return _EventStream(gen, _sse(gen, fmt, req.include_usage))
            await _until_disconnect(request, gen.collect())
        except BaseException:
            gen.close()
            raise
        # reading tool calls out of the text is off the event loop, however long the answer
        body = await asyncio.to_thread(lambda: fmt.response(gen).model_dump(mode="json"))
        return JSONResponse(body)

    # --- endpoints

    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: the model's chat template renders the messages."""

        async def work(service: ModelService) -> Response:
            source = service.model.chat_template.source
            plan = await asyncio.to_thread(tools.plan, body, source)
            ids = await asyncio.to_thread(service.chat_ids, body.messages, True, plan)
            guide = await asyncio.to_thread(service.guide, body, plan)
            fmt = _ChatFormat(service.name, service.tokenizer, body.logprobs, plan)
            return await self.generate(request, service, body, [ids], fmt, guide)

        return await self.serving(body.model, work)

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
            fmt = _CompletionFormat(
                service.name, service.tokenizer, body.logprobs is not None, echo, prompts, body.n
            )
            return await self.generate(request, service, body, prompts, fmt, guide)

        return await self.serving(body.model, work)

    async def list_models(self) -> p.ModelList:
        return p.ModelList(
            data=[p.ModelCard(id=s.name, max_model_len=s.ctx) for s in self.models.loaded()]
        )

    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        """Token ids of a prompt, or of messages rendered with the chat template."""
        service = self.models.lookup(body.model)
        if body.messages is not None:
            work = service.chat_ids, body.messages, body.add_generation_prompt
        else:
            work = service.encode, body.prompt or "", body.add_special_tokens
        ids = await asyncio.to_thread(*work)
        return p.TokenizeResponse(count=len(ids), max_model_len=service.ctx, tokens=ids)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        service = self.models.lookup(body.model)
        service.check_ids(body.tokens, "tokens")
        text = await asyncio.to_thread(service.tokenizer.decode, body.tokens)
        return p.DetokenizeResponse(prompt=text)

    async def health(self) -> p.Health:
        self._check_open()
        return p.Health()

    async def prometheus(self) -> Response:
        return Response(self.models.default.metrics.render(), media_type=CONTENT_TYPE)


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


def make_server(
    api: OpenAIServer, *, verbose: bool = False, shutdown_grace_s: float = SHUTDOWN_GRACE_S
) -> UvicornServer:
    config = uvicorn.Config(
        api.app,
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
    names = ", ".join(s.name for s in models.loaded())
    print(f"serving {names} on {url_of(sock)}/v1 (Ctrl-C stops)", file=sys.stderr)
    make_server(api, verbose=verbose, shutdown_grace_s=shutdown_grace_s).run(sockets=[sock])
