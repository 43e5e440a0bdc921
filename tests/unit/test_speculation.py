"""Speculative decoding without a model: the rejection rule keeps the target's distribution
(chi-square over many draws), greedy acceptance, the n-gram drafter, the draft length."""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.errors import InvalidRequest
from dynalm.runtime.kv_cache import PagePool
from dynalm.runtime.radix_cache import RadixCache
from dynalm.runtime.sampling import Sampler, SamplingParams
from dynalm.runtime.scheduler import KVCacheManager, Request, Scheduler
from dynalm.runtime.speculative import (
    DraftLength,
    NgramDrafter,
    accept_greedy,
    accept_sampled,
    check_num_draft_tokens,
)

# chi-square critical values at p = 0.001 (5 and 3 degrees of freedom): a correct sampler
# fails one such test in a thousand; a wrong distribution over 40k draws fails them all.
CHI2_999 = {5: 20.515, 3: 16.266}
DRAWS = 40_000


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float((((counts - expected) ** 2) / expected).sum())


def distributions(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(6), size=3)  # the target at 2 draft positions and after
    q = rng.dirichlet(np.ones(6), size=2)  # the drafter's
    return p, q


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    """Each emitted token follows the target's row at its position, whatever the drafter
    proposed: the first token's law is p[0]; given that the first was the accepted draft
    token, the second's law is p[1]."""
    p, q = distributions(7)
    rng = np.random.default_rng(11)
    draft_rng = np.random.default_rng(12)
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(DRAWS):
        if with_q:  # a sampling drafter: its tokens drawn from q
            draft = [int(draft_rng.choice(6, p=q[j])) for j in range(2)]
            kept = accept_sampled(p, draft, q, rng)
        else:  # a deterministic drafter proposes fixed tokens (a point mass)
            draft = [2, 4]
            kept = accept_sampled(p, draft, None, rng)
        assert 1 <= len(kept) <= 3 and kept[: len(kept) - 1] == draft[: len(kept) - 1]
        first[kept[0]] += 1
        if len(kept) > 1 and kept[0] == draft[0]:
            second[kept[1]] += 1
    assert chi2(first, p[0]) < CHI2_999[5]
    assert chi2(second, p[1]) < CHI2_999[5]


def test_rejection_sampling_after_the_samplers_processing():
    """Through the sampler's own distribution (temperature, top-k): a 4-token slice."""
    logits = np.random.default_rng(3).normal(size=(2, 50)).astype(np.float32) * 2
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=4, top_p=1.0, seed=5))
    p = np.stack([sampler.probabilities(row) for row in logits])
    support = np.flatnonzero(p[0])
    assert len(support) == 4 and np.isclose(p.sum(axis=1), 1).all()
    draft = [int(support[np.argsort(p[0, support])[0]])]  # its least likely kept token
    counts = np.zeros(50)
    for _ in range(DRAWS // 2):
        counts[accept_sampled(p, draft, None, sampler.rng)[0]] += 1
    assert counts[np.flatnonzero(p[0] == 0)].sum() == 0  # top-k's cut holds
    assert chi2(counts[support], p[0, support]) < CHI2_999[3]


def test_greedy_acceptance():
    logits = np.full((4, 8), -1.0, np.float32)
    for j, best in enumerate([3, 5, 1, 6]):
        logits[j, best] = 1.0
    assert accept_greedy(logits, [3, 5, 1]) == [3, 5, 1, 6]  # all kept, then the next
    assert accept_greedy(logits, [3, 2, 1]) == [3, 5]  # the first mismatch is replaced
    assert accept_greedy(logits[:1], []) == [3]


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter()
    req = Request("r", [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 7, 8, 2, 3], 10)
    (draft,) = drafter.propose([req], [3])
    assert draft.tokens == [4, 7, 8] and draft.kind == 2  # "2 3" was last followed by 4 7 8
    req.token_ids += [4, 7]  # the index grows with the sequence
    assert drafter.propose([req], [2])[0].tokens == [8, 2]
    assert drafter.propose([Request("s", [5, 6, 7], 1)], [4])[0].tokens == []
    drafter.release("r")
    assert "r" not in drafter._index


def test_draft_length_adapts_and_probes():
    length = DraftLength(k_max=4)
    for _ in range(8):
        length.update(3, 4, 4)
    length.update(3, 4, 2)
    assert 0.7 < length.rates[3] < 0.9
    length.rates[3] = 0.8
    assert length.choose(1, 0.0) == 4  # a lone stream: each token's 0.8**i beats 0.12
    assert length.choose(16, 0.0) == 1  # a full batch: drafts must pay for their share
    assert length.trim(1, 1, 0.0) == 4  # an unseen kind is tried as the best one
    for _ in range(40):
        length.update(1, 1, 0)
    assert length.trim(1, 1, 0.0) == 0 and length.trim(3, 1, 0.0) == 4  # per kind
    for _ in range(40):
        length.update(3, 1, 0)
    ks = [length.choose(1, 0.0) for _ in range(64)]
    assert ks.count(0) == 60 and ks.count(1) == 64 // 16  # off, probing now and then
    assert length.probing and length.trim(1, 1, 0.0) == 1  # a probe drafts any kind
    assert DraftLength(k_max=4).choose(1, 1.0) == 0  # a draft as costly as the target
    assert DraftLength(k_max=3, adaptive=False).choose(8, 0.5) == 3
    for bad in (0, 17):
        with pytest.raises(InvalidRequest, match="--num-draft-tokens"):
            check_num_draft_tokens(bad)


def test_rejected_draft_pages_go_back_and_never_reach_the_prefix_cache():
    pool = PagePool(0, 1, 32, n_pages=8, page_size=4)
    cache = RadixCache(pool)
    sched = Scheduler(KVCacheManager(pool, cache), max_num_batched_tokens=64)
    req = Request("r", list(range(6)), 20)
    sched.add(req)
    sched.advance(sched.schedule())
    req.append(100)  # sampled: 7 tokens, 6 computed (2 pages)
    req.draft = [101, 102, 103, 104, 105]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.n, chunk.n_draft) == (6, 6, 5) and len(req.pages) == 3
    assert chunk.token_ids == [100, 101, 102, 103, 104, 105]
    sched.advance(out)
    assert req.num_computed_tokens == 7  # the draft is not the request's yet
    req.token_ids += [101, 55]  # one draft token kept, then the target's own
    sched.kv.accept_draft(req, 1)
    assert req.num_computed_tokens == 8 and len(req.pages) == 2 and req.draft == []
    assert cache.n_pages == 2  # 8 computed tokens: 2 whole pages, no rejected token in them
    assert cache.match(list(range(6)) + [100, 101]).n_tokens == 8
    assert pool.n_free == 6
