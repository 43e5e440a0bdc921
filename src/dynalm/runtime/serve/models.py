"""The models a server answers for: one `ModelService` per loaded model, found by name
through the `ModelManager`, which loads them on demand and unloads them when idle.

A `ModelService` is everything request handling needs of one model: its engine (and the
`AsyncEngine` thread in front of it), tokenizer, chat template, context size and metrics;
it turns request fields into token ids, grammars and sampling parameters. The server's
endpoints never hold a model directly: they `acquire` a service by the name the request
gives and `release` it when the response has ended (a stream included), so the manager
knows which models are in use.

The manager (Ollama's scheduler, in asyncio):

* a request for a model not loaded loads it off the event loop; concurrent requests for it
  wait for that one load, and a failed load answers each of them with the same error;
* after its last request a model stays loaded for its keep-alive (the server's
  ``--keep-alive``, or the latest request's ``keep_alive``: 0 unloads at once, negative
  keeps it forever); a background task unloads expired ones;
* before a load, the memory plan of the loaded models plus the new one is held to
  ``--max-memory`` (and their count to ``--max-loaded``): least-recently-used idle models are
  unloaded to make room; a model with requests running is never unloaded under them; if the
  new one still cannot fit, the request gets 503 saying what is needed, free and busy.

Loads happen one at a time (as Ollama's), so the memory each one finds free is settled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from dynalm.errors import DynaError, InvalidRequest, ModelNotFound, PromptTooLong
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.engine import AsyncEngine, Engine
from dynalm.runtime.engine.guided import Guide
from dynalm.runtime.engine.memory_plan import NotEnoughMemory, mib
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import APIError
from dynalm.runtime.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: 5 minutes
REAP_INTERVAL_S = 0.25  # how often expired idle models are looked for
CATALOG_TTL_S = 2.0  # how long the store's listing is reused by a server of the whole store


class ServedModel:
    """What the manager keeps of any loaded model, whatever it serves: its names, holds,
    size, keep-alive and expiry (`ModelService`: generation; `embeddings.EmbeddingService`:
    vectors). ``metrics`` has a prometheus ``registry`` with ``model_name`` labels."""

    def __init__(
        self, model: LoadedModel, names: Sequence[str], *, device: str, size_bytes: int, ctx: int
    ) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.names = list(dict.fromkeys(names))  # the first is the name answers carry
        self.ctx = ctx
        self.active = 0  # requests holding it (`ModelManager.acquire` .. `release`)
        self.path: Path = model.path
        self.device = device
        self.size_bytes = size_bytes  # what the memory budget counts
        self.loaded_at = time.time()
        self.last_used = time.monotonic()  # least-recently-used order of eviction
        self.keep_alive = -1.0  # seconds after the last release (the latest request's)
        self.expires_at: float | None = None  # time.time() of its unload; None: busy / forever
        self.async_engine: AsyncEngine | None = None  # a generation model's engine thread

    serves = "a model"  # what it is, as an endpoint that needs another kind says

    @property
    def name(self) -> str:
        return self.names[0]

    def start(self) -> None:
        """Start what it runs in the event loop (nothing, unless it has an engine thread)."""

    def shutdown(self, drain: bool = False) -> None:
        """Stop what `start` started."""

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        if bad := [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]:
            raise InvalidRequest(
                f"{what}: token id {bad[0]} is outside the vocabulary "
                f"(0..{self.tokenizer.vocab_size - 1})"
            )


class ModelService(ServedModel):
    """One loaded generation model and its engine, as the endpoints use it."""

    serves = "a generation model"

    def __init__(self, engine: Engine, model: LoadedModel, names: Sequence[str]) -> None:
        # the size is the engine's plan: weights + KV pool + step buffers
        super().__init__(
            model,
            names,
            device=engine.device.name,
            size_bytes=engine.memory_plan.device_bytes,
            ctx=engine.config.ctx,
        )
        self.engine = engine
        # Each character is at least one byte, so text of more characters than the context's
        # tokens can stand for cannot fit: it is refused before the tokenizer spends time on it.
        longest = max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size))
        self.max_text_chars = self.ctx * longest
        self.metrics = ServerMetrics(engine, self.names[0])

    def start(self) -> None:
        if self.async_engine is None:
            self.async_engine = AsyncEngine(self.engine)

    def shutdown(self, drain: bool = False) -> None:
        """Stop its engine thread; requests still running end with finish_reason "abort"."""
        if self.async_engine is not None:
            self.async_engine.shutdown(drain=drain)

    # --- tokenising (blocking: called through asyncio.to_thread)

    def encode(self, text: str, add_special: bool) -> list[int]:
        if len(text) > self.max_text_chars:
            raise PromptTooLong(
                f"the prompt has {len(text)} characters, more than a context of {self.ctx} "
                f"tokens can hold (at most {self.max_text_chars})"
            )
        return self.tokenizer.encode(text, add_special=add_special)

    def chat_ids(
        self,
        messages: Sequence[p.ChatMessage],
        add_generation_prompt: bool,
        plan: tools.ToolPlan | None = None,
        reasoning_effort: str | None = None,
    ) -> list[int]:
        template = self.model.chat_template
        shown, extra = tools.template_messages(
            [
                # "developer" is OpenAI's new name for "system"; templates know only the old one
                {
                    "role": "system" if m.role == "developer" else m.role,
                    "content": m.text(),
                    "tool_calls": m.tool_calls,
                    "tool_call_id": m.tool_call_id,
                    "name": m.name if m.role == "tool" else None,
                    "reasoning": m.reasoning_content,
                }
                for m in messages
            ],
            plan,
            template.source,
        )
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
        rendered = template.render(shown, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(rendered, add_special=False)

    def guide(self, req: p.SamplingRequest, plan: tools.ToolPlan | None = None) -> Guide | None:
        """The grammar the answer must follow (a tool call, or the requested format)."""
        if plan is not None and (grammar := plan.grammar(self.tokenizer)) is not None:
            return self.engine.grammars.compile(grammar, "the tools' parameters")
        if (constraint := req.constraint()) is None:
            return None
        return self.engine.grammars.compile(constraint.grammar(), constraint.field)

    def prompt_ids(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        out = []
        for item in prompts:
            if isinstance(item, str):
                out.append(self.encode(item, add_special=True))
            else:
                self.check_ids(item, "prompt")
                out.append(list(item))
        return out

    # --- sampling

    def params(self, req: p.SamplingRequest, prompt: list[int], copy: int) -> SamplingParams:
        bias = req.token_bias
        self.check_ids(list(bias), "logit_bias")
        room = self.ctx - len(prompt)  # a prompt that leaves none is the engine's 400
        if req.max_tokens is not None and 0 < room < req.max_tokens:
            raise APIError(
                400,
                f"max_tokens is {req.max_tokens}, but the context of {self.ctx} tokens leaves "
                f"{room} after the prompt's {len(prompt)}; lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            # OpenAI's default: as much as the context leaves
            max_tokens=req.max_tokens or max(1, room),
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repeat_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            # n copies with one seed must still differ from each other (the largest seed's
            # copies wrap around to 0, 1, ...)
            seed=None if req.seed is None else (req.seed + copy) % (p.MAX_SEED + 1),
            stop=list(req.stop),
            logit_bias=bias,
        ).validate()


class PreparedModel(Protocol):
    """A model about to be loaded: its memory plan is known, nothing large is read yet."""

    size_bytes: int  # what `ServedModel.size_bytes` will be

    def load(self) -> ServedModel: ...


class ModelManager:
    """The models this server answers for, by name, loaded on demand (see the module's
    docstring); a request holds its model from `acquire` to `release`.

    ``prepare(name)`` resolves a name to a `PreparedModel` (blocking: run in a thread; its
    errors are the load's), ``names`` the models served (None: every name ``catalog()``
    gives, the store's, asked at each request), ``keep_alive`` the server's default in
    seconds, ``max_memory`` the bytes the loaded models' plans may take together, and
    ``max_loaded`` how many may be loaded at once (None: no limit).
    """

    def __init__(
        self,
        prepare: Callable[[str], PreparedModel],
        names: Sequence[str] | None = None,
        *,
        catalog: Callable[[], list[str]] = list,
        keep_alive: float = DEFAULT_KEEP_ALIVE_S,
        max_memory: int | None = None,
        max_loaded: int | None = None,
    ) -> None:
        self._prepare = prepare
        self._names = None if names is None else list(dict.fromkeys(names))
        self._catalog = catalog
        self._catalog_seen: tuple[float, list[str]] | None = None  # (when, names)
        self.keep_alive = keep_alive
        self.max_memory = max_memory
        self.max_loaded = max_loaded
        self._loaded: dict[str, ServedModel] = {}  # by the name it was loaded for
        self._loading: dict[str, asyncio.Future[ServedModel]] = {}
        self._closing: set[ServedModel] = set()  # unloading: their memory is not free yet
        self._load_lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # unloads `release` started
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loads = 0  # loads started (tests count them)

    @classmethod
    def of(cls, services: Sequence[ServedModel]) -> ModelManager:
        """A manager of models loaded already, kept for the server's life (the first is the
        default): what a test server or an embedding program builds."""
        if not services:
            raise ValueError("a server needs at least one model")

        def unknown(name: str) -> PreparedModel:
            # only a model unloaded on request (`dynalm stop`) is looked for again
            raise APIError(
                503,
                f"the model '{name}' was unloaded and this server cannot load it again "
                "(it was given to it loaded): restart the server",
                code="model_unloaded",
            )

        manager = cls(unknown, [s.name for s in services], keep_alive=-1)
        for service in services:
            manager._loaded[service.name] = service
        return manager

    # --- names

    def available(self) -> list[str]:
        """Every name a request may use: the models served, or the store's, and the loaded
        models' other names (a file's stem)."""
        return list(dict.fromkeys([*self._served(), *(n for s in self.loaded() for n in s.names)]))

    def _served(self) -> list[str]:
        """The names given at start, or the store's: its listing reads a directory on the
        event loop, so it is kept for CATALOG_TTL_S (a model pulled meanwhile shows then)."""
        if self._names is not None:
            return self._names
        now = time.monotonic()
        if self._catalog_seen is None or now - self._catalog_seen[0] > CATALOG_TTL_S:
            self._catalog_seen = (now, self._catalog())
        return self._catalog_seen[1]

    @property
    def default(self) -> ServedModel | None:
        """The model a request that names none gets (the first one served), if loaded;
        None when the server was started with no model."""
        return None if not self._names else self._loaded.get(self._names[0])

    def _key(self, name: str | None) -> str:
        """The name ``name`` is loaded under; 404 naming the models if there is none."""
        if name is None:
            if self._names:
                return self._names[0]
            raise APIError(
                400,
                "this server serves several models: name one in 'model' "
                f"({', '.join(self.available()) or 'the store has none'})",
                param="model",
                code="model_not_found",
            )
        for key, service in self._loaded.items():
            if name in service.names:
                return key
        if name in self._served():
            return name
        known = self.available()
        raise APIError(
            404,
            f"the model '{p.clip(name, 100)}' does not exist (this server has "
            f"{', '.join(known) if known else 'none: pull one with `dynalm pull`'})",
            param="model",
            code="model_not_found",
        )

    def lookup(self, name: str | None) -> ServedModel | None:
        """The loaded model ``name`` names (None: not loaded now); 404 if it names none."""
        return self._loaded.get(self._key(name))

    def loaded(self) -> list[ServedModel]:
        return list(self._loaded.values())

    # --- what an embedding model's steps yield to (``runtime.embed.Generation``; asked from
    # its worker thread)

    def generation_loaded(self) -> bool:
        """Whether a generation model is loaded."""
        return any(isinstance(s, ModelService) for s in self.loaded())

    def generating(self) -> bool:
        """Whether a loaded generation model has requests in its engine."""
        return any(isinstance(s, ModelService) and s.engine.has_unfinished() for s in self.loaded())

    def prefilling(self) -> bool:
        """Whether a loaded generation model has a prompt still to compute."""
        return any(isinstance(s, ModelService) and s.engine.prefilling() for s in self.loaded())

    def wait_prefilled(self, timeout: float) -> bool:
        """Block until no loaded generation model has a prompt to compute, at most
        ``timeout`` seconds (each engine's steps wake the wait); whether that happened."""
        until = time.monotonic() + timeout
        while True:
            busy = next(
                (
                    s.engine
                    for s in self.loaded()
                    if isinstance(s, ModelService) and s.engine.prefilling()
                ),
                None,
            )
            if busy is None:
                return True
            left = until - time.monotonic()
            if left <= 0 or not busy.wait_prefilled(left):
                return False

    # --- holding a model

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> ServedModel:
        """The model a request names (None: the default), loaded if need be and held until
        `release`; ``keep_alive``: seconds it stays loaded after that (None: the server's)."""
        key = self._key(name)
        while True:
            if (service := self._loaded.get(key)) is not None:
                service.active += 1
                service.last_used = time.monotonic()
                service.keep_alive = self.keep_alive if keep_alive is None else keep_alive
                service.expires_at = None
                return service
            if (loading := self._loading.get(key)) is None:
                loading = self._loading[key] = asyncio.ensure_future(self._load(key))
                loading.add_done_callback(functools.partial(self._loaded_or_failed, key))
            # every waiter gets the one load's service or its error; a waiter that goes away
            # (client disconnect) does not cancel the load for the others
            await asyncio.shield(loading)
            # loaded (and, rarely, evicted again before this waiter ran: load it again)

    def _loaded_or_failed(self, key: str, loading: asyncio.Future[ServedModel]) -> None:
        self._loading.pop(key, None)  # a failure is not kept: the next request tries again
        if not loading.cancelled():
            loading.exception()  # seen, even if every waiter went away (no asyncio warning)

    def release(self, service: ServedModel) -> None:
        service.active -= 1
        service.last_used = time.monotonic()
        if service.active > 0:
            return
        if service.keep_alive == 0:
            task = asyncio.get_running_loop().create_task(self.unload_service(service))
            self._tasks.add(task)  # asyncio keeps only a weak reference to a task
            task.add_done_callback(self._tasks.discard)
        elif service.keep_alive > 0:
            service.expires_at = time.time() + service.keep_alive

    # --- loading and unloading

    async def _load(self, key: str) -> ServedModel:
        async with self._load_lock:  # one load at a time: the room each finds is settled
            if (service := self._loaded.get(key)) is not None:
                return service
            self.loads += 1
            try:
                prepared = await asyncio.to_thread(self._prepare, key)
                await self._make_room(key, prepared.size_bytes)
                service = await asyncio.to_thread(prepared.load)
            except APIError:
                raise
            except Exception as e:
                raise _load_error(key, e) from e
            service.start()
            service.expires_at = self._expiry(self.keep_alive)
            self._loaded[key] = service
            log.info("loaded %s (%s on %s)", key, mib(service.size_bytes), service.device)
            return service

    @staticmethod
    def _expiry(keep_alive: float) -> float | None:
        return None if keep_alive < 0 else time.time() + keep_alive

    def _used(self) -> int:
        return sum(s.size_bytes for s in [*self._loaded.values(), *self._closing])

    async def _make_room(self, key: str, need: int) -> None:
        """Unload least-recently-used idle models until ``need`` more bytes (and one more
        model) fit; 503 saying why if they cannot."""
        budget = self.max_memory
        if budget is not None and need > budget:
            raise APIError(
                503,
                f"cannot load '{key}': it needs {mib(need)}, more than the whole memory "
                f"budget of {mib(budget)} (--max-memory)",
                code="model_too_large",
            )
        while True:
            count_ok = self.max_loaded is None or len(self._loaded) < self.max_loaded
            free = None if budget is None else budget - self._used()
            if count_ok and (free is None or need <= free):
                return
            idle = sorted((s for s in self._loaded.values() if s.active == 0),
                          key=lambda s: s.last_used)  # fmt: skip
            if not idle:
                raise APIError(503, self._no_room(key, need, free), code="no_room_for_model")
            log.info("unloading %s to make room for %s", idle[0].name, key)
            await self.unload_service(idle[0])

    def _no_room(self, key: str, need: int, free: int | None) -> str:
        busy = ", ".join(
            f"{s.name} ({mib(s.size_bytes)}, {s.active} request(s) running)"
            for s in self._loaded.values()
        )
        if free is not None and need > free:
            why = (
                f"it needs {mib(need)} and {mib(max(0, free))} of the {mib(self.max_memory)} "
                "budget (--max-memory) is free"
            )
        else:
            why = f"{len(self._loaded)} models are loaded, the most --max-loaded allows"
        return f"cannot load '{key}' now: {why}; the loaded models are all in use: {busy}"

    async def unload(self, name: str) -> bool:
        """Unload the model ``name`` names now, or, if requests hold it, right after its
        last one ends; False if it is not loaded."""
        service = self.lookup(name)
        if service is None:
            return False
        if service.active > 0:
            service.keep_alive = 0  # `release` unloads it
            return True
        await self.unload_service(service)
        return True

    async def unload_service(self, service: ServedModel) -> None:
        """Shut ``service``'s engine down and drop this manager's references to it; its
        memory is freed once the last response using it is gone (there is none: it is idle)."""
        key = next((k for k, s in self._loaded.items() if s is service), None)
        if key is None or service.active > 0:
            return  # unloaded already, or taken again since (it stays)
        del self._loaded[key]
        self._closing.add(service)
        try:
            await asyncio.to_thread(service.shutdown, drain=False)
        finally:
            self._closing.discard(service)
        log.info("unloaded %s", key)

    # --- the server's life

    def preload(self, names: Sequence[str]) -> list[str]:
        """Load ``names`` before serving (blocking; a load error is raised), each while it
        fits beside those before it without unloading any (Ollama's preload by an empty
        request, less the eviction); the names that did not fit are returned."""
        left = []
        for name in names:
            prepared = self._prepare(name)
            count_ok = self.max_loaded is None or len(self._loaded) < self.max_loaded
            fits = self.max_memory is None or self._used() + prepared.size_bytes <= self.max_memory
            if self.max_memory is not None and prepared.size_bytes > self.max_memory:
                raise NotEnoughMemory(  # could never load: said at start
                    f"{name} needs {mib(prepared.size_bytes)}, more than the memory budget of "
                    f"{mib(self.max_memory)} (--max-memory)"
                )
            if not (count_ok and fits) or left:
                left.append(name)
                continue
            self.loads += 1
            service = prepared.load()
            service.expires_at = self._expiry(self.keep_alive)
            service.keep_alive = self.keep_alive
            self._loaded[name] = service
        return left

    def start(self) -> None:
        """In the event loop: start the loaded models' engines and the task that unloads
        expired idle models."""
        for service in self._loaded.values():
            service.start()
        self._loop = asyncio.get_running_loop()
        self._reaper = self._loop.create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            await self._unload_expired()  # its own frame: no model stays referenced here

    async def _unload_expired(self) -> None:
        now = time.time()
        for service in list(self._loaded.values()):
            expires = service.expires_at
            if service.active == 0 and expires is not None and expires <= now:
                await self.unload_service(service)

    def shutdown(self, drain: bool = False) -> None:
        """Stop every engine (blocking: from the event loop, through asyncio.to_thread)."""
        if self._reaper is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._reaper.cancel)
        for service in list(self._loaded.values()):
            service.shutdown(drain=drain)

    def abort_all(self) -> None:
        for service in self._loaded.values():
            if service.async_engine is not None:
                service.async_engine.abort_all()


def _load_error(name: str, e: Exception) -> APIError:
    """What every request waiting for a failed load gets: the load's own message, with the
    status of what went wrong (a model that is not there 404, no memory 503, a file that
    cannot be loaded 500: the server's fault, not the request's)."""
    if isinstance(e, NotEnoughMemory | MemoryError):
        status, code = 503, "not_enough_memory"
    elif isinstance(e, ModelNotFound):
        status, code = 404, "model_not_found"
    else:
        status, code = 500, "model_load_failed"
        if not isinstance(e, DynaError | OSError):
            log.error("loading %s failed", name, exc_info=e)
    message = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        message = f"{e.filename + ': ' if e.filename else ''}{e.strerror}"
    return APIError(status, f"could not load the model '{name}': {message}", code=code)
