"""Continuous-batching scheduler (vLLM v1 style) and the KV manager it drives.

There is no prefill phase and no decode phase: each request has
``num_computed_tokens`` chasing ``num_tokens`` (prompt + generated), and one token
budget per step is shared by the running requests (a decode token each, or the
next chunk of a long prompt) and then by waiting requests admitted in arrival
order. Prefix-cache hits simply start a request with tokens already computed.
When pages run out, the most recently admitted running request is preempted: its
pages go back (full ones stay in the prefix cache) and it is recomputed later,
keeping the tokens it generated.

Speculative decoding: a decoding request may carry ``draft`` tokens, proposed to follow
its tokens; they are scheduled after its last token (1 + k tokens in the flat batch, cut
to the step's budget) and are not the request's tokens: ``advance`` counts only the
request's own as computed, and ``accept_draft`` then adds the accepted ones and gives back
the pages that held only rejected ones (those never reach the prefix cache).

Everything here works on token ids and page ids only, so it is unit-tested
without a model: the engine runs the model over what ``schedule`` returns and
then calls ``advance`` and ``finish``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dynalm.core.kv_storage import AttentionBatch
from dynalm.errors import QueueFull
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.radix_cache import Node, RadixCache


@dataclass(eq=False)
class Request:
    """One sequence's token-level state."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int  # most tokens to generate
    token_ids: list[int] = field(init=False)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose keys/values are in ``pages``
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    cache_node: Node | None = None  # the locked end of this request's cached path
    num_cached_pages: int = 0  # leading pages already offered to the prefix cache
    recent: int | None = None  # its recent buffer while running (q8_0 pools)
    recent_from: int = 0  # the first position it computed itself since admission
    # prompt log-probs (`prompt_logprobs`): the next prompt token to score, None if none wanted
    scored_until: int | None = None
    draft: list[int] = field(default_factory=list)  # proposed next tokens, this step only
    _admitted: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    def append(self, token: int) -> None:
        self.token_ids.append(token)


