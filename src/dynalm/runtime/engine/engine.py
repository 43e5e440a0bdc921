"""The engine: continuous batching of many requests over one model.

Each ``step`` asks the scheduler which tokens to compute, runs the model ONCE over
them as a flat ragged batch (decode tokens and prefill chunks of every scheduled
sequence concatenated, with positions and page tables), then samples the next
token of every sequence whose chunk reached its end: each request has its own
sampler (and seed), incremental detokeniser and stop-string matcher.

With a drafter, decoding sequences first get draft tokens (``spec_decode.draft_planner``),
which the same step computes after their last token; ``_verify`` keeps what the target's
logits accept (several tokens per step) and rolls the rest back.

``Engine`` is driven by one thread (its ``step`` loop); ``add_request`` and
``abort`` may be called from any thread. ``AsyncEngine`` runs that loop in a
background thread and hands outputs to asyncio consumers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dynalm.core.device import Device
from dynalm.core.memory import trim_heap
from dynalm.errors import (
    DynaError,
    EngineFailure,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    UnsupportedModel,
)
from dynalm.ir.executor import Executor
from dynalm.models.loader import LoadedModel
from dynalm.models.tokenizer import StreamDecoder
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.guided import GrammarCompiler, Guide, MaskWorker, apply_masks
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.memory_plan import MemoryPlan, plan_memory
from dynalm.runtime.engine.prompt_logprobs import PromptRows, ScoredLogprob, prompt_rows, score_rows
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.sampling import (
    Sampler,
    SamplingParams,
    StopMatcher,
    device_greedy,
    sample_rows,
)
from dynalm.runtime.engine.scheduler import (
    KVCacheManager,
    Request,
    ScheduledChunk,
    Scheduler,
    flat_batch,
)
from dynalm.runtime.engine.spec_decode.draft_planner import DraftPlanner
from dynalm.runtime.engine.spec_decode.drafters import Drafter
from dynalm.runtime.engine.spec_decode.stats import SpecStats

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the ``top_logprobs`` most likely tokens,
    from the penalised, pre-temperature distribution (as OpenAI reports them)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new tokens (a stop token is included, its text is not)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    completion_tokens: int  # generated so far
    logprobs: list[TokenLogprob] | None = None  # one per new token, when requested
    # with the first output, when asked: one per prompt token from the first one scored
    prompt_logprobs: list[ScoredLogprob] | None = None
    # finish_reason "error": why the request failed (its grammar gave up), never "stop"
    # with text that does not match
    error: DynaError | None = None


_NO_ROW = np.zeros(0, np.float32)  # a token's logits row where none came back (see step)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # pages held by requests / all pages (cache-only pages count as free)
    num_pages: int
    num_free_pages: int
    num_cached_pages: int  # pages held by the prefix cache
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    spec: SpecStats  # speculative decoding's counters (zero without a drafter)


@dataclass(eq=False)
class _Stream:
    """Per-request sampling and text state (the scheduler only sees the Request)."""

    request: Request
    sampler: Sampler
    decoder: StreamDecoder
    stops: StopMatcher
    stop_ids: frozenset[int]
    logprobs: int | None
    guide: Guide | None = None  # the grammar its output follows, if constrained
    prompt_logprobs: int | None = None  # alternatives per scored prompt token
    scored: list[ScoredLogprob] | None = None  # until the first output takes them


def _token_logprob(penalized: np.ndarray, token: int, top: int) -> TokenLogprob:
    """Of a constrained row, the distribution over the tokens its grammar allows: the banned
    ones (-inf) are never among the top, so every number reported is finite."""
    shifted = penalized.astype(np.float64) - penalized.max()
    lp = shifted - np.log(np.exp(shifted).sum())
    top = min(top, len(lp))
    best = np.argpartition(-lp, top - 1)[:top] if top else np.zeros(0, np.int64)
    best = best[np.isfinite(lp[best])]
    best = best[np.argsort(-lp[best], kind="stable")]
    return TokenLogprob(token, float(lp[token]), [(int(t), float(lp[t])) for t in best])


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        device: Device,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
        memory_plan: MemoryPlan | None = None,
    ):
        """``memory_plan``: this start's plan of ``model`` on ``device`` with ``config``
        (``build_engine`` made it choosing the device), else planned here."""
        config = config or EngineConfig()
        if "logits" not in model.graph.outputs:  # an encoder: no logits, no KV, whole inputs
            kind, command, endpoint = (
                ("a reranker", "rerank", "rerank")  # a cross-encoder (runtime.embed.SCORES)
                if "scores" in model.graph.outputs
                else ("an embedding model", "embed", "embeddings")
            )
            raise UnsupportedModel(
                f"{model.name} is {kind} ({model.hparams.arch}): it cannot generate text "
                f"(dynalm {command}, or /v1/{endpoint} of dynalm serve)"
            )
        self.spec_stats = SpecStats()  # (zero without a drafter)
        self.planner = None if drafter is None else DraftPlanner(drafter, config, self.spec_stats)
        hp = model.hparams
        if config.ctx < 2:
            raise InvalidRequest(f"--ctx must be at least 2, got {config.ctx}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_queue", "page_size"):
            if getattr(config, name) < 1:
                raise InvalidRequest(f"{name} must be at least 1, got {getattr(config, name)}")
        # Refused here, before the KV pool or any weight is touched, if it cannot fit.
        self.memory_plan = (memory_plan or plan_memory(model, config, device)).check()
        n_tokens = self.memory_plan.kv_tokens
        self.model, self.device, self.config = model, device, config
        self.pool = PagePool(
            hp.n_layers,
            hp.n_kv_heads,
            hp.head_dim,
            n_pages=n_tokens // config.page_size,
            page_size=config.page_size,
            dtype=config.kv_cache_dtype,
            n_seqs=config.max_num_seqs,
            device=device,
        )
        self.cache = RadixCache(self.pool, enabled=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            KVCacheManager(self.pool, self.cache),
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_queue,
        )
        self.executor = Executor(
            model.graph,
            device,
            model.weights,
            max_tokens=config.max_num_batched_tokens,
            context=config.ctx,
        )
        model.gguf.release_pages()  # the executor holds its own (repacked) copy of the weights
        trim_heap()  # and the repack's temporaries are gone
        self.grammars = GrammarCompiler(model.tokenizer, model.stop_token_ids, hp.n_vocab)
        self._masks: MaskWorker | None = None  # started at the first constrained request
        self._streams: dict[str, _Stream] = {}
        self._aborts: set[str] = set()
        self._ready: list[RequestOutput] = []  # outputs decided outside a step
        self._lock = threading.Lock()  # guards the queues against add/abort from other threads
        # signalled after every step: what ``wait_prefilled`` waits on
        self._stepped = threading.Condition(self._lock)

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        logprobs: int | None = None,
        stop_ids: frozenset[int] | None = None,
        guide: Guide | None = None,
        prompt_logprobs: int | None = None,
        prompt_logprobs_from: int = 1,
        speculate: bool = True,
    ) -> None:
        """Queue a request; raises PromptTooLong, InvalidRequest or QueueFull. ``guide``:
        from `grammars`, its own copy. ``prompt_logprobs``: score the prompt's tokens from
        ``prompt_logprobs_from`` on (the first output carries them), with that many
        alternatives each. ``speculate``: draft for it (when the engine has a drafter)."""
        ctx = self.config.ctx
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= ctx:
            raise PromptTooLong(
                f"the prompt has {len(prompt_ids)} tokens but the context is {ctx} "
                "(raise --ctx or shorten the prompt)"
            )
        n_vocab = self.model.hparams.n_vocab
        if min(prompt_ids) < 0 or max(prompt_ids) >= n_vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {n_vocab})")
        if any(not 0 <= t < n_vocab for t in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {n_vocab})")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}"
            )
        if not 1 <= prompt_logprobs_from <= len(prompt_ids):
            raise InvalidRequest(f"prompt_logprobs_from must be in [1, {len(prompt_ids)}]")
        req = Request(request_id, list(prompt_ids), min(params.max_tokens, ctx - len(prompt_ids)))
        if prompt_logprobs is not None:
            req.scored_until = prompt_logprobs_from
        stream = _Stream(
            req,
            Sampler(params),  # validates params
            StreamDecoder(self.model.tokenizer),
            StopMatcher(params.stop),
            self.model.stop_token_ids if stop_ids is None else stop_ids,
            logprobs,
            guide,
            prompt_logprobs,
            None if prompt_logprobs is None else [],
        )
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest(f"request id '{request_id}' is already in use")
            if req.max_tokens == 0:
                self._ready.append(self._output(stream, "", [], "length"))
                return
            self.scheduler.add(req)
            self._streams[request_id] = stream
            # a grammar's state would have to follow the draft: constrained requests decode
            if self.planner is not None and guide is None and speculate:
                self.planner.add(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step (its pages go back); unknown ids are ignored."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._streams or self._ready)

    def prefilling(self) -> bool:
        """Whether a request's prompt is still to compute (from any thread)."""
        with self._lock:
            return self.scheduler.prefilling()

    def wait_prefilled(self, timeout: float) -> bool:
        """Block until no prompt is left to compute (``prefilling`` false: the steps that
        computed it have run), at most ``timeout`` seconds; whether that happened. Woken by
        each step's end, not by polling (from any thread but the one running the steps)."""
        with self._lock:
            return self._stepped.wait_for(lambda: not self.scheduler.prefilling(), timeout)

    @property
    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once over the flat batch, sample; returns the outputs
        of every request that produced tokens or finished. Its end wakes ``wait_prefilled``
        (once the step is whole: its outputs decided)."""
        try:
            return self._step()
        finally:
            with self._lock:
                self._stepped.notify_all()

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            outputs, self._ready = self._ready, []
            for rid in self._aborts:
                if rid in self._streams:
                    outputs.append(self._finish(self._streams[rid], "", [], "abort"))
            self._aborts.clear()
            if self.planner is not None:
                self.planner.plan(self.scheduler)
            t0, setup = time.perf_counter(), self.executor.setup_seconds
            sched = self.scheduler.schedule()
        if not sched.chunks:
            return outputs
        with self._lock:
            sampling = [c for c in sched.chunks if c.samples]
            streams = [self._streams[c.request.request_id] for c in sampling]
        guided = [i for i, stream in enumerate(streams) if stream.guide is not None]
        if guided:  # the masks are computed while the model runs
            self._masks = self._masks or MaskWorker(self.model.hparams.n_vocab)
            masks = self._masks.start([streams[i].guide for i in guided])  # type: ignore[misc]
        saved = {c.request.request_id: self.scheduler.kv.save_recent(c) for c in sampling}
        # greedy tokens picked on the device (only they come back) when no sequence needs
        # its logits: no penalties, bias, mask, logprobs or draft
        greedy = bool(streams) and self.executor.greedy_on_device and not guided
        greedy = greedy and all(not c.n_draft for c in sampling)
        greedy = greedy and all(s.sampler.argmax_only and s.logprobs is None for s in streams)
        scoring, logits = self._run(sched.chunks, greedy)
        with self._lock:
            self.scheduler.advance(sched)
            if scoring.spans:  # prompt log-probs from the raw logits, before any mask
                self._score_prompts(scoring, logits)
                logits = logits[len(scoring.rows) :]
            if greedy and not scoring.spans:  # (prompt log-probs need the logits)
                tokens = device_greedy(logits)
                sampled = {i: (_NO_ROW, token) for i, token in enumerate(tokens.tolist())}
            else:
                # a sequence's rows: its last token's, then one per draft token
                first = np.cumsum([0] + [1 + c.n_draft for c in sampling])
                for stream, at in zip(streams, first.tolist(), strict=False):
                    req, n_prompt = stream.request, len(stream.request.prompt_ids)
                    for j in range(len(req.draft) + 1):  # each row's history: the draft before it
                        history = req.token_ids + req.draft[:j] if j else req.token_ids
                        stream.sampler.penalize(logits[at + j], history, n_prompt)
                plain = [i for i, c in enumerate(sampling) if not c.n_draft]
                rows = logits[: len(plain)] if len(plain) == len(sampling) else logits[first[plain]]
                if guided:  # (constrained requests never draft)
                    apply_masks(rows, [plain.index(i) for i in guided], masks.result())
                tokens = sample_rows([streams[i].sampler for i in plain], rows)
                sampled = dict(zip(plain, zip(rows, tokens.tolist(), strict=True), strict=True))
            for i, stream in enumerate(streams):
                if i in sampled:
                    if self.planner is not None:
                        self.planner.sampled(stream.request, sampled[i][1])
                    outputs.append(self._emit(stream, *sampled[i]))
                else:
                    rid = stream.request.request_id
                    outputs += self._verify(stream, logits[first[i] : first[i + 1]], saved[rid])
        if self.planner is not None and all(c.n == 1 + c.n_draft for c in sched.chunks):
            # a decode step's time (the drafter's passes came before t0), less what compiling
            # a new shape took
            setup = self.executor.setup_seconds - setup
            self.planner.record_step(sched.num_tokens, time.perf_counter() - t0 - setup)
        return outputs

    def _verify(self, stream: _Stream, logits: np.ndarray, saved: object) -> list[RequestOutput]:
        """A speculative sequence after the step: emit the tokens verification keeps, one
        output each (a stop token, stop string or length ends it inside the run), and
        drop the rejected draft tokens' keys and values."""
        req = stream.request
        assert self.planner is not None  # (only a drafter's sequences verify)
        kept = self.planner.verify(stream.sampler, req, logits)
        outputs = []
        for row, token in zip(logits, kept, strict=False):
            outputs.append(self._emit(stream, row, token))
            if outputs[-1].finished:  # its pages went back whole
                return outputs
        self.scheduler.kv.accept_draft(req, len(kept) - 1, saved)
        return outputs

    def _run(
        self, chunks: list[ScheduledChunk], greedy: bool = False
    ) -> tuple[PromptRows, np.ndarray]:
        """The rows scoring prompt tokens, and the logits: those rows first, then the
        step's sampling rows (a speculative sequence's last token's and its draft's); a
        view of the executor's buffer, which the sampler penalises in place (the next step
        overwrites it). ``greedy`` and no prompt rows to score: the rows' greedy tokens
        from the device instead of the logits."""
        tokens, positions, batch = flat_batch(self.pool, chunks)
        last_rows = batch.query_start[1:] - 1
        rows = np.concatenate(
            [np.zeros(0, np.int64)]
            + [
                np.arange(end - c.n_draft, end + 1)
                for c, end in zip(chunks, last_rows, strict=True)
                if c.samples
            ]
        )
        scoring = prompt_rows(chunks, batch.query_start)
        if scoring.spans:
            rows = np.concatenate([scoring.rows, rows])
        greedy = greedy and not scoring.spans
        return scoring, self.executor.run(tokens, positions, rows, batch, greedy=greedy)

    def _score_prompts(self, scoring: PromptRows, logits: np.ndarray) -> None:
        at = 0
        for req, first, n in scoring.spans:
            stream = self._streams[req.request_id]
            targets = req.prompt_ids[first : first + n]
            stream.scored += score_rows(logits[at : at + n], targets, stream.prompt_logprobs)
            req.scored_until = first + n
            at += n

    def _emit(self, stream: _Stream, penalized: np.ndarray, token: int) -> RequestOutput:
        """Append a sampled token to its request: its text, logprob, and whether it ends."""
        req = stream.request
        req.append(token)
        lp = None if stream.logprobs is None else _token_logprob(penalized, token, stream.logprobs)
        text, matched, reason, guide = "", False, None, stream.guide
        if token in stream.stop_ids:
            reason = "stop"
        else:
            text, matched = stream.stops.push(stream.decoder.push(token))
            if guide is not None:
                guide.consume(token)
            if matched or (guide is not None and guide.done):
                reason = "stop"
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.ctx:
                reason = "length"
        # (a stop string the client chose may still cut the grammar's text short)
        if guide is not None and (failed := guide.failure(reason == "stop" and not matched)):
            return self._finish(stream, "", [token], "error", lp, failed)
        if reason is None:
            return self._output(stream, text, [token], None, lp)
        if not matched:  # text held back for a possible stop string or UTF-8 character
            text += stream.stops.push(stream.decoder.flush())[0] + stream.stops.flush()
        return self._finish(stream, text, [token], reason, lp)

    def _finish(
        self,
        stream: _Stream,
        text: str,
        tokens: list[int],
        reason: str,
        lp: TokenLogprob | None = None,
        error: DynaError | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(stream.request, reason)
        if self.planner is not None:
            self.planner.release(stream.request.request_id)
        del self._streams[stream.request.request_id]
        return self._output(stream, text, tokens, reason, lp, error)

    @staticmethod
    def _output(
        stream: _Stream,
        text: str,
        tokens: list[int],
        reason: str | None,
        lp: TokenLogprob | None = None,
        error: DynaError | None = None,
    ) -> RequestOutput:
        req = stream.request
        scored, stream.scored = stream.scored, None
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=tokens,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
            completion_tokens=req.num_output_tokens,
            logprobs=None if stream.logprobs is None else [lp] if lp else [],
            prompt_logprobs=scored,
            error=error,
        )

    # -- state ----------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.pool
        held = pool.n_pages - pool.n_free - self.cache.evictable_pages
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_usage=max(0, held) / pool.n_pages,
            num_pages=pool.n_pages,
            num_free_pages=pool.n_free,
            num_cached_pages=self.cache.n_pages,
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            spec=self.spec_stats,
        )

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix no request uses; returns the pages freed."""
        with self._lock:
            return self.cache.evict(self.pool.n_pages)


def _hand_over(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    """Runs ``Engine.step`` in a background thread while requests exist and streams each
    request's outputs to its asyncio consumer."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._consumers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dynalm-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                if self._stop:
                    return
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs: list[RequestOutput | BaseException] = list(self.engine.step())
            except Exception as e:  # a failed step: fail every request, keep serving
                log.exception("engine step failed")
                for rid in self.engine.request_ids:
                    self.engine.abort(rid)
                # logged once here; consumers get an error that shows no internals (a
                # DynaError, such as non-finite logits, says what it is already)
                outputs = [
                    e
                    if isinstance(e, DynaError)
                    else EngineFailure("the engine failed on this request (see the server log)")
                ]
            # One hand-over per event loop and step, not one per output: each wakes the loop
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
            for out in outputs:
                targets = (
                    list(self._consumers) if isinstance(out, BaseException) else [out.request_id]
                )
                for loop, queue in filter(None, map(self._consumers.get, targets)):
                    by_loop.setdefault(loop, []).append((queue, out))
            for loop, items in by_loop.items():
                with contextlib.suppress(RuntimeError):  # that event loop is closed
                    loop.call_soon_threadsafe(_hand_over, items)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        queued: Callable[[], None] | None = None,
        **kw: object,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; cancelling the consumer
        (client disconnect) aborts it. Raises what ``Engine.add_request`` raises; ``queued``
        is called once the engine has taken the request (before any output)."""
        if not self._accepting:
            raise QueueFull("the server is shutting down")
        if request_id in self._consumers:
            raise InvalidRequest(f"request id '{request_id}' is already in use")
        import asyncio  # here: `dynalm run` never needs it, and it costs start-up time

        queue: asyncio.Queue = asyncio.Queue()
        # Listen before adding: the engine thread may produce the first output at once.
        self._consumers[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(request_id, prompt_ids, params, **kw)  # type: ignore[arg-type]
        except BaseException:
            del self._consumers[request_id]
            raise
        self._wake.set()
        if queued is not None:
            queued()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            self._consumers.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)
                self._wake.set()

    def abort_all(self) -> None:
        """Stop admitting and abort every request: each ends with finish_reason "abort"."""
        self._accepting = False
        for rid in self.engine.request_ids:
            self.engine.abort(rid)
        self._wake.set()

    def shutdown(self, drain: bool = True) -> None:
        """Stop admitting; finish (``drain``) or abort in-flight requests; stop the thread.
        Blocks until done: from a coroutine, call it through ``asyncio.to_thread``."""
        self._accepting = False
        if not drain:
            self.abort_all()
        self._stop = True
        self._wake.set()
        self._thread.join()
