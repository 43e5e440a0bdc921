"""Speculative decoding without a model: the rejection rule keeps the target's distribution
(chi-square over many draws), greedy acceptance, the n-gram drafter, the draft length."""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.errors import InvalidRequest
from dynalm.runtime.engine.config import EngineConfig, check_num_draft_tokens
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.rejection_sampler import accept_greedy, accept_sampled
from dynalm.runtime.engine.sampling import Sampler, SamplingParams
from dynalm.runtime.engine.scheduler import KVCacheManager, Request, Scheduler
from dynalm.runtime.engine.spec_decode.draft_planner import (
    EWMA,
    MARGIN,
    PRIOR,
    PROBE_EVERY,
    DraftLength,
    DraftPlanner,
    drafts_can_pay,
    plan_drafts,
)
from dynalm.runtime.engine.spec_decode.drafters import NgramDrafter
from dynalm.runtime.engine.spec_decode.stats import SpecStats
from dynalm.runtime.engine.spec_decode.step_cost import STEP_EWMA, STEP_STALE, StepCost

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


@pytest.mark.slow  # many draws
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


# A synthetic step-time curve shaped like SmolLM2-135M's on 2 threads (ms): slow growth while
# a kernel tile of 8 rows fills, a jump at 9, then linear.
def curve(t: int) -> float:
    if t <= 0:
        return 0.0
    return 3.4 + 0.3 * (t - 1) if t <= 8 else 7.8 + 0.6 * (t - 9)


def test_step_cost_learns_the_curve():
    cost = StepCost()
    assert not cost.measured and cost(1) == 1.0 and cost(11) == pytest.approx(2.0)  # the prior
    cost.record(8, 5.6)
    assert cost(8) == 5.6
    assert cost(16) == pytest.approx(5.6 * 2.5 / 1.7)  # scaled from 8 by the prior's shape
    assert cost(1) == pytest.approx(5.6 / 1.7)
    cost.record(9, 7.8)  # a jump: above, the curve goes on with its slope
    assert cost(12) == pytest.approx(7.8 + 3 * 2.2)
    assert cost.guess(12) == pytest.approx(7.8 * 2.1 / 1.8)  # exploring: the prior's slope
    assert cost.guess(8) == cost(8)
    cost.record(16, 11.4)
    assert cost(12) == pytest.approx(7.8 + 3 * 3.6 / 7)  # interpolated between neighbours
    cost.record(16, 13.4)  # an EWMA: one sample moves it by STEP_EWMA of the difference
    assert cost(16) == pytest.approx(11.4 + STEP_EWMA * 2.0)
    cost.record(4, 100.0)  # a stall: counted as twice the estimate
    assert cost.times[4] == pytest.approx(2 * 5.6 * 1.3 / 1.7)
    assert cost(0) == 0.0


