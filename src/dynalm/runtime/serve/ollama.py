"""Ollama's API (``/api/*``) on the OpenAI server's port, for Ollama's clients unchanged.

Nothing here generates text: a ``/api/chat`` or ``/api/generate`` request is translated into
the OpenAI request it means (`p.ChatCompletionRequest`, `p.CompletionRequest`), run by
`generation.run_generation` like any other, and its outputs written as Ollama writes them
(`_OllamaChat`, `_OllamaGenerate`: NDJSON lines, or one object with ``stream: false``).
``options`` are checked against the same ranges as OpenAI's fields (`protocol`'s types);
Ollama's options this server has no use for (``num_gpu``, ``mirostat`` ...) are ignored, as
Ollama ignores what it does not know. What would silently answer another question is
refused by name: ``images`` (no vision), a custom ``template``, ``suffix``, ``context``,
``think`` for a model whose template writes no reasoning apart (only harmony's does: its
analysis channel is ``thinking``; a level ``"low"`` ... ``"high"`` is gpt-oss's
``reasoning_effort``). Errors are ``{"error": "message"}`` (`asgi.APIError.body`) with the status
OpenAI's endpoints would give.

The model store backs ``/api/tags``, ``/api/show``, ``/api/pull`` and ``/api/delete``;
``/api/ps`` and the unload an empty request with ``keep_alive: 0`` asks for (``ollama
stop``) go to the `ModelManager`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.progress import Progress, TaskID

import dynalm
from dynalm.core.quant import tensor_type_name
from dynalm.errors import DynaError, InvalidRequest, ModelNotFound
from dynalm.models.chat_template import harmony
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hf_dir import HFDirectory
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import APIError, OllamaError, error_responses
from dynalm.runtime.serve.embeddings import EmbeddingRequest, EmbeddingService
from dynalm.runtime.serve.generation import (
    ChatFormat,
    Choice,
    Generation,
    run_generation,
)
from dynalm.runtime.serve.models import ModelManager, ModelService, ServedModel
from dynalm.runtime.serve.structured import Constraint
from dynalm.runtime.serve.tools import MAX_TOOLS, Tool
from dynalm.store.catalog import ModelStore, StoredModel, is_local_path


class OpenAIServer(Protocol):
    """What this module uses of `server.OpenAIServer` (which installs it: named here, not
    imported, so the two modules do not import each other)."""

    models: ModelManager
    store: ModelStore

    async def serving(
        self,
        name: str | None,
        work: Callable[[Any], Awaitable[Response]],
        keep_alive: float | None = None,
        kind: type[ServedModel] = ModelService,
    ) -> Response: ...


NDJSON = "application/x-ndjson"
# Ollama's sampling defaults where a request's options leave a parameter out (its
# repeat_penalty 1.1 is not taken: it counts only the last 64 tokens, ours every token)
DEFAULTS: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# ---------------------------------------------------------------- requests

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # "1" is no number, as in Ollama's Go


class Options(BaseModel):
    """The ``options`` this server uses; others are ignored (``extra="ignore"``), as Ollama
    ignores options it does not know."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    temperature: p.Temperature | None = None
    top_k: p.TopK | None = None
    top_p: p.TopP | None = None
    min_p: p.MinP | None = None
    repeat_penalty: p.RepetitionPenalty | None = None
    presence_penalty: p.Penalty | None = None
    frequency_penalty: p.Penalty | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=p.MAX_SEED)] | None = None  # < 0: random
    num_predict: int | None = None  # -1: no limit, -2: fill the context
    num_ctx: Annotated[int, Field(ge=1)] | None = None
    stop: p.StopStrings | None = None

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v not in (-1, -2):
            raise ValueError("must be -1 (no limit), -2 (fill the context) or at least 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class _ModelUse(BaseModel):
    """A request that runs a model: its name and how long it stays loaded after."""

    model_config = _STRICT

    model: Annotated[str, Field(min_length=1)]
    keep_alive: float | int | str | None = None

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: Any) -> float | None:
        return p.keep_alive_seconds(v)


