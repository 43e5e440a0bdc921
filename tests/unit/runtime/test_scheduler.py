"""The scheduler with literal token ids and no model.

A fake model writes each computed token id into the real KV pages (layer 0) and
derives the next token from the ids it reads back through the page table, so a
lost, stale or wrongly shared page changes the output: every test checks the
outputs against the same function of the true token history.
"""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.errors import QueueFull
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.scheduler import KVCacheManager, Request, Scheduler, SchedulerOutput

PS = 4


def next_token(history: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7919) % 89 + 10


def reference(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt) :]


class FakeModel:
    def __init__(self, pool: PagePool):
        self.pool = pool

    def run(self, out: SchedulerOutput) -> list[int]:
        """Store the step's tokens, then read each sampling sequence's context back."""
        pool = self.pool
        for c in out.chunks:
            ids = np.asarray(c.request.token_ids[c.start : c.start + c.n], np.float32)
            kv = np.broadcast_to(ids[:, None, None], (c.n, 1, 32))
            pool.storage.write(0, pool.slots(c.request.pages, c.start, c.start + c.n), kv, kv)
        sampled = []
        for c in out.chunks:
            if c.samples:
                keys, _ = pool.storage.read(0, pool.slots(c.request.pages, 0, c.start + c.n))
                sampled.append(next_token([int(k) for k in keys[:, 0, 0]]))
        return sampled


def make(
    n_pages: int = 64, budget: int = 16, max_seqs: int = 4, max_queue: int = 64
) -> tuple[Scheduler, FakeModel]:
    pool = PagePool(1, 1, 32, n_pages=n_pages, page_size=PS, dtype="f32")
    kv = KVCacheManager(pool, RadixCache(pool))
    return Scheduler(kv, budget, max_seqs, max_queue), FakeModel(pool)


def step(sched: Scheduler, model: FakeModel) -> SchedulerOutput:
    out = sched.schedule()
    tokens = model.run(out)
    sched.advance(out)
    for req, token in zip([c.request for c in out.chunks if c.samples], tokens, strict=True):
        req.append(token)
        if req.num_output_tokens >= req.max_tokens:
            sched.finish(req, "length")
    return out


def run_all(sched: Scheduler, model: FakeModel, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, model)
    raise AssertionError("requests did not finish")


def assert_no_leak(sched: Scheduler) -> None:
    """Every page is free or held by the prefix cache alone, and evicting frees all."""
    pool, cache = sched.kv.pool, sched.kv.cache
    assert pool.n_pages - pool.n_free == cache.n_pages == cache.evictable_pages
    assert (pool.refcount <= 1).all()
    cache.evict(pool.n_pages)
    assert pool.n_free == pool.n_pages


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 1000, n)]


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    sched, model = make(budget=8)
    short, long = Request("s", prompt(1, 3), 5), Request("l", prompt(2, 20), 2)
    sched.add(short)
    sched.add(long)
    sizes = []
    while sched.has_unfinished():
        out = step(sched, model)
        sizes.append([(c.request.request_id, c.n) for c in out.chunks])
        assert out.num_tokens <= 8
    assert sizes[:4] == [
        [("s", 3), ("l", 5)],  # the short prompt whole, the long one chunked
        [("s", 1), ("l", 7)],  # decode tokens first, prefill takes the rest
        [("s", 1), ("l", 7)],
        [("s", 1), ("l", 1)],  # the long prompt's last token samples
    ]
    assert short.token_ids[3:] == reference(short.prompt_ids, 5)
    assert long.token_ids[20:] == reference(long.prompt_ids, 2)
    assert_no_leak(sched)


def test_fcfs_admission_under_max_num_seqs():
    sched, model = make(max_seqs=2)
    reqs = [Request(f"r{i}", prompt(i, 5), max_tokens=2 + i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    step(sched, model)
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    step(sched, model)  # r0 finishes (2 tokens)
    assert [r.request_id for r in sched.running] == ["r1"]
    step(sched, model)  # r2 is admitted first, then r1 finishes
    assert [r.request_id for r in sched.running] == ["r2"]
    run_all(sched, model)
    for r in reqs:
        assert r.token_ids[5:] == reference(r.prompt_ids, r.max_tokens)
    assert_no_leak(sched)


def test_preemption_recomputes_and_gives_identical_tokens():
    # 10 pages of 4 tokens; three requests growing to 6 + 24 = 30 tokens (8 pages) each
    sched, model = make(n_pages=10, budget=32, max_seqs=3)
    reqs = [Request(f"r{i}", prompt(10 + i, 6), max_tokens=24) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_all(sched, model)
    assert sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs[1:]) > 0 and reqs[0].num_preemptions == 0
    for r in reqs:
        assert r.token_ids[6:] == reference(r.prompt_ids, 24)
    assert_no_leak(sched)


def test_preempted_request_goes_back_to_the_front_of_the_queue():
    sched, model = make(n_pages=4, budget=32, max_seqs=4)
    a, b, c = (Request(n, prompt(i, 4), max_tokens=8) for i, n in enumerate("abc"))
    for r in (a, b, c):
        sched.add(r)
    preempted = []
    while sched.has_unfinished():
        out = step(sched, model)
        preempted += [r.request_id for r in out.preempted]
        if out.preempted:
            assert sched.waiting[0] is out.preempted[-1]
            assert not [ch for ch in out.chunks if ch.request.request_id == "c"]
    assert preempted
    for r in (a, b, c):
        assert r.token_ids[4:] == reference(r.prompt_ids, 8)
    assert_no_leak(sched)


def test_prefix_hit_shares_pages_and_copies_the_partial_one():
    sched, model = make()
    system = prompt(5, 10)  # two whole pages + 2 tokens
    first = Request("a", [*system, 1, 2, 3], max_tokens=3)
    sched.add(first)
    run_all(sched, model)
    second = Request("b", [*system, 4, 5], max_tokens=6)
    sched.add(second)
    step(sched, model)
    assert second.num_cached_tokens == 10
    assert sched.prefix_hit_tokens == 10
    run_all(sched, model)
    assert second.token_ids[12:] == reference(second.prompt_ids, 6)
    again = Request("c", list(first.token_ids[:13]), max_tokens=3)  # first's pages intact
    sched.add(again)
    run_all(sched, model)
    assert again.num_cached_tokens == 12
    assert again.token_ids[13:] == first.token_ids[13:]
    assert_no_leak(sched)


def test_abort_mid_way_frees_everything():
    sched, model = make(max_seqs=3)
    reqs = [Request(f"r{i}", prompt(20 + i, 9), max_tokens=20) for i in range(5)]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        step(sched, model)
    sched.finish(reqs[1], "abort")  # running
    sched.finish(reqs[4], "abort")  # waiting
    run_all(sched, model)
    assert not sched.running and not sched.waiting
    assert_no_leak(sched)


def test_queue_full():
    sched, _ = make(max_queue=2)
    sched.add(Request("a", [1, 2], 1))
    sched.add(Request("b", [1, 2], 1))
    with pytest.raises(QueueFull):
        sched.add(Request("c", [1, 2], 1))