def test_plan_drafts_on_a_synthetic_curve():
    # one stream: T = 1 -> 5 costs 36 % more; 4 tokens of a good rate pay, of a poor one none
    assert plan_drafts([0.9], [4], 1, 0, curve) == [4]
    assert plan_drafts([0.9], [2], 1, 0, curve) == [2]  # no more than the draft has
    assert plan_drafts([0.08], [4], 1, 0, curve) == [0]  # 1.08 tokens for 1.09x the time
    # 1.12 tokens for 1.09x the time: 3 % faster, under MARGIN; 1.2 tokens: 10 % faster
    assert MARGIN == 0.05 and plan_drafts([0.12], [1], 1, 0, curve) == [0]
    assert plan_drafts([0.2], [1], 1, 0, curve) == [1]
    # 4 streams: 4 more tokens fill the tile (T = 8) cheaply; the 5th would cross the jump
    assert plan_drafts([0.9, 0.9, 0.9, 0.9], [4] * 4, 4, 0, curve) == [1, 1, 1, 1]
    # the 4 surest tokens: 0.95, 0.95**2, then 0.6 and 0.6 (not 0.6**2)
    assert plan_drafts([0.95, 0.6, 0.6, 0.6], [2] * 4, 4, 0, curve) == [2, 1, 1, 0]
    # 8 streams at 77 %: every draft token crosses the jump: 8 tokens make 8 for 5.5 ms,
    # 16 make 8 + 6.2 for 11.4 ms; none is drafted
    assert plan_drafts([0.77] * 8, [4] * 8, 8, 0, curve) == [0] * 8

    # ... but with sure drafts, a rate one token cannot reach, 8 can: a jump, then flat
    def jump(t: int) -> float:
        return 0.0 if t <= 0 else 1.0 if t <= 8 else 1.5 if t <= 16 else 1.5 + 0.2 * (t - 16)

    assert plan_drafts([0.95] * 8, [4] * 8, 8, 0, jump) == [1] * 8
    # prefill tokens in the step: drafts pay for their marginal time at the decode rate
    # (a stream at 0.4 alone: 2 tokens, 1.56 tokens for 4.0 ms, 0.39 per ms; beside 100
    # prefill tokens a token costs 0.6 ms, 0.23 tokens' worth: the first pays, the second not)
    assert plan_drafts([0.4], [4], 1, 0, curve) == [2]
    assert plan_drafts([0.4], [4], 1, 100, curve) == [1]
    flat = lambda t: 1.0 + 0.01 * t  # noqa: E731 (weights dominate: tokens nearly free)
    assert plan_drafts([0.9], [4], 1, 100, flat) == [4]
    # a draft model's passes: as dear as the target, never; a tenth of it, yes
    assert plan_drafts([1.0], [4], 1, 0, curve, curve) == [0]
    assert plan_drafts([0.9], [4], 1, 0, curve, lambda n: 0.1 * curve(n)) == [4]
    assert plan_drafts([], [], 3, 0, curve) == []


def test_drafts_can_pay():
    assert drafts_can_pay(1, 0, curve, 4)  # a lone stream
    assert drafts_can_pay(4, 0, curve, 4)  # up to the tile's 8 rows
    assert not drafts_can_pay(8, 0, curve, 8)  # the tile is full: 16 tokens cost 2.1x 8
    assert not drafts_can_pay(8, 0, curve, 0) and not drafts_can_pay(1, 0, float, 4)


def test_draft_length_rates_and_probes():
    length = DraftLength(k_max=4)
    assert length.rate() == PRIOR and length.rate(3) == PRIOR
    for _ in range(PROBE_EVERY):
        length.planned(0)
    assert length.rate() == PRIOR  # a probe before any draft was verified
    length.planned(1)
    for _ in range(8):
        length.update(3, 4, 4)
    length.update(3, 4, 2)
    assert 0.7 < length.rates[3] < 0.9
    assert length.rate(1) == length.rates[3]  # an unseen kind is tried as the best one
    for _ in range(40):
        length.update(1, 1, 0)
        length.update(3, 1, 0)
    assert length.rate() < 0.01
    for _ in range(PROBE_EVERY):  # steps without a draft: the next one plans with the prior
        length.planned(0)
    assert length.rate() == PRIOR and length.rate(1) == PRIOR
    length.planned(0)  # probed (drafted or not): back to its own rates
    assert length.rate() < 0.01


def test_bad_draft_lengths():
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


def test_step_cost_forgets_what_it_no_longer_measures():
    cost = StepCost()
    cost.record(2, 9.0)  # a stall made T = 2 look dear
    for _ in range(STEP_STALE):
        cost.record(1, 3.0)
    assert cost.times.keys() == {1, 2}
    cost.record(1, 3.0)
    assert cost.times.keys() == {1} and cost(2) == pytest.approx(3.3)  # from T = 1 again


def test_plan_drafts_explores_one_token_at_a_time():
    assert plan_drafts([0.9], [4], 1, 0, curve, most=1) == [1]
    assert plan_drafts([0.9, 0.9], [4, 4], 2, 0, curve, most=3) == [2, 1]
    assert plan_drafts([0.9], [4], 1, 0, curve, most=0) == [0]
    cost = StepCost()
    assert cost.largest == 0
    cost.record(5, 1.0)
    cost.record(3, 1.0)
    assert cost.largest == 5