class KVCacheManager:
    """Pages of requests: prefix matches, growth with copy-on-write, caching, release."""

    def __init__(self, pool: PagePool, cache: RadixCache):
        self.pool = pool
        self.cache = cache
        self.page_size = pool.page_size

    def match(self, req: Request) -> int:
        """Start ``req`` from its longest cached prefix (leaving at least its last token
        to compute, whose logits are needed, and every position whose logits score a prompt
        token not scored yet); returns the tokens reused."""
        end = req.num_tokens - 1
        if req.scored_until is not None and req.scored_until < len(req.prompt_ids):
            end = min(end, req.scored_until - 1)
        hit = self.cache.match(req.token_ids[:end])
        self.pool.retain(hit.pages)
        self.cache.lock(hit.node)
        req.pages, req.cache_node = hit.pages, hit.node
        req.num_computed_tokens = req.recent_from = hit.n_tokens
        if self.pool.recent:
            req.recent = self.pool.open_recent()
        return hit.n_tokens

    def _needs_copy(self, req: Request) -> bool:
        """Whether the page the next token goes into is shared (copy it before writing)."""
        idx = req.num_computed_tokens // self.page_size
        return idx < len(req.pages) and self.pool.refcount[req.pages[idx]] > 1

    def allocate(self, req: Request, n_tokens: int) -> bool:
        """Make room for ``n_tokens`` tokens in total, evicting unused cached prefixes if
        needed; False (nothing changed) when the pool cannot hold them."""
        grow = -(-n_tokens // self.page_size) - len(req.pages)
        need = max(0, grow) + self._needs_copy(req)
        if need > self.pool.n_free:
            self.cache.evict(need - self.pool.n_free)
            need = max(0, grow) + self._needs_copy(req)  # eviction may have unshared it
            if need > self.pool.n_free:
                return False
        if self._needs_copy(req):
            idx = req.num_computed_tokens // self.page_size
            (fresh,) = self.pool.allocate(1)
            self.pool.storage.copy_page(req.pages[idx], fresh)
            self.pool.release([req.pages[idx]])
            req.pages[idx] = fresh
        if grow > 0:
            req.pages += self.pool.allocate(grow)
        return True

    def cache_full_pages(self, req: Request) -> None:
        """Put the request's computed whole pages into the prefix cache, moving its lock
        to the end of that path."""
        n_full = req.num_computed_tokens // self.page_size
        if n_full == req.num_cached_pages or not self.cache.enabled:
            return
        req.num_cached_pages = n_full
        node = self.cache.insert(req.token_ids[: n_full * self.page_size], req.pages[:n_full])
        if node is not req.cache_node:
            self.cache.lock(node)
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
            req.cache_node = node

    def save_recent(self, chunk: ScheduledChunk) -> list[np.ndarray] | None:
        """Before a step computes ``chunk``'s draft tokens: what their positions' rows of
        the request's recent buffer hold (q8_0 pools), for ``accept_draft`` to put back."""
        if not (chunk.n_draft and self.pool.recent):
            return None
        req = chunk.request
        return self.pool.storage.save_recent(self._recent_rows(req, req.num_tokens, chunk.n_draft))

    def _recent_rows(self, req: Request, start: int, n: int) -> np.ndarray:
        assert req.recent is not None
        return req.recent * self.pool.recent + np.arange(start, start + n) % self.pool.recent

    def accept_draft(
        self, req: Request, n_accepted: int, saved: list[np.ndarray] | None = None
    ) -> None:
        """``req``'s draft ran (``advance`` counted its own tokens) and its first
        ``n_accepted`` tokens were appended to it: their keys/values stay, the rejected
        ones' are dropped: the pages only they used, and their rows of a recent buffer
        (``saved``), which held the keys and values of positions 32 earlier."""
        n_draft, req.draft = len(req.draft), []
        if saved is not None:
            first = req.num_computed_tokens + n_accepted  # the first rejected position
            rows = self._recent_rows(req, first, n_draft - n_accepted)
            self.pool.storage.restore_recent(rows, [a[:, n_accepted:] for a in saved])
        req.num_computed_tokens += n_accepted
        self.rollback(req, req.num_computed_tokens)
        self.cache_full_pages(req)

    def rollback(self, req: Request, n_tokens: int) -> None:
        """Keep the keys/values of ``req``'s first ``n_tokens`` tokens only, giving back the
        pages after them (pages past the computed ones are this request's alone)."""
        req.num_computed_tokens = min(req.num_computed_tokens, n_tokens)
        keep = -(-n_tokens // self.page_size)
        self.pool.release(req.pages[keep:])
        del req.pages[keep:]

    def free(self, req: Request) -> None:
        self.pool.release(req.pages)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        if req.recent is not None:
            self.pool.close_recent(req.recent)
        req.pages, req.cache_node, req.recent = [], None, None
        req.num_computed_tokens = req.num_cached_pages = 0


@dataclass
class ScheduledChunk:
    """Tokens ``start:start + n`` of ``request`` are computed this step; the last
    ``n_draft`` of them are its draft tokens (speculative decoding)."""

    request: Request
    start: int
    n: int
    n_draft: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next one."""
        return self.start + self.n - self.n_draft == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        req, end = self.request, self.start + self.n
        if self.n_draft:
            return req.token_ids[self.start :] + req.draft[: self.n_draft]
        return req.token_ids[self.start : end]


def flat_batch(
    pool: PagePool, chunks: Sequence[ScheduledChunk]
) -> tuple[np.ndarray, np.ndarray, AttentionBatch]:
    """Tokens, positions and attention layout of one step over ``chunks``."""
    seqs = [(c.request, c.start, c.start + c.n) for c in chunks]
    tokens = np.concatenate([np.asarray(c.token_ids, np.int64) for c in chunks])
    positions = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in seqs])
    recent = pool.recent > 0
    batch = AttentionBatch(
        kv=pool.storage,
        query_start=np.cumsum([0] + [b - a for _, a, b in seqs]),
        seq_lens=np.array([b for _, _, b in seqs], np.int64),
        page_tables=[np.asarray(r.pages, np.int64) for r, _, _ in seqs],
        slots=np.concatenate([pool.slots(r.pages, a, b) for r, a, b in seqs]),
        recent=np.array([r.recent for r, _, _ in seqs], np.int64) if recent else None,
        recent_from=np.array([r.recent_from for r, _, _ in seqs], np.int64) if recent else None,
    )
    return tokens, positions, batch


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.n for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 16,
        max_queue: int = 256,
    ):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0
        # counts the changes of the batch (a request queued, admitted, preempted or finished,
        # a prefill chunk computed): what was decided for one batch holds while it stays
        self.changes = 0

    def add(self, req: Request) -> None:
        """Queue a request (FCFS); raises QueueFull when ``max_queue`` are waiting."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting; retry later")
        self.waiting.append(req)
        self.changes += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefilling(self) -> bool:
        """Whether a request waits for admission or has more than a decode token to compute
        (its prompt, or what a preemption dropped)."""
        return bool(self.waiting) or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in self.running
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            own = req.num_tokens - req.num_computed_tokens
            n = min(own + len(req.draft), budget)
            del req.draft[max(0, n - own) :]  # the budget cuts the draft first
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, len(req.draft)))
                budget -= n
                i += 1
        # Admit in arrival order; not after a preemption (memory is short this step).
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            req = self.waiting[0]
            hit = self.kv.match(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, req.num_computed_tokens + n):
                self.kv.free(req)
                break
            self.waiting.popleft()
            if not req._admitted:
                req._admitted, req.num_cached_tokens = True, hit
            self.prefix_queried_tokens += req.num_tokens
            self.prefix_hit_tokens += hit
            self.running.append(req)
            self.changes += 1
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        req.draft = []
        self.kv.free(req)  # its whole computed pages stay in the prefix cache
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.changes += 1

    def advance(self, out: SchedulerOutput) -> None:
        """The model ran ``out``: its tokens are computed (call before appending the
        sampled tokens); draft tokens count once accepted (``KVCacheManager.accept_draft``)."""
        for chunk in out.chunks:
            if chunk.start + 1 < chunk.request.num_tokens:  # a prefill chunk: the batch changed
                self.changes += 1
            chunk.request.num_computed_tokens = chunk.start + chunk.n - chunk.n_draft
            self.kv.cache_full_pages(chunk.request)

    def finish(self, req: Request, reason: str) -> None:
        """Take ``req`` out of the queues and give back its pages."""
        req.finish_reason = reason
        req.draft = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.changes += 1
        self.kv.free(req)
