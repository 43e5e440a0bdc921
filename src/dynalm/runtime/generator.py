"""Single-sequence generation over the paged KV cache (what ``dynalm run`` drives).

The prompt is prefilled in chunks of at most ``chunk`` tokens, then one token is
decoded per step. KV pages of the previous turn are kept, so a chat turn only
prefills what is new since the last one (token-exact prefix reuse).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dynalm.core.cpu_ops import AttentionBatch
from dynalm.core.device import CpuDevice
from dynalm.errors import InvalidRequest, PromptTooLong
from dynalm.ir.executor import Executor
from dynalm.models.loader import LoadedModel
from dynalm.models.tokenizer import StreamDecoder
from dynalm.runtime.kv_cache import PagePool, PageTable
from dynalm.runtime.sampling import Sampler, SamplingParams, StopMatcher


@dataclass
class GenerationEvent:
    text: str  # new text to show (may be empty)
    token: int | None  # the sampled token, None for the final flush
    finish_reason: str | None = None  # "stop" | "length" on the last event


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
        tg = self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
            f"prefill {pp:.1f} tokens/s | generated: {self.generated_tokens} tokens, "
            f"decode {tg:.1f} tokens/s"
        )


class Generator:
    def __init__(
        self,
        model: LoadedModel,
        device: CpuDevice,
        ctx: int = 4096,
        chunk: int = 256,
        page_size: int = 16,
        kv_dtype: str = "f32",
    ):
        hp = model.hparams
        if ctx < 2:
            raise InvalidRequest(f"--ctx must be at least 2, got {ctx}")
        self.model = model
        self.ctx = ctx
        self.chunk = chunk
        self.executor = Executor(model.graph, device, model.weights, max_tokens=chunk)
        self.pool = PagePool(
            hp.n_layers,
            hp.n_kv_heads,
            hp.head_dim,
            n_pages=-(-ctx // page_size),
            page_size=page_size,
            dtype=kv_dtype,
        )
        self.table = PageTable(self.pool)
        self.cached: list[int] = []  # tokens whose keys/values are in self.table
        self.stats = GenerationStats()

    def forward(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` after the cached tokens; returns the last token's logits
        ``[vocab]``, or with ``all_logits`` every token's ``[len(ids), vocab]``."""
        start = len(self.cached)
        self.table.reserve(start + len(ids))
        tokens = np.asarray(ids, np.int64)
        positions = np.arange(start, start + len(ids), dtype=np.int64)
        batch = AttentionBatch(
            kv=self.pool,
            query_start=np.array([0, len(ids)]),
            seq_lens=np.array([start + len(ids)]),
            page_tables=[self.table.as_array()],
            slots=self.table.slots(start, start + len(ids)),
        )
        rows = np.arange(len(ids)) if all_logits else np.array([len(ids) - 1])
        logits = self.executor.run(tokens, positions, rows, batch)
        self.cached.extend(ids)
        return logits.copy() if all_logits else logits[0].copy()

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """Make the cache hold ``prompt``, reusing the longest cached prefix."""
        reuse = 0
        limit = min(len(prompt) - 1, len(self.cached))  # always recompute the last token
        while reuse < limit and self.cached[reuse] == prompt[reuse]:
            reuse += 1
        del self.cached[reuse:]  # positions past the prefix get overwritten
        self.stats.cached_tokens = reuse
        logits = None
        for i in range(reuse, len(prompt), self.chunk):
            logits = self.forward(prompt[i : i + self.chunk])
        assert logits is not None
        return logits

    def generate(
        self, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int] | None = None
    ) -> Iterator[GenerationEvent]:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.ctx:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens but the context is "
                f"{self.ctx} (raise --ctx or shorten the prompt)"
            )
        sampler = Sampler(params)
        stop_ids = self.model.stop_token_ids if stop_ids is None else stop_ids
        decoder = StreamDecoder(self.model.tokenizer)
        stops = StopMatcher(params.stop)
        self.stats = GenerationStats(prompt_tokens=len(prompt))

        t0 = time.perf_counter()
        logits = self.prefill(prompt)
        self.stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        history = list(prompt)
        finish, matched = "length", False
        for _ in range(params.max_tokens):
            token = sampler.sample(logits, history)
            history.append(token)
            self.stats.generated_tokens += 1
            if token in stop_ids:
                finish = "stop"
                break
            text, matched = stops.push(decoder.push(token))
            yield GenerationEvent(text, token)
            if matched:
                finish = "stop"
                break
            if len(self.cached) + 1 >= self.ctx:
                break  # the context is full: finish with "length"
            logits = self.forward([token])
        self.stats.decode_seconds = time.perf_counter() - t0
        tail = "" if matched else stops.push(decoder.flush())[0] + stops.flush()
        yield GenerationEvent(tail, None, finish)