class _OllamaRequest(_ModelUse):
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None

    def thinking(self, template_source: str) -> bool:
        """Whether the answer's reasoning is to be sent (``thinking``): a 400 when asked of a
        template that writes none apart."""
        if self.think in (None, False):
            return False
        if not harmony(template_source):
            raise APIError(400, f"think: {NO_THINKING}", param="think")
        return True

    @field_validator("format", mode="before")
    @classmethod
    def _format_kind(cls, v: Any) -> Any:
        if v is not None and v not in ("", "json") and not isinstance(v, dict):
            raise ValueError('must be "json" or a JSON schema (an object)')
        return v

    def openai(self) -> dict[str, Any]:
        """The OpenAI request fields for the sampling parameters and the format."""
        o = self.options
        given = {
            "temperature": o.temperature,
            "top_k": o.top_k,
            "top_p": o.top_p,
            "min_p": o.min_p,
            "repetition_penalty": o.repeat_penalty,
            "presence_penalty": o.presence_penalty,
            "frequency_penalty": o.frequency_penalty,
            "seed": None if o.seed is None or o.seed < 0 else o.seed,
            "stop": o.stop,
        }
        out: dict[str, Any] = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
        out["stream"] = self.stream
        if isinstance(self.think, str):
            out["reasoning_effort"] = self.think
        if self.format == "json":
            out["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            spec = {"name": "format", "schema": self.format}
            out["response_format"] = {"type": "json_schema", "json_schema": spec}
        return out


def _refused(what: str) -> Callable[[Any], Any]:
    """A validator refusing any value but an empty one, saying ``what``."""

    def check(v: Any) -> Any:
        if v:
            raise ValueError(what)
        return v

    return check


NO_THINKING = "thinking is not supported by this server (leave think out or false)"
NO_IMAGES = "images are not supported: this server's models read text only (no vision)"


class ToolFunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    function: ToolFunctionCall


class Message(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # an earlier answer's: to templates that show it

    _images = field_validator("images")(_refused(NO_IMAGES))

    def openai(self) -> dict[str, Any]:
        """The message as OpenAI's (validated with the request it goes into)."""
        calls = [
            {
                "id": tools.new_call_id(),
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": json.dumps(c.function.arguments),
                },
            }
            for c in self.tool_calls or ()
        ]
        return {
            "role": self.role,
            "content": self.content or "",
            "tool_calls": calls or None,
            "name": self.tool_name if self.role == "tool" else None,
            "reasoning_content": self.thinking if self.role == "assistant" else None,
        }


class ChatRequest(_OllamaRequest):
    messages: list[Message] = []
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    _images = field_validator("images")(_refused(NO_IMAGES))
    _template = field_validator("template")(
        _refused(
            "a custom prompt template is not supported: the model's own chat template is "
            "used (leave template out, or send raw: true with the prompt already templated)"
        )
    )
    _suffix = field_validator("suffix")(_refused("fill-in-the-middle (suffix) is not supported"))
    _context = field_validator("context")(
        _refused(
            "continuing from an earlier answer's context is not supported: send the "
            "conversation to /api/chat"
        )
    )


class EmbedRequest(_ModelUse):
    input: str | list[str]
    truncate: bool = True  # Ollama's default: an input longer than the model's is cut to it
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)  # none applies to an encoder


class LegacyEmbeddingsRequest(EmbedRequest):
    input: str | list[str] = ""  # this endpoint's text is ``prompt``
    prompt: str


