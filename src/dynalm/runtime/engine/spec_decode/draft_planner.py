"""How many tokens each running sequence drafts, step by step: ``DraftPlanner``.

A decoding sequence whose drafter proposes ``k`` tokens contributes ``1 + k`` tokens to
the step's flat ragged batch (its last token, then the draft), so speculative and
ordinary sequences, prefill chunks included, share one model run; the logits of those
``1 + k`` rows decide what is kept (``engine.rejection_sampler``) and the rejected
positions' keys and values are dropped (``KVCacheManager.accept_draft``).

On a CPU a decode step reads every weight once, so verifying a few more tokens costs
little, until it does not: SmolLM2-135M Q4_1 on 2 threads, one sequence, T = 8 tokens cost
1.6-2x T = 1, T = 9 2.3-2.8x (a kernel's tile of 8 rows is full), then ~0.2x more per token
(``benchmarks/spec_bench.py`` measures it); 8 decoding sequences with one draft token each
take ~1.7x the step of the 8 alone. So the planner times the decode steps (``StepCost``: step
time by token count, learnt online) and decides the draft lengths of the whole step at once
(``plan_drafts``): the draft tokens with the most expected accepted tokens (from each
sequence's acceptance rate, ``DraftLength``) as long as they raise the tokens made per second
of step time. A lone stream drafts eagerly, a full batch only where the curve is flat
enough; where drafting does not pay it stops, trying again now and then. A free drafter
(n-gram lookups) is still asked every step while drafts could pay at all: each proposal is
planned by the rate of its kind (a 3-token match after 1-token misses) and, when not
drafted, its first token is checked against the sampled one, so a short answer that turns
to copying is drafted again within a token or two, not after ``PROBE_EVERY`` steps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynalm.runtime.engine.config import EngineConfig, check_num_draft_tokens
from dynalm.runtime.engine.rejection_sampler import verify
from dynalm.runtime.engine.sampling import Sampler
from dynalm.runtime.engine.scheduler import Request, Scheduler
from dynalm.runtime.engine.spec_decode.drafters import Draft, Drafter
from dynalm.runtime.engine.spec_decode.stats import SpecStats
from dynalm.runtime.engine.spec_decode.step_cost import STEP_STALE, StepCost

EWMA = 0.15  # weight of one draft token's outcome in a sequence's acceptance rate
PRIOR = 0.5  # the acceptance rate assumed before any draft of a kind was verified
PROBE_EVERY = 16  # decode steps without drafting before one token is drafted again
# Drafting must be predicted to make the decoding sequences this much faster: the curve is
# measured with noise, and a draft costs what it does not see (a new step size compiles).
MARGIN = 0.05
# Every this many planned steps, one explores: it plans with ``StepCost.guess``, and without
# the one-size-at-a-time limit, so a size past a jump in the curve gets measured. While no
# plan that does not explore drafts, the gap doubles up to ``STEP_STALE`` steps (a full batch
# on a CPU: each exploration costs a planning and a dear step with drafts mostly rejected).
EXPLORE_EVERY = 32


def plan_drafts(
    rates: Sequence[float],
    lengths: Sequence[int],
    n_decode: int,
    n_other: int,
    step: Callable[[int], float],
    pass_time: Callable[[int], float] | None = None,
    most: int | None = None,
    closed: bool = False,
) -> list[int]:
    """How many draft tokens each of the sequences that may draft puts in the step.

    ``rates[i]``: sequence i's per-token acceptance rate, so its j-th draft token adds
    ``rates[i] ** j`` expected tokens; ``lengths[i]``: the most it may draft. The step
    computes ``n_decode`` decoding sequences' last tokens (each makes one token) and
    ``n_other`` prefill tokens; ``step(T)`` is the time of a step of T tokens and
    ``pass_time(n)`` a drafter pass over n sequences (drafting j tokens takes j passes);
    ``most``: the most draft tokens in all (None: no limit); ``closed``: no request waits
    for what a sequence that finishes sooner would free (its seat, pages, budget).

    Taking the K most valuable draft tokens (gain G_K, drafter time D_K) for K = 0, 1, ...,
    the decoding sequences alone make ``r_K = (n_decode + G_K) / (step(n_decode + K) + D_K)``
    tokens per second; the best K there is the rate r* that time is worth. The step then
    takes the K that maximises ``G_K - r* (step(T0 + K) - step(T0) + D_K)``, T0 the step's
    tokens without drafts: without prefill tokens this is the K of rate r* itself; with
    them, drafts must pay for their marginal time at r*. The whole curve is searched, not one
    token at a time: a step time that jumps (a kernel's tile filled) and then grows slowly
    can make 8 draft tokens pay where 1 does not.

    That values a token at 1 / r*, right where a sequence that finishes sooner makes room
    for a waiting request. In a ``closed`` batch (none waits) the batch ends when its
    slowest sequence does: what every decoding sequence gains at least (G_min each, n_decode
    G_min in all) shortens the batch and keeps that value, but the rest only shortens its
    own sequence, which saves the later steps its share of their time, the step's marginal
    time per sequence: ``(step(n_decode) - step(1)) / (n_decode - 1)``. On a CPU whose step
    time is mostly reading the weights that share is small (SmolLM2-135M, 2 threads: 8
    sequences cost 1.8x one, 0.3 ms a sequence against 0.6 ms a token at r*), so 8 streams
    mixing copy-heavy and open-ended text do not cross a kernel tile for a few of them; a
    lone stream, or a batch that all drafts well, is planned as before."""
    pass_time = pass_time or (lambda n: 0.0)
    most = sum(lengths) if most is None else max(0, most)
    candidates = sorted(
        ((r**j, i) for i, (r, n) in enumerate(zip(rates, lengths, strict=True))
         for j in range(1, min(n, most) + 1)),
        key=lambda c: (-c[0], c[1]),  # the surest first; of equals, the earlier sequence's
    )[:most]  # fmt: skip
    if not candidates:
        return [0] * len(rates)
    counts, passes = [0] * len(rates), [0] * (max(lengths, default=0) + 1)
    gains, drafts = [0.0], [0.0]  # G_K, D_K
    own = [0.0] * len(rates)  # each sequence's gain in the first K
    floors = [0.0] if closed else None  # G_min of the first K (0 while one decodes alone)
    for gain, i in candidates:
        counts[i] += 1
        p = counts[i]
        drafts.append(drafts[-1] + pass_time(passes[p] + 1) - pass_time(passes[p]))
        passes[p] += 1
        gains.append(gains[-1] + gain)
        if floors is not None:
            own[i] += gain
            floors.append(min(own) if len(own) == n_decode else 0.0)
    best_k = _best_k(gains, drafts, n_decode, n_other, step, floors)
    ks = [0] * len(rates)
    for _, i in candidates[:best_k]:
        ks[i] += 1
    return ks


def _best_k(
    gains: Sequence[float],
    drafts: Sequence[float],
    n_decode: int,
    n_other: int,
    step: Callable[[int], float],
    floors: Sequence[float] | None = None,
) -> int:
    """``plan_drafts``' choice of K from G_K and D_K (K = 0, 1, ...); ``floors[K]``: in a
    closed batch, the gain each decoding sequence has at least in the first K (else None)."""
    ks = range(len(gains))
    decode = [step(n_decode + k) for k in ks]  # each step time once: this runs every step
    whole = [step(n_decode + n_other + k) for k in ks] if n_other else decode
    speeds = [(n_decode + g) / (t + d) for g, t, d in zip(gains, decode, drafts, strict=True)]
    worth = max(speeds)
    if worth < (1 + MARGIN) * speeds[0]:
        return 0
    average = share = 1 / worth  # the seconds a token is worth, and one only its sequence's
    if floors is not None and n_decode > 1:
        share = max(0.0, decode[0] - step(1)) / (n_decode - 1) / (1 + MARGIN)  # (noisy times)
        share = min(average, share)
    best, best_k = 0.0, 0
    for k in ks[1:]:
        # the gain all share keeps 1 / r*; the rest, what only its own sequence gains, ``share``
        batch = gains[k] if floors is None else n_decode * floors[k]
        valued = batch * average + (gains[k] - batch) * share
        value = valued - (whole[k] - whole[0] + drafts[k])
        if value > best or (value == best == 0.0 and gains[k] > 0):  # a free draft is taken
            best, best_k = value, k
    return best_k


def drafts_can_pay(
    n_decode: int, n_other: int, step: Callable[[int], float], most: int, closed: bool = False
) -> bool:
    """Whether up to ``most`` draft tokens could pay in this step even if each were sure to
    be accepted and free to draft, one per sequence before any gets two (else the drafter
    need not be asked: a full batch on a CPU whose step time doubles from 8 to 16 tokens)."""
    k = range(max(0, most) + 1)
    floors = [float(i // n_decode) for i in k] if closed and n_decode else None
    gains = [float(i) for i in k]
    return _best_k(gains, [0.0 for _ in k], n_decode, n_other, step, floors) > 0


@dataclass
class DraftLength:
    """One sequence's acceptance rates: an EWMA per draft token, kept per kind of draft (the
    n-gram drafter's match length: a 3-token match is surer than a 1-token one; a model
    drafter has one kind). How many tokens it drafts is decided for the whole step
    (``plan_drafts``) from these rates and the measured step times. After ``PROBE_EVERY``
    steps in a row without a draft the rates it gets planned with are the prior again, once:
    the text may have changed. (A free drafter is asked every step: its proposal is planned
    with the learnt rate of its kind, and its first token, if not verified, checked against
    the target's, which moves them: ``DraftPlanner.sampled``.)"""

    k_max: int
    rates: dict[int, float] = field(default_factory=dict)  # acceptance per token, by kind
    idle: int = 0  # steps in a row without drafting

    def rate(self, kind: int | None = None, probe: bool = True) -> float:
        """The acceptance rate to plan a draft of ``kind`` with (None: its best kind's; an
        unseen kind is tried as the best one, or the prior where that is below it: a longer
        n-gram match than the ones that missed may well hit); ``probe``: the prior's, when
        due."""
        if probe and self.idle >= PROBE_EVERY:
            return max([PRIOR, *self.rates.values()])
        best = max(self.rates.values(), default=PRIOR)
        return best if kind is None else self.rates.get(kind, max(best, PRIOR))

    def planned(self, k: int) -> None:
        """The step drafts ``k`` tokens for it."""
        self.idle = 0 if k or self.idle >= PROBE_EVERY else self.idle + 1

    def update(self, kind: int, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` tokens were kept (the ones after a rejection were
        not tried, so they are not counted)."""
        rate = self.rates.get(kind, PRIOR)
        for hit in [1.0] * accepted + [0.0] * (accepted < drafted):
            rate += EWMA * (hit - rate)
        self.rates[kind] = rate


@dataclass
class _NoDrafts:
    """A plan that drafts nothing, standing while the scheduler's batch stays as it was
    (``changes``) until plan number ``until``: when the sequences' next probe is due, or
    never where not even sure drafts could pay. Meanwhile no rate moves (nothing is drafted
    or looked up) and the step times drift slowly, so a step plans nothing: it costs what it
    would without a drafter. The steps it stood for count as idle for ``counts`` after."""

    changes: int
    at: int  # the plan that made it
    until: float
    counts: list[DraftLength]

    def end(self, plans: int) -> None:
        for count in self.counts:
            count.idle += plans - 1 - self.at


@dataclass
class _Drafting:
    """A speculating request's draft state."""

    length: DraftLength
    probs: np.ndarray | None = None  # what the drafter drew this step's draft from
    kind: int = 0  # and what acceptance rate that draft goes by
    # a free drafter's proposal this step did not verify: (position, first token, kind), its
    # first token checked against the one sampled there, so rates are learnt without drafting
    shadow: tuple[int, int, int] | None = None


class DraftPlanner:
    """The speculative side of an engine: its drafter, the step-time curve (``step_cost``),
    each speculating request's acceptance rates, and the plan of each step's drafts
    (``plan``), verified after the step (``verify``). ``stats``: the verified drafts."""

    def __init__(self, drafter: Drafter, config: EngineConfig, stats: SpecStats) -> None:
        self.drafter, self.stats = drafter, stats
        self._k_max = check_num_draft_tokens(config.num_draft_tokens)
        self._ctx, self._adaptive = config.ctx, config.adaptive_draft
        self.step_cost = StepCost()  # decode steps' times by token count
        self._plans = 0  # steps planned
        self._explore_at = self._explore_gap = EXPLORE_EVERY  # the next plan that explores
        self._standing: _NoDrafts | None = None  # a plan to draft nothing, while it stands
        self._seqs: dict[str, _Drafting] = {}  # the requests that speculate
        self._warm: set[int] = set()  # step sizes run once (the first run is not timed)

    def add(self, request_id: str) -> None:
        """Draft for this request."""
        self._seqs[request_id] = _Drafting(DraftLength(self._k_max))

    def release(self, request_id: str) -> None:
        """The request finished: forget it (the drafter too)."""
        self._seqs.pop(request_id, None)
        self.drafter.release(request_id)

    def plan(self, sched: Scheduler) -> None:
        """Drafts for the running sequences that decode (only their last token is left to
        compute; ``Request.draft``): as many tokens as ``plan_drafts`` finds worth their
        time in this step, from each one's acceptance rates and the measured step times."""
        ctx, drafter = self._ctx, self.drafter
        self._plans += 1
        explore = self._plans >= self._explore_at
        if explore:
            self._explore_gap = min(2 * self._explore_gap, STEP_STALE)
            self._explore_at = self._plans + self._explore_gap
        standing = self._standing
        if standing is not None:
            if standing.changes == sched.changes and self._plans < standing.until and not explore:
                return
            self._standing = None
            standing.end(self._plans)
        n_decode, pending, asked, rooms = 0, 0, [], []
        for req in sched.running:
            own = req.num_tokens - req.num_computed_tokens
            if own != 1:  # a prefill chunk
                pending += own
                continue
            n_decode += 1
            seq = self._seqs.get(req.request_id)
            room = min(req.max_tokens - req.num_output_tokens, ctx - req.num_tokens) - 1
            if seq is not None and room > 0:
                asked.append((req, seq))
                rooms.append(min(room, seq.length.k_max))
        if not asked:
            return
        seats = sched.max_num_seqs - len(sched.running)
        pending += sum(r.num_tokens for r in itertools.islice(sched.waiting, seats))
        n_other = min(pending, max(0, sched.max_num_batched_tokens - n_decode))
        # no request waits (for a seat, pages or budget a sequence that finishes would free)
        closed = not sched.waiting
        adaptive, cost = self._adaptive, self.step_cost
        # one token past the largest step measured (beyond it the curve is a guess, and a
        # step of a new size compiles first), but now and then as far as the prior guesses
        curve = cost.guess if explore else cost
        most = sum(rooms) if explore else max(cost.largest, n_decode) + 1 - n_decode
        counts = [seq.length for _, seq in asked]
        if adaptive and not drafts_can_pay(n_decode, n_other, curve, min(most, sum(rooms)), closed):
            return self._plan_none(sched, counts, probes=False)  # (a probe due now: in vain)
        rates = [c.rate() for c in counts]
        pass_time = None if drafter.free else lambda n: drafter.pass_time(n, cost)

        def plan(rates: list[float], rooms: list[int]) -> list[int]:
            if not adaptive:
                return rooms
            return plan_drafts(rates, rooms, n_decode, n_other, curve, pass_time, most, closed)

        ks = plan(rates, rooms)
        if not any(ks) and not drafter.free:  # (not even at each one's best rate)
            return self._plan_none(sched, counts, probes=True)
        if drafter.free:  # drafts first, then how much of each to verify
            drafts = drafter.propose([req for req, _ in asked], rooms)
            rooms = [len(d.tokens) for d in drafts]
            # by the rates of their kinds, without a probe's prior: what a free draft's
            # first token would have been worth is learnt from its shadow (``sampled``)
            rates = [c.rate(d.kind, probe=False) for c, d in zip(counts, drafts, strict=True)]
            ks = plan(rates, rooms)
        else:
            want = [i for i, k in enumerate(ks) if k]
            drafts = [Draft([]) for _ in asked]
            proposed = drafter.propose([asked[i][0] for i in want], [ks[i] for i in want])
            for i, draft in zip(want, proposed, strict=True):
                drafts[i] = draft
        for (req, seq), k, draft in zip(asked, ks, drafts, strict=True):
            seq.length.planned(k)
            if drafter.free and not k and draft.tokens:
                seq.shadow = (req.num_tokens, draft.tokens[0], draft.kind)
            req.draft = draft.tokens[:k]
            seq.probs = None if draft.probs is None else draft.probs[:k]
            seq.kind = draft.kind
        if not explore and any(ks):  # drafting pays here: explore at the first pace again
            self._explore_gap = EXPLORE_EVERY
            self._explore_at = min(self._explore_at, self._plans + EXPLORE_EVERY)

    def _plan_none(self, sched: Scheduler, counts: list[DraftLength], probes: bool) -> None:
        """Draft nothing this step, and while the batch stays: until a sequence's probe is
        due (``probes``), else until it changes."""
        for count in counts:
            count.planned(0)
        due = self._plans + PROBE_EVERY + 1 - max(c.idle for c in counts) if probes else math.inf
        self._standing = _NoDrafts(sched.changes, self._plans, due, counts)

    def sampled(self, req: Request, token: int) -> None:
        """``token`` was sampled after ``req``'s last one: was it what the free drafter
        proposed (and this step did not verify)? One draft token's outcome for its rate: the
        chance a draft token is kept is the chance the target picks it (greedy or
        sampled), so a sequence that never drafts still learns whether drafts would pay."""
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.shadow is None:
            return
        (at, proposed, kind), seq.shadow = seq.shadow, None
        if at == req.num_tokens:  # (not a proposal from before a preemption)
            seq.length.update(kind, 1, int(token == proposed))

    def verify(self, sampler: Sampler, req: Request, logits: np.ndarray) -> list[int]:
        """The tokens ``req`` keeps of its draft and the one after, from its penalised
        logits ``[1 + len(draft), V]``; the outcome moves its rate and the stats."""
        seq = self._seqs[req.request_id]
        kept = verify(sampler, logits, req.draft, seq.probs)
        drafted, accepted = len(req.draft), len(kept) - 1
        self.stats.record(drafted, accepted)
        seq.length.update(seq.kind, drafted, accepted)
        return kept

    def record_step(self, n_tokens: int, seconds: float) -> None:
        """A decode step of ``n_tokens`` took ``seconds`` (what compiling took left out).
        The first step of each size is not timed: it also binds argument blocks, grows
        buffers and meets cold caches, and one dear first sample of T = 2 would stop a
        short answer from ever drafting again."""
        if n_tokens not in self._warm:
            self._warm.add(n_tokens)
            return
        self.step_cost.record(n_tokens, seconds)
