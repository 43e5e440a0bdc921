"""One HTTP request's generation, apart from the API it came through: its engine requests
merged into one stream (`Generation`), and the formats that write the outputs (`Format`:
OpenAI's chat and completions here; Ollama's in ``ollama``), streamed or collected.

A request is answered only once the engine has queued each of its engine requests, so what
the engine refuses at admission (prompt over the context, queue full) is the right HTTP
status instead of a broken stream. A client that disconnects at any point cancels its engine
requests (`until_disconnect`, `EventStream`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from dynalm.errors import InvalidRequest
from dynalm.models.tokenizer import Tokenizer
from dynalm.runtime.engine.engine import RequestOutput, TokenLogprob
from dynalm.runtime.engine.guided import Guide
from dynalm.runtime.engine.prompt_logprobs import ScoredLogprob
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import (
    APIError,
    ClientGone,
)
from dynalm.runtime.serve.harmony import HarmonyText
from dynalm.runtime.serve.models import ModelService
from dynalm.runtime.serve.prompt_format import PromptEcho, joined, legacy_logprobs

T = TypeVar("T")


# ---------------------------------------------------------------- one HTTP request


@dataclass
class Choice:
    """What one engine request produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[ScoredLogprob] | None = None
    # time.monotonic() of its first and latest output (Ollama reports the durations)
    first_at: float | None = None
    last_at: float | None = None

    def add(self, out: RequestOutput) -> None:
        self.last_at = time.monotonic()
        if self.first_at is None:
            self.first_at = self.last_at
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.chars += len(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        self.finish_reason = out.finish_reason


_QUEUED = object()  # on a `Generation`'s queue: the engine has taken that engine request


class Generation:
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
        complete: Callable[[Choice, RequestOutput], bool] | None = None,
    ) -> None:
        """``options``: what `Engine.add_request` takes beyond prompt and parameters;
        ``complete``: whether a choice's answer is whole already (the rest would be a loop),
        so its engine request ends there with finish_reason "stop"."""
        self.n = n
        self.created = time.monotonic()
        self.choices = [Choice(i) for i in range(len(jobs))]
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

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
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


class Format:
    """How one endpoint writes outputs: streamed chunks and the collected response."""

    id_prefix = ""
    media_type = "text/event-stream"

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

    def complete(self, choice: Choice, out: RequestOutput) -> bool:
        """Whether ``choice``'s answer is whole after ``out`` (see `Generation`)."""
        return False

    def chunk(
        self,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None = None,
    ) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        raise NotImplementedError

    def response(self, gen: Generation) -> BaseModel:
        raise NotImplementedError

    def body(self, gen: Generation) -> dict[str, Any]:
        """The collected response's JSON (blocking: tool calls are read out of the text)."""
        return self.response(gen).model_dump(mode="json")

    def stream(self, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
        """The streamed response, in `media_type`."""
        return sse(gen, self, include_usage)


class ChatFormat(Format):
    id_prefix = "chatcmpl"

    def __init__(
        self, model_name: str, tokenizer: Tokenizer, logprobs: bool, plan: tools.ToolPlan | None
    ) -> None:
        super().__init__(model_name, tokenizer, logprobs)
        self.plan = plan  # with tools: calls are read out of the text
        self._tool_streams: dict[int, tools.ToolStream | tools.HarmonyStream] = {}
        self._decoded: dict[int, tuple[HarmonyText, int]] = {}  # by choice: see `_read`

    def complete(self, choice: Choice, out: RequestOutput) -> bool:
        # a repeated call is a loop: looked for only when a token may have closed a call
        return (
            self.plan is not None
            and out.text.rstrip().endswith(">")
            and self.plan.looping("".join(choice.text))
        )

    def _read(self, choice: Choice, text: str, end: bool = False) -> str:
        """The text the plan reads of ``choice``'s latest output: ``text``, or for a plan that
        reads control tokens (harmony), the new tokens decoded with the control tokens of its
        format (the engine's text has none) and without the rest (the stop token)."""
        if self.plan is None or not self.plan.reads_control_tokens:
            return text
        reader, done = self._decoded.get(choice.index) or (HarmonyText(self.tokenizer), 0)
        self._decoded[choice.index] = reader, len(choice.token_ids)
        return reader.push(choice.token_ids[done:]) + (reader.flush() if end else "")

    def _delta(
        self, choice: Choice, text: str, finish_reason: str | None
    ) -> tuple[dict, str | None]:
        """A streamed chunk's delta and finish reason (calls go out whole at the end)."""
        if self.plan is None:
            return ({"content": text} if finish_reason is None else {}), finish_reason
        stream = self._tool_streams.setdefault(choice.index, self.plan.stream())
        text = self._read(choice, text, end=finish_reason is not None)
        if finish_reason is None:
            return stream.push(text), None
        delta: dict[str, Any] = stream.push(text)
        last, calls = stream.finish()
        for key, value in last.items():
            delta[key] = delta.get(key, "") + value
        if calls:
            delta["tool_calls"] = tools.call_deltas(calls)
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return delta, finish_reason

    def _message(self, choice: Choice) -> tuple[p.AssistantMessage, str | None]:
        text, reason = "".join(choice.text), choice.finish_reason
        if self.plan is None:
            return p.AssistantMessage(content=text), reason
        answer = self.plan.read(self._read(choice, text, end=True))
        message = p.AssistantMessage(content=answer.content, reasoning_content=answer.reasoning)
        if not answer.calls:
            return message, reason
        message.tool_calls = answer.calls
        return message, "tool_calls" if reason == "stop" else reason

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
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None = None,
    ) -> BaseModel | None:
        delta, finish_reason = self._delta(choice, text, finish_reason)
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

    def response(self, gen: Generation) -> BaseModel:
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


class CompletionFormat(Format):
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
        choice: Choice,
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
            echo_logprobs = self.echo.logprobs(self.tokenizer, prompt, self.prompts[prompt], scored)
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
        choice: Choice,
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

    def response(self, gen: Generation) -> BaseModel:
        choices = [
            self._choice(c, "".join(c.text), c.logprobs, 0, c.finish_reason, first=True)
            for c in gen.choices
        ]
        return p.Completion(**self._common(), choices=choices, usage=gen.usage())


def _event(data: BaseModel | dict[str, Any]) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


async def sse(gen: Generation, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
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


class EventStream(StreamingResponse):
    """A streamed answer (SSE, or Ollama's NDJSON) that cancels its engine requests however
    the response ends."""

    def __init__(self, gen: Generation, content: AsyncIterator[str], media_type: str) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
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


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
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


async def run_generation(
    request: Request,
    service: ModelService,
    req: p.SamplingRequest,
    prompts: list[list[int]],
    fmt: Format,
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
    jobs = [(prompt, service.params(req, prompt, j)) for prompt in prompts for j in range(req.n)]
    options = {
        "logprobs": req.top_logprob_count,
        "stop_ids": frozenset() if req.ignore_eos else None,  # None: the model's own
        "guide": guide,
        "prompt_logprobs": req.prompt_logprob_count,
    }
    gen = Generation(service, fmt.id, jobs, req.n, options, fmt.complete)
    try:
        await until_disconnect(request, gen.admitted())
        if req.stream:
            return EventStream(gen, fmt.stream(gen, req.include_usage), fmt.media_type)
        await until_disconnect(request, gen.collect())
    except BaseException:
        gen.close()
        raise
    # reading tool calls out of the text is off the event loop, however long the answer
    return JSONResponse(await asyncio.to_thread(fmt.body, gen))