def tile(t: int) -> float:
    """8 sequences cost 1.35x one (0.05 a sequence), then a kernel's tile fills: a jump of
    0.5, and 0.05 a token again."""
    return 0.0 if t <= 0 else 1 + 0.05 * (t - 1) if t <= 8 else 1.9 + 0.05 * (t - 9)


def test_plan_drafts_in_a_closed_batch():
    """With no request waiting to be admitted, draft tokens that only shorten their own
    sequence are worth its marginal time (0.05 / (1 + MARGIN) here, under the 0.05 a token
    costs past the tile): 5 copy-heavy streams beside 3 chats cross the tile where requests
    wait, not where none does. What every sequence gains shortens the whole batch: a batch
    that all drafts well, or a lone stream, is planned as before."""
    mixed = [0.95] * 5 + [0.1] * 3
    assert sum(plan_drafts(mixed, [4] * 8, 8, 0, tile)) > 8  # requests wait: drafts pay
    assert plan_drafts(mixed, [4] * 8, 8, 0, tile, closed=True) == [0] * 8
    uniform = [0.95] * 8
    open_plan = plan_drafts(uniform, [4] * 8, 8, 0, tile)
    assert (
        sum(open_plan) > 0 and plan_drafts(uniform, [4] * 8, 8, 0, tile, closed=True) == open_plan
    )
    assert plan_drafts([0.9], [4], 1, 0, curve, closed=True) == [4]
    # fewer sure tokens than sequences only shorten some: 7 of them pay only where requests wait
    assert drafts_can_pay(8, 0, tile, 7) and not drafts_can_pay(8, 0, tile, 7, closed=True)
    assert drafts_can_pay(8, 0, tile, 8, closed=True)  # one each: the batch ends sooner


def test_shadow_drafts_teach_the_rate():
    """A free drafter's first token that the step did not verify is checked against the
    token sampled there: one draft token's outcome for its kind's rate; a proposal made for
    another position (the request was preempted and recomputed since) is ignored."""
    planner = DraftPlanner(NgramDrafter(), EngineConfig(num_draft_tokens=4), SpecStats())
    req = Request("r", [1, 2, 3], 8)
    planner.add("r")
    seq = planner._seqs["r"]
    seq.shadow = (3, 7, 2)
    planner.sampled(req, 7)
    assert seq.shadow is None and seq.length.rates == {2: PRIOR + EWMA * (1 - PRIOR)}
    seq.shadow = (3, 5, 1)
    planner.sampled(req, 7)  # missed
    assert seq.length.rates[1] == PRIOR * (1 - EWMA)
    seq.shadow = (2, 7, 3)  # made for position 2
    planner.sampled(req, 7)
    assert 3 not in seq.length.rates and seq.shadow is None


def test_a_lone_stream_drafts_a_longer_match_after_short_ones_missed():
    """Issue 23's short answer: after 1-token n-gram matches missed, a 3-token match is
    drafted at once (an unseen kind is planned with the prior, and a free drafter is asked
    every step), not after ``PROBE_EVERY`` idle steps."""
    pool = PagePool(0, 1, 32, n_pages=16, page_size=4)
    sched = Scheduler(KVCacheManager(pool, RadixCache(pool)), max_num_batched_tokens=64)
    planner = DraftPlanner(NgramDrafter(), EngineConfig(num_draft_tokens=4), SpecStats())
    for t in (1, 2, 3, 4, 5):  # a lone stream's curve: a draft token costs 10 %
        for _ in range(2):  # (the first step of a size is not timed)
            planner.record_step(t, 1.0 + 0.1 * (t - 1))
    req = Request("r", [5, 6, 7, 8, 1, 2, 3, 9, 4, 4, 1, 2, 3], 20)
    sched.add(req)
    planner.add("r")
    sched.advance(sched.schedule())
    req.append(9)  # ... 1 2 3 9 (computed but this last one): "2 3 9" followed by 4 4
    planner._seqs["r"].length.rates[1] = 0.2  # 1-token matches missed
    planner.plan(sched)
    assert req.draft[:2] == [4, 4]
