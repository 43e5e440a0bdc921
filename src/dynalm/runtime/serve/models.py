"""The models a server answers for: one `ModelService` per loaded model, found by name
through the `ModelManager`.

A `ModelService` is everything request handling needs of one model: its engine (and the
`AsyncEngine` thread in front of it), tokenizer, chat template, context size and metrics;
it turns request fields into token ids, grammars and sampling parameters. The server's
endpoints never hold a model directly: they `acquire` a service by the name the request
gives and `release` it when the response has ended (a stream included), so the manager
knows which models are in use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from dynalm.errors import InvalidRequest, PromptTooLong
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.engine import AsyncEngine, Engine
from dynalm.runtime.engine.guided import Guide
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve import protocol as p
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.asgi import APIError
from dynalm.runtime.serve.metrics import ServerMetrics


class ModelService:
    """One loaded model and its engine, as the endpoints use it."""

    def __init__(self, engine: Engine, model: LoadedModel, names: Sequence[str]) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = model.tokenizer
        self.names = list(dict.fromkeys(names))  # the first is the name answers carry
        self.ctx = engine.config.ctx
        # Each character is at least one byte, so text of more characters than the context's
        # tokens can stand for cannot fit: it is refused before the tokenizer spends time on it.
        longest = max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size))
        self.max_text_chars = self.ctx * longest
        self.metrics = ServerMetrics(engine, self.names[0])
        self.async_engine: AsyncEngine | None = None  # started in the event loop (`start`)
        self.active = 0  # requests holding it (`ModelManager.acquire` .. `release`)
        self.path = model.path
        self.loaded_at = time.time()
        self.size_bytes = engine.memory_plan.weights + engine.memory_plan.kv
        self.device = engine.device.name
        # seconds it stays loaded after its last release (the latest request's keep_alive);
        # None or < 0: for good
        self.keep_alive: float | None = None
        self.expires_at: float | None = None  # time.time() it unloads; None: busy or for good

    @property
    def name(self) -> str:
        return self.names[0]

    def start(self) -> None:
        if self.async_engine is None:
            self.async_engine = AsyncEngine(self.engine)

    def shutdown(self, drain: bool = False) -> None:
        """Stop its engine thread; requests still running end with finish_reason "abort"."""
        if self.async_engine is not None:
            self.async_engine.shutdown(drain=drain)

    # --- checks

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        if bad := [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]:
            raise InvalidRequest(
                f"{what}: token id {bad[0]} is outside the vocabulary "
                f"(0..{self.tokenizer.vocab_size - 1})"
            )

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
                }
                for m in messages
            ],
            plan,
            template.source,
        )
        rendered = template.render(shown, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(rendered, add_special=False)

    def guide(self, req: p.SamplingRequest, plan: tools.ToolPlan | None = None) -> Guide | None:
        """The grammar the answer must follow (a tool call, or the requested format)."""
        if plan is not None and (grammar := plan.grammar()) is not None:
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


class ModelManager:
    """The models this server answers for, by name. Every model here is loaded at start; a
    request holds its model from `acquire` to `release`, and a model is unloaded (`unload`,
    or ``keep_alive`` seconds after its last release) only when no request holds it."""

    def __init__(self, services: Sequence[ModelService]) -> None:
        if not services:
            raise ValueError("a server needs at least one model")
        self.services = list(services)
        self._by_name = {name: s for s in self.services for name in s.names}
        self._timers: dict[int, asyncio.TimerHandle] = {}  # by id(service): its expiry

    @property
    def default(self) -> ModelService | None:
        """The model a request that names none gets (None once every model is unloaded)."""
        return self.services[0] if self.services else None

    def available(self) -> list[str]:
        """Every name a request may use."""
        return [s.name for s in self.services]

    def loaded(self) -> list[ModelService]:
        return list(self.services)

    def lookup(self, name: str | None) -> ModelService:
        service = self.default if name is None else self._by_name.get(name)
        if service is None:
            raise APIError(
                404,
                f"the model '{p.clip(name or '', 100)}' does not exist "
                f"(this server has {', '.join(self.available()) or 'no model loaded'})",
                param="model",
                code="model_not_found",
            )
        return service

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> ModelService:
        """The model a request names (None: the default), held until `release`.
        ``keep_alive``: seconds it stays loaded after its last release (0: unloaded right
        after this request; < 0: for good; None: as before, for good unless a request said)."""
        service = self.lookup(name)
        service.active += 1
        service.expires_at = None
        if (timer := self._timers.pop(id(service), None)) is not None:
            timer.cancel()
        if keep_alive is not None:
            service.keep_alive = keep_alive
        return service

    def release(self, service: ModelService) -> None:
        service.active -= 1
        if service.active or service.keep_alive is None or service.keep_alive < 0:
            return
        service.expires_at = time.time() + service.keep_alive
        loop = asyncio.get_running_loop()
        self._timers[id(service)] = loop.call_later(service.keep_alive, self._expire, service)

    def _expire(self, service: ModelService) -> None:
        """Unload ``service`` if no request has taken it since its expiry was set. Dropped
        from the names at once (synchronously: no request can acquire it in between), its
        engine thread stopped off the event loop."""
        if (timer := self._timers.pop(id(service), None)) is not None:
            timer.cancel()
        if service.active or service not in self.services:
            return
        self.services.remove(service)
        self._by_name = {n: s for n, s in self._by_name.items() if s is not service}
        asyncio.get_running_loop().run_in_executor(None, service.shutdown)

    async def unload(self, name: str) -> bool:
        """Unload the model ``name`` now, or after its last release if requests hold it;
        False if no loaded model has that name."""
        if (service := self._by_name.get(name)) is None:
            return False
        service.keep_alive = 0
        if not service.active:
            self._expire(service)
        return True

    def start(self) -> None:
        for service in self.services:
            service.start()

    def shutdown(self, drain: bool = False) -> None:
        for service in self.services:
            service.shutdown(drain=drain)

    def abort_all(self) -> None:
        for service in self.services:
            if service.async_engine is not None:
                service.async_engine.abort_all()