class ModelRequest(BaseModel):
    """/api/show, /api/delete: a model by name (Ollama's older clients say ``name``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[str, Field(min_length=1)] | None = None
    name: Annotated[str, Field(min_length=1)] | None = None

    @property
    def wanted(self) -> str:
        if (named := self.model or self.name) is None:
            raise APIError(400, "model is required", param="model")
        return named


class PullRequest(ModelRequest):
    stream: bool = True
    insecure: bool = False  # Ollama's registry option: the Hub is always HTTPS


class _FormatIsOllamas:
    """An Ollama request translated: its only constraint is ``format``, named so in errors."""

    def constraint(self) -> Constraint | None:
        found = super().constraint()  # type: ignore[misc]
        return None if found is None else dataclasses.replace(found, field="format")


class _Chat(_FormatIsOllamas, p.ChatCompletionRequest):
    pass


class _Completion(_FormatIsOllamas, p.CompletionRequest):
    pass


# ---------------------------------------------------------------- answers


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj) + "\n"


def _done_reason(finish_reason: str | None) -> str:
    return "stop" if finish_reason in (None, "tool_calls") else finish_reason


def _ollama_calls(calls: list[dict[str, Any]] | list[p.ToolCall]) -> list[dict[str, Any]]:
    """Tool calls as Ollama writes them: arguments an object, no id."""
    out = []
    for call in calls:
        fn = call["function"] if isinstance(call, dict) else call.function.model_dump()
        out.append({"function": {"name": fn["name"], "arguments": json.loads(fn["arguments"])}})
    return out


class _Ollama:
    """What Ollama's chat and generate answers share: the stamp, the NDJSON stream, the
    closing counters and durations (nanoseconds)."""

    media_type = NDJSON
    model: str

    def _setup(self, started: float, load_s: float, think: bool) -> None:
        self.started, self.load_s = started, load_s  # time.monotonic(), seconds
        self.think = think

    def _thought(self, reasoning: str | None) -> dict[str, str]:
        """The ``thinking`` field, where asked for and there is some."""
        return {"thinking": reasoning} if self.think and reasoning else {}

    def _stamp(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": now_rfc3339()}

    def _done(self, gen: Generation, choice: Choice) -> dict[str, Any]:
        now = time.monotonic()
        first = choice.first_at or now
        return {
            "done": True,
            "done_reason": _done_reason(choice.finish_reason),
            "total_duration": _ns(now - self.started),
            "load_duration": _ns(self.load_s),
            "prompt_eval_count": choice.prompt_tokens,
            "prompt_eval_duration": _ns(first - gen.created),
            "eval_count": choice.completion_tokens,
            "eval_duration": _ns((choice.last_at or now) - first),
        }

    def part(self, choice: Choice, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        """A line's answer fields for ``text`` (None: nothing to send yet)."""
        raise NotImplementedError

    def whole(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    async def stream(self, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
        try:
            async for choice, out in gen.outputs():
                if out.text and (part := self.part(choice, out.text, None)) is not None:
                    yield _line({**self._stamp(), **part, "done": False})
                if out.finished:  # (tool calls are read here: off the event loop)
                    reason = out.finish_reason or "stop"
                    last = await asyncio.to_thread(self.part, choice, "", reason)
                    yield _line({**self._stamp(), **(last or {}), **self._done(gen, choice)})
        except Exception as e:  # after the headers: only the stream can say it
            yield _line({"error": APIError.of(e).message})

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        return {**self._stamp(), **self.whole(choice), **self._done(gen, choice)}


class _OllamaChat(_Ollama, ChatFormat):
    def __init__(
        self, name: str, service: ModelService, plan: tools.ToolPlan | None, think: bool,
        started: float, load_s: float,
    ) -> None:  # fmt: skip
        ChatFormat.__init__(self, name, service.tokenizer, False, plan)
        self._setup(started, load_s, think)

    def _answer(
        self, content: str | None, reasoning: str | None, calls: list[Any] | None
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": content or "", **self._thought(reasoning)}
        if calls:
            message["tool_calls"] = _ollama_calls(calls)
        return {"message": message}

    def part(self, choice: Choice, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        delta, _ = self._delta(choice, text, finish_reason)
        if not delta and finish_reason is None:
            return None
        return self._answer(
            delta.get("content"), delta.get("reasoning_content"), delta.get("tool_calls")
        )

    def whole(self, choice: Choice) -> dict[str, Any]:
        answer, _ = self._message(choice)
        return self._answer(answer.content, answer.reasoning_content, answer.tool_calls)


class _OllamaGenerate(_OllamaChat):
    """A prompt's answer as ``response`` (and ``thinking``): read as a chat answer, so a
    harmony answer's channels come apart (``plan``, without tools) and others go as they are."""

    id_prefix = "gen"

    def _answer(
        self, content: str | None, reasoning: str | None, calls: list[Any] | None
    ) -> dict[str, Any]:
        return {"response": content or "", **self._thought(reasoning)}


# ---------------------------------------------------------------- the store's models


@functools.lru_cache(maxsize=64)
def _file_info(path: Path, stamp: tuple[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(details, metadata)`` of a model file (``stamp``: its mtime and size, so a changed
    file is read again); metadata without its long arrays (the vocabulary), as Ollama's
    ``model_info`` leaves them out."""
    model = HFDirectory(path) if path.is_dir() else GGUFFile(path)
    try:
        meta = model.metadata
        arch = str(meta.get("general.architecture", ""))
        types = Counter(
            tensor_type_name(t.ggml_type) for t in model.tensors.values() if len(t.shape) > 1
        )
        n_params = sum(math.prod(t.shape) for t in model.tensors.values())
        details = {
            "parent_model": "",
            "format": "safetensors" if path.is_dir() else "gguf",
            "family": arch,
            "families": [arch] if arch else None,
            "parameter_size": _params(n_params),
            "quantization_level": types.most_common(1)[0][0].upper() if types else "",
        }
        shown = {k: _jsonable(v) for k, v in meta.items() if not _long(v)}
        return details, shown
    finally:
        model.close()


def _long(v: Any) -> bool:
    return hasattr(v, "__len__") and not isinstance(v, str) and len(v) > 64


def _jsonable(v: Any) -> Any:
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    if hasattr(v, "tolist"):  # numpy
        return v.tolist()
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return str(v)


def _params(n: int) -> str:
    """Ollama's parameter_size: ``"134.52M"``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def file_info(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """`_file_info`, or empty details for a file that cannot be read as a model."""
    try:
        st = path.stat()
        return _file_info(path, (st.st_mtime_ns, st.st_size))
    except (DynaError, OSError, ValueError):
        return {"format": "directory" if path.is_dir() else "gguf", "family": ""}, {}


# ---------------------------------------------------------------- pull progress


class _Reporter(Progress):
    """A progress bar that draws nothing and reports each download's progress to ``emit``
    (from the pulling thread): at each start, end, and every 1% between."""

    def __init__(self, emit: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(disable=True)
        self._emit = emit
        self._shown: dict[TaskID, float] = {}

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task = super().add_task(description, *args, **kwargs)
        self._report(task, force=True)
        return task

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def _report(self, task_id: TaskID, force: bool = False) -> None:
        task = self._tasks[task_id]
        total = int(task.total or 0)
        done = int(task.completed)
        last = self._shown.get(task_id, -1.0)
        if force or done >= total or total and (done - last) >= total / 100:
            self._shown[task_id] = done
            self._emit({"status": f"pulling {task.description}", "total": total, "completed": done})


# ---------------------------------------------------------------- the endpoints


class OllamaAPI:
    def __init__(self, api: OpenAIServer) -> None:
        self.api = api

    @property
    def models(self) -> ModelManager:
        return self.api.models

    def _not_found(self, name: str) -> APIError:
        names = ", ".join(self.models.available()) or "none"
        return APIError(
            404, f"model '{p.clip(name, 100)}' not found (this server has: {names})",
            param="model", code="model_not_found",
        )  # fmt: skip

    async def _serving(
        self,
        req: _ModelUse,
        work: Callable[[Any, float], Any],
        kind: type[ServedModel] = ModelService,
    ) -> Response:
        """`OpenAIServer.serving` with Ollama's 404; ``work`` gets the load time too."""
        started = time.monotonic()

        async def timed(service: ServedModel) -> Response:
            return await work(service, time.monotonic() - started)

        with self._ollamas_404(req.model):
            return await self.api.serving(req.model, timed, req.keep_alive, kind)

    @contextmanager
    def _ollamas_404(self, name: str) -> Iterator[None]:
        """The manager's unknown-model 404 in Ollama's words."""
        try:
            yield
        except APIError as e:
            if e.status == 404 and e.code == "model_not_found":
                raise self._not_found(name) from None
            raise

    async def _load_or_unload(self, req: _OllamaRequest, field: dict[str, Any]) -> Response:
        """An empty request: load the model (or with keep_alive 0, unload it), as Ollama does."""
        if req.keep_alive == 0:
            with self._ollamas_404(req.model):
                await self.models.unload(req.model)  # a model not loaded: nothing to do
            reason = "unload"
        else:
            await self._serving(req, lambda s, _: _nothing())
            reason = "load"
        answer = {"model": req.model, "created_at": now_rfc3339(), **field}
        answer |= {"done": True, "done_reason": reason}
        if req.stream:
            return Response(_line(answer), media_type=NDJSON)
        return JSONResponse(answer)

    def _limit(self, service: ModelService, o: Options, prompt: int) -> int | None:
        """max_tokens for ``num_predict`` and ``num_ctx`` (None: what the context leaves)."""
        if o.num_ctx is not None and o.num_ctx > service.ctx:
            raise APIError(
                400,
                f"options.num_ctx is {o.num_ctx}, more than the {service.ctx} tokens this "
                f"server loaded the model with (restart it with a larger --ctx)",
                param="options.num_ctx",
            )
        room = (o.num_ctx or service.ctx) - prompt
        if o.num_ctx is not None and room < 1:
            raise APIError(
                400,
                f"the prompt's {prompt} tokens leave no room in options.num_ctx={o.num_ctx}",
                param="options.num_ctx",
            )
        if o.num_predict is not None and o.num_predict > 0:
            return min(o.num_predict, room) if room > 0 else o.num_predict
        return room if o.num_ctx is not None else None

    @staticmethod
    def _translate(cls: type[p.SamplingRequest], fields: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(fields)
        except ValueError as e:  # a pydantic ValidationError: a 400 naming the place
            errors = e.errors() if hasattr(e, "errors") else []
            if not errors:
                raise InvalidRequest(str(e)) from None
            where = ".".join(str(x) for x in errors[0]["loc"])
            message = errors[0]["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{where}: {message}", param=where) from None

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        """Ollama's chat: the messages through the model's chat template."""
        if not body.messages:
            return await self._load_or_unload(
                body, {"message": {"role": "assistant", "content": ""}}
            )
        fields = {
            **body.openai(),
            "model": body.model,
            "messages": [m.openai() for m in body.messages],
            "tools": [t.model_dump() for t in body.tools] if body.tools else None,
        }
        req = self._translate(_Chat, fields)

        async def work(service: ModelService, load_s: float) -> Response:
            source = service.model.chat_template.source
            think = body.thinking(source)
            plan = await asyncio.to_thread(tools.plan, req, source)
            ids = await asyncio.to_thread(
                service.chat_ids, req.messages, True, plan, req.reasoning_effort
            )
            req.max_tokens = self._limit(service, body.options, len(ids))
            guide = await asyncio.to_thread(service.guide, req, plan)
            started = time.monotonic() - load_s
            fmt = _OllamaChat(body.model, service, plan, think, started, load_s)
            return await run_generation(request, service, req, [ids], fmt, guide)

        return await self._serving(body, work)

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        """Ollama's generate: a prompt (with ``system``) through the chat template, or as it
        is with ``raw``."""
        if not body.prompt:
            return await self._load_or_unload(body, {"response": ""})
        req = self._translate(
            _Completion, {**body.openai(), "model": body.model, "prompt": body.prompt}
        )
        messages = [p.ChatMessage(role="user", content=body.prompt)]
        if body.system:  # (both strings already: nothing here can fail validation)
            messages.insert(0, p.ChatMessage(role="system", content=body.system))

        async def work(service: ModelService, load_s: float) -> Response:
            source = service.model.chat_template.source
            think = body.thinking(source)
            plan = tools.plan(tools.ToolFields(), source)  # what reads the answer
            if body.raw:
                [ids] = await asyncio.to_thread(service.prompt_ids, [body.prompt])
            else:
                effort = body.think if isinstance(body.think, str) else None
                ids = await asyncio.to_thread(service.chat_ids, messages, True, plan, effort)
            req.max_tokens = self._limit(service, body.options, len(ids))
            guide = await asyncio.to_thread(service.guide, req)
            started = time.monotonic() - load_s
            fmt = _OllamaGenerate(body.model, service, plan, think, started, load_s)
            return await run_generation(request, service, req, [ids], fmt, guide)

        return await self._serving(body, work)

    # --- the models

    def _stored(self) -> list[StoredModel]:
        return self.api.store.list()

    def _model(self, name: str) -> tuple[Path, ModelService | None]:
        """The file of the model ``name`` and its service if loaded, else the store's file.
        Names only: a client never makes the server read a path of its choosing."""
        for service in self.models.loaded():
            if name in service.names:
                return service.path, service
        if is_local_path(name):
            raise self._not_found(name)
        try:
            return self.api.store.resolve(name, pull=False), None
        except DynaError as e:
            if isinstance(e, InvalidRequest) or e.http_status == 404:
                raise self._not_found(name) from None
            raise

    async def tags(self) -> dict[str, Any]:
        def entries() -> list[dict[str, Any]]:
            out = []
            for m in self._stored():
                details, _ = file_info(m.path)
                out.append(
                    {
                        "name": m.name,
                        "model": m.name,
                        "modified_at": m.pulled_at,
                        "size": m.size,
                        "digest": m.sha256 or "",
                        "details": details,
                    }
                )
            return out

        return {"models": await asyncio.to_thread(entries)}

    async def show(self, body: ModelRequest) -> dict[str, Any]:
        name = body.wanted
        path, service = self._model(name)
        details, meta = await asyncio.to_thread(file_info, path)
        # loaded: the template it renders with (a file without one gets a default)
        template = str(meta.get("tokenizer.chat_template", ""))
        if service is not None:
            template = service.model.chat_template.source
        parameters = "\n".join(f"{k:<15} {v}" for k, v in DEFAULTS.items())
        modelfile = f'FROM {path}\nTEMPLATE """{template}"""\n' + "".join(
            f"PARAMETER {k} {v}\n" for k, v in DEFAULTS.items()
        )
        return {
            "modelfile": modelfile,
            "parameters": parameters,
            "template": template,
            "details": details,
            "model_info": meta,
            "capabilities": ["completion", "tools", *(["thinking"] if harmony(template) else [])],
            "modified_at": _rfc3339(path.stat().st_mtime),
        }

    async def ps(self) -> dict[str, Any]:
        out = []
        for s in self.models.loaded():
            details, _ = await asyncio.to_thread(file_info, s.path)
            out.append(
                {
                    "name": s.name,
                    "model": s.name,
                    "size": s.size_bytes,
                    "size_vram": s.size_bytes if s.device == "cuda" else 0,
                    "device": s.device,
                    "digest": "",
                    "details": details,
                    # null: kept until unloaded, or busy now (the clock starts at release)
                    "expires_at": None if s.expires_at is None else _rfc3339(s.expires_at),
                    "context_length": s.ctx,
                }
            )
        return {"models": out}

    async def delete(self, body: ModelRequest) -> Response:
        name = body.wanted
        try:
            await asyncio.to_thread(self.api.store.remove, name)
        except ModelNotFound:  # (its message names the store's directory: not the client's)
            raise APIError(404, f"model '{p.clip(name, 100)}' not found", param="model") from None
        return Response(status_code=200)

    async def pull(self, body: PullRequest) -> Response:
        name = body.wanted
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        def emit(event: dict[str, Any] | BaseException | None) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def run() -> None:
            try:
                emit({"status": "pulling manifest"})
                path = self.api.store.pull(name, progress=False, bar=_Reporter(emit))
                stored = next((m for m in self.api.store.list() if m.path == path), None)
                if stored is not None and stored.sha256:
                    emit({"status": "verifying sha256 digest", "digest": f"sha256:{stored.sha256}"})
                emit({"status": "success"})
            except BaseException as e:
                emit(e)
            emit(None)

        task = loop.run_in_executor(None, run)

        async def lines() -> AsyncIterator[dict[str, Any] | BaseException]:
            while (event := await events.get()) is not None:
                yield event

        if not body.stream:
            last: dict[str, Any] = {}
            async for event in lines():
                if isinstance(event, BaseException):
                    raise event
                last = event
            await task
            return JSONResponse(last)

        async def ndjson() -> AsyncIterator[str]:
            async for event in lines():
                if isinstance(event, BaseException):
                    yield _line({"error": APIError.of(event).message})  # type: ignore[arg-type]
                    return
                yield _line(event)

        return StreamingResponse(ndjson(), media_type=NDJSON)

    async def embed(self, req: EmbedRequest) -> Response:
        """Ollama's embeddings: one vector per input, of an embedding model (``truncate``:
        Ollama's default is to cut an input to the model's length)."""

        async def work(service: EmbeddingService, load_s: float) -> Response:
            started = time.monotonic() - load_s
            body = EmbeddingRequest(
                model=req.model, input=req.input, truncate=req.truncate, dimensions=req.dimensions
            )
            out = await service.respond(body)
            return JSONResponse({
                "model": req.model,
                "embeddings": [d["embedding"] for d in out["data"]],
                "total_duration": _ns(time.monotonic() - started),
                "load_duration": _ns(load_s),
                "prompt_eval_count": out["usage"]["prompt_tokens"],
            })  # fmt: skip

        return await self._serving(req, work, EmbeddingService)

    async def embeddings(self, req: LegacyEmbeddingsRequest) -> Response:
        """Ollama's older endpoint: one ``prompt``, one ``embedding``."""

        async def work(service: EmbeddingService, _: float) -> Response:
            body = EmbeddingRequest(model=req.model, input=req.prompt, truncate=True)
            out = await service.respond(body)
            return JSONResponse({"embedding": out["data"][0]["embedding"]})

        return await self._serving(req, work, EmbeddingService)

    async def version(self) -> dict[str, str]:
        return {"version": dynalm.__version__}


async def _nothing() -> Response:
    return Response(status_code=200)


def install_ollama(app: FastAPI, api: OpenAIServer, guarded: list[Any]) -> None:
    """Ollama's endpoints on ``app`` (``guarded``: the API key check, as on /v1)."""
    ollama = OllamaAPI(api)

    def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
        return error_responses(*statuses, schema=OllamaError)

    stream = {200: {"content": {NDJSON: {"schema": {"type": "string"}}}}}
    generation = {**stream, **errors(400, 401, 404, 408, 413, 500, 503)}
    lookup = errors(400, 401, 404, 408, 413)
    post = functools.partial(app.post, dependencies=guarded, response_model=None)
    post("/api/chat", responses=generation)(ollama.chat)
    post("/api/generate", responses=generation)(ollama.generate)
    post("/api/show", responses=lookup)(ollama.show)
    post("/api/pull", responses={**stream, **lookup})(ollama.pull)
    app.delete("/api/delete", dependencies=guarded, responses=lookup)(ollama.delete)
    post("/api/embed", responses=lookup)(ollama.embed)
    post("/api/embeddings", responses=lookup)(ollama.embeddings)
    app.get("/api/tags", dependencies=guarded, responses=errors(401))(ollama.tags)
    app.get("/api/ps", dependencies=guarded, responses=errors(401))(ollama.ps)
    app.get("/api/version", dependencies=guarded, responses=errors(401))(ollama.version)
