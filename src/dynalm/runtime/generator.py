"""``dynalm run``: one request at a time through the same Engine the server uses.

The engine's prefix cache keeps the previous chat turn's pages, so a new turn only
prefills what changed. ``forward`` scores tokens directly over the paged cache,
bypassing the scheduler (tests compare its logits with the reference model).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.guided import Guide
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.engine.scheduler import Request, ScheduledChunk, flat_batch


@dataclass
class GenerationEvent:
    text: str  # new text to show (may be empty)
    token: int | None  # the sampled token; None for a stop token or a bare finish
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0

    def summary(self) -> str:
        prefilled = self.prompt_tokens - self.cached_tokens
        pp = prefilled / self.prefill_seconds if self.prefill_seconds else 0.0
        tg = (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds else 0.0
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
            f"prefill {pp:.1f} tokens/s, first token after {self.prefill_seconds:.2f} s | "
            f"generated: {self.generated_tokens} tokens, "
            f"decode {tg:.1f} tokens/s"
        )


def generator_config(
    ctx: int = 4096, kv_dtype: str = "f32", num_draft_tokens: int = 4
) -> EngineConfig:
    """The engine configuration of a Generator (one sequence at a time)."""
    return EngineConfig(
        ctx=ctx, max_num_seqs=1, kv_cache_dtype=kv_dtype, num_draft_tokens=num_draft_tokens
    )


class Generator:
    """Requests one at a time through ``engine`` (configured by ``generator_config``)."""

    def __init__(self, engine: Engine):
        self.engine, self.model = engine, engine.model
        self.stats = GenerationStats()
        self._ids = itertools.count()
        # What ``forward`` has run, as one sequence in a pool of its own (it never starves
        # the engine's).
        self._scored = Request("forward", [], 0)
        self._scoring_pool: PagePool | None = None

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int] | None = None,
        guide: Guide | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream one answer (following ``guide``'s grammar, if given: a fresh copy each
        time); stopping the iteration early aborts the request."""
        rid = f"run-{next(self._ids)}"
        stop_ids = self.model.stop_token_ids if stop_ids is None else stop_ids
        guide = None if guide is None else guide.copy()
        self.engine.add_request(rid, prompt, params, stop_ids=stop_ids, guide=guide)
        self.stats = stats = GenerationStats(prompt_tokens=len(prompt))
        t0 = first = time.perf_counter()
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    now = time.perf_counter()
                    if stats.generated_tokens == 0 and out.completion_tokens:
                        first = now
                        stats.prefill_seconds = now - t0
                    stats.cached_tokens = out.cached_tokens
                    stats.generated_tokens = out.completion_tokens
                    stats.decode_seconds = now - first
                    token = out.token_ids[0] if out.token_ids else None
                    if out.finish_reason == "stop" and token in stop_ids:
                        token = None
                    finished = out.finished
                    if out.error is not None:  # its grammar gave up: no answer to show
                        raise out.error
                    yield GenerationEvent(out.text, token, out.finish_reason)
        finally:
            if not finished:  # Ctrl-C or the consumer stopped: give the pages back
                self.engine.abort(rid)
                self.engine.step()

    def forward(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` after the tokens of earlier ``forward`` calls; returns the last
        token's logits ``[vocab]``, or with ``all_logits`` every token's ``[len(ids), vocab]``."""
        if self._scoring_pool is None:
            hp, config = self.model.hparams, self.engine.config
            self._scoring_pool = PagePool(
                hp.n_layers,
                hp.n_kv_heads,
                hp.head_dim,
                n_pages=-(-config.ctx // config.page_size),
                page_size=config.page_size,
                dtype=config.kv_cache_dtype,
                device=self.engine.device,
            )
            if self._scoring_pool.recent:
                self._scored.recent = self._scoring_pool.open_recent()
        pool, seq = self._scoring_pool, self._scored
        start = seq.num_tokens
        seq.token_ids += ids
        seq.pages += pool.allocate(max(0, -(-seq.num_tokens // pool.page_size) - len(seq.pages)))
        tokens, positions, batch = flat_batch(pool, [ScheduledChunk(seq, start, len(ids))])
        rows = np.arange(len(ids)) if all_logits else np.array([len(ids) - 1])
        logits = self.engine.executor.run(tokens, positions, rows, batch)
        return logits.copy() if all_logits else logits[0].copy()
