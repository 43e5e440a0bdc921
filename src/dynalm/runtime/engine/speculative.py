"""Speculative decoding: drafters propose tokens, the engine verifies them in its step.

A decoding sequence whose drafter proposes ``k`` tokens contributes ``1 + k`` tokens to
the step's flat ragged batch (its last token, then the draft), so speculative and
ordinary sequences, prefill chunks included, share one model run. The logits of those
``1 + k`` rows decide what is kept (``verify``): greedy requests keep the longest prefix
of the draft that matches the target's argmax, plus the target's next token; sampled
requests use the rejection rule of speculative sampling (Leviathan et al. 2023, Chen et
al. 2023) on the distribution the request's own sampler draws from (penalties, logit
bias, temperature, top-k/p, min-p applied), so their tokens follow the target's
distribution exactly. Rejected positions' keys and values are dropped
(``KVCacheManager.accept_draft``).

On a CPU a decode step reads every weight once, so verifying a few more tokens costs
little, until it does not: SmolLM2-135M Q4_1 on 2 threads, one sequence, T = 8 tokens cost
1.6-2x T = 1, T = 9 2.3-2.8x (a kernel's tile of 8 rows is full), then ~0.2x more per token
(``benchmarks/spec_bench.py`` measures it); 8 decoding sequences with one draft token each
take ~1.7x the step of the 8 alone. So the engine times its decode steps (``StepCost``: step
time by token count, learnt online) and decides the draft lengths of the whole step at once
(``plan_drafts``): the draft tokens with the most expected accepted tokens (from each
sequence's acceptance rate, ``DraftLength``) as long as they raise the tokens made per second
of step time. A lone stream drafts eagerly, a full batch only where the curve is flat
enough; where drafting does not pay it stops, trying again now and then.

Drafters (``Drafter``: ``propose`` and ``release``; a new one is one class):
* ``NgramDrafter``: prompt lookup: the last n tokens (n = 3, 2, 1) found earlier in the
  sequence's own prompt and output propose what followed them. No model, no cost.
* ``ModelDrafter``: a smaller model with the target's vocabulary (``for_model``), run by
  the engine's own parts (executor, paged KV pool, KV manager) over sequences that follow
  the target's accepted tokens; ``layer_skip`` makes the target itself, with some layers
  skipped, its draft.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynalm.core.device import Device
from dynalm.errors import InvalidRequest
from dynalm.ir.executor import Executor
from dynalm.ir.graph import Graph
from dynalm.models.hparams import HParams
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.sampling import Sampler, _check
from dynalm.runtime.engine.scheduler import KVCacheManager, Request, ScheduledChunk

MAX_DRAFT_TOKENS = 16
EWMA = 0.15  # weight of one draft token's outcome in a sequence's acceptance rate
PRIOR = 0.5  # the acceptance rate assumed before any draft of a kind was verified
PROBE_EVERY = 16  # decode steps without drafting before one token is drafted again
# The step-time curve's shape assumed before two sizes are measured, in one-token steps:
# 1 + 0.1 per further token. It is optimistic on purpose (SmolLM2-135M Q4_1, 2 threads:
# T = 8 costs 1.6x T = 1, T = 16 3.4x): a size thought too cheap is tried and then measured,
# a size thought too dear would never be tried, so never corrected.
PRIOR_SLOPE = 0.1
# Drafting must be predicted to make the decoding sequences this much faster: the curve is
# measured with noise, and a draft costs what it does not see (a new step size compiles).
MARGIN = 0.05
# Every this many planned steps, one explores: it plans with ``StepCost.guess``, and without
# the one-size-at-a-time limit, so a size past a jump in the curve gets measured. While no
# plan that does not explore drafts, the gap doubles up to ``STEP_STALE`` steps (a full batch
# on a CPU: each exploration costs a planning and a dear step with drafts mostly rejected).
EXPLORE_EVERY = 32
STEP_EWMA = 0.1  # weight of one measured step in its token count's time (steps are noisy)
# A token count's time not measured again in this many steps is forgotten, so a size that
# a stall or a busy machine made look dear is estimated from its neighbours and tried again.
STEP_STALE = 256


def check_num_draft_tokens(k: int) -> int:
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
    return k


# -- verification -----------------------------------------------------------------------


def accept_greedy(logits: np.ndarray, draft: Sequence[int]) -> list[int]:
    """The tokens a greedy request keeps from ``draft`` given the target's (penalised)
    logits at its ``1 + len(draft)`` positions: the draft's longest prefix that matches the
    argmax, then the target's own token after it."""
    best = logits.argmax(axis=1)
    kept = []
    for j, token in enumerate(best.tolist()):
        _check(bool(np.isfinite(logits[j, token])))
        if j == len(draft) or draft[j] != token:
            return [*kept, token]
        kept.append(token)
    raise AssertionError("unreachable: the last row always decides")


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    mass = np.cumsum(weights)
    _check(bool(np.isfinite(mass[-1]) and mass[-1] > 0))
    at = int(np.searchsorted(mass, rng.random() * mass[-1], side="right"))
    return min(at, int(np.flatnonzero(weights)[-1]))


def accept_sampled(
    p: np.ndarray,
    draft: Sequence[int],
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> list[int]:
    """Speculative sampling: the tokens kept from ``draft``, then one drawn. ``p``
    ``[d + 1, V]``: the target's distributions at the draft's positions and after it;
    ``q`` ``[d, V]``: the drafter's, or None for a deterministic drafter (a point mass on
    each draft token). Draft token x is kept with probability min(1, p(x) / q(x)); at the
    first rejection a token is drawn from normalise(max(0, p - q)), else one from the last
    row of ``p``. Each kept or drawn token is distributed exactly as ``p`` says."""
    kept: list[int] = []
    for j, token in enumerate(draft):
        qx = 1.0 if q is None else float(q[j, token])
        if rng.random() * qx < p[j, token]:
            kept.append(token)
            continue
        if q is None:
            residual = p[j].copy()
            residual[token] = 0.0
        else:
            residual = np.maximum(p[j] - q[j], 0.0)
        return [*kept, _draw(residual, rng)]
    return [*kept, _draw(p[len(draft)], rng)]


def verify(
    sampler: Sampler, logits: np.ndarray, draft: Sequence[int], q: np.ndarray | None
) -> list[int]:
    """The tokens a request keeps from its draft and the one after, from its penalised
    logits ``[1 + len(draft), V]`` (``accept_greedy`` or ``accept_sampled``)."""
    if sampler.greedy:
        return accept_greedy(logits, draft)
    p = np.stack([sampler.probabilities(row) for row in logits])
    return accept_sampled(p, draft, q, sampler.rng)


# -- how many tokens to draft --------------------------------------------------------------


def _prior(n_tokens: int) -> float:
    return 1 + PRIOR_SLOPE * (n_tokens - 1)


class StepCost:
    """The time of a model step by its token count T, learnt online: an EWMA of the measured
    times of each T; a T not measured yet is interpolated linearly between its measured
    neighbours; above the largest measured T it goes on with the slope of the last measured
    stretch (a jump there, such as a kernel's tile filling up, is taken to go on: pessimistic,
    so such sizes are not explored); with one T measured, or below the smallest, it is scaled
    by the prior curve (``PRIOR_SLOPE``), and with nothing measured it is the prior itself (in
    one-token steps). A T not measured for ``STEP_STALE`` steps is forgotten (the machine's
    load changes; a stall made it look dear). What a step spent compiling a new shape is not
    its cost (the caller's business)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._seen: dict[int, int] = {}  # the record each token count was last measured in
        self._records = 0
        self._keys: list[int] = []  # measured T, ascending

    @property
    def measured(self) -> bool:
        return bool(self.times)

    @property
    def largest(self) -> int:
        """The largest token count measured (0: none)."""
        return self._keys[-1] if self._keys else 0

    def record(self, n_tokens: int, seconds: float) -> None:
        # a sample more than twice the estimate counts as twice: one stall must not make a
        # size look so dear that it is not tried (so not measured) again for a long while
        old = self(n_tokens) if self.times else None
        if old is not None:
            seconds = min(seconds, 2 * old)
        if n_tokens in self.times:
            self.times[n_tokens] += STEP_EWMA * (seconds - self.times[n_tokens])
        else:
            self.times[n_tokens] = seconds
        self._records += 1
        self._seen[n_tokens] = self._records
        for t in [t for t, at in self._seen.items() if self._records - at > STEP_STALE]:
            del self.times[t], self._seen[t]
        self._keys = sorted(self.times)

    def __call__(self, n_tokens: int) -> float:
        return self._estimate(n_tokens, optimistic=False)

    def guess(self, n_tokens: int) -> float:
        """The estimate, but above the largest measured T on the prior's gentle slope: what
        an exploring step plans with, so that sizes past a jump are tried now and then."""
        return self._estimate(n_tokens, optimistic=True)

    def _estimate(self, n_tokens: int, optimistic: bool) -> float:
        if n_tokens <= 0:
            return 0.0
        times, keys = self.times, self._keys
        if n_tokens in times:
            return times[n_tokens]
        if not keys:
            return _prior(n_tokens)
        at = bisect.bisect_left(keys, n_tokens)
        if at == 0:  # below every measured size
            return times[keys[0]] * _prior(n_tokens) / _prior(keys[0])
        if at == len(keys):  # above: the last measured stretch's slope, at least the prior's
            lo = keys[-1]
            slope = times[lo] * PRIOR_SLOPE / _prior(lo)
            if len(keys) > 1 and not optimistic:
                slope = max(slope, (times[lo] - times[keys[-2]]) / (lo - keys[-2]))
            return times[lo] + slope * (n_tokens - lo)
        lo, hi = keys[at - 1], keys[at]
        return times[lo] + (times[hi] - times[lo]) * (n_tokens - lo) / (hi - lo)


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
    the text may have changed. (A free drafter is then only asked: its proposal is planned
    with the learnt rates, and its first token, if not verified, checked against the
    target's, which moves them: ``Engine._check_shadow``.)"""

    k_max: int
    rates: dict[int, float] = field(default_factory=dict)  # acceptance per token, by kind
    idle: int = 0  # steps in a row without drafting

    def rate(self, kind: int | None = None, probe: bool = True) -> float:
        """The acceptance rate to plan a draft of ``kind`` with (None: its best kind's; an
        unseen kind is tried as the best one); ``probe``: the prior's, when due."""
        if probe and self.idle >= PROBE_EVERY:
            return max([PRIOR, *self.rates.values()])
        best = max(self.rates.values(), default=PRIOR)
        return best if kind is None else self.rates.get(kind, best)

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
class SpecStats:
    """Counters of verified drafts (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verifications of a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFT_TOKENS + 1))

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def summary(self) -> str:
        mean = self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return (
            f"speculative: {self.num_accepted_tokens} of {self.num_draft_tokens} draft tokens "
            f"accepted ({100 * self.acceptance_rate:.1f} %), {self.num_drafts} drafts, "
            f"{mean:.2f} accepted per draft"
        )


# -- drafters -------------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None = None  # [len(tokens), V] the drafter drew them from; None: chosen
    kind: int = 0  # what acceptance rate it goes by (``DraftLength``)


class Drafter:
    """Proposes tokens to follow running sequences."""

    name = "drafter"
    cost = 0.0  # a pass's time as a share of a target step of as many tokens (the prior)
    free = False  # proposing costs nothing: every sequence is asked, its draft planned after

    def pass_time(self, n_seqs: int, target: StepCost) -> float:
        """The time of one drafting pass over ``n_seqs`` sequences, in ``target``'s units."""
        return self.cost * target(n_seqs)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ``ks[i]`` tokens to follow ``requests[i].token_ids``, for each request."""
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished: forget it."""


class NgramDrafter(Drafter):
    """Prompt lookup: the sequence's last n tokens (n from ``max_n`` down to 1) looked up in
    its own prompt and output; what followed their latest earlier occurrence is proposed.
    Each sequence keeps an index of its n-grams, extended as it grows."""

    name = "ngram"
    free = True

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._index: dict[str, tuple[list[dict[tuple[int, ...], int]], list[int]]] = {}

    def _lookup(self, rid: str, ids: list[int], k: int) -> Draft:
        maps, done = self._index.setdefault(rid, ([{} for _ in range(self.max_n)], [0]))
        for i in range(max(done[0], 1), len(ids)):  # the n-grams ending before token i
            for n in range(1, min(self.max_n, i) + 1):
                maps[n - 1][tuple(ids[i - n : i])] = i  # the latest occurrence wins
        done[0] = len(ids)
        for n in range(min(self.max_n, len(ids)), 0, -1):
            start = maps[n - 1].get(tuple(ids[-n:]))
            if start is not None:
                return Draft(ids[start : start + k], kind=n)
        return Draft([])

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        return [
            self._lookup(r.request_id, r.token_ids, k) if k else Draft([])
            for r, k in zip(requests, ks, strict=True)
        ]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def check_vocabularies(draft: LoadedModel, target: LoadedModel, tolerance: int = 128) -> None:
    """A draft model must speak the target's tokens: vocabulary sizes within ``tolerance``
    (padding rows) and the same text for every id both have; and it must be smaller."""
    dv, tv = draft.hparams.n_vocab, target.hparams.n_vocab
    where = f"draft model {draft.path.name} for {target.path.name}"
    if abs(dv - tv) > tolerance:
        raise InvalidRequest(f"{where}: vocabularies of {dv} and {tv} tokens differ")
    dt, tt = draft.tokenizer, target.tokenizer
    for i in range(min(dt.vocab_size, tt.vocab_size)):
        if dt.id_to_token(i) != tt.id_to_token(i):
            raise InvalidRequest(
                f"{where}: token {i} is {dt.id_to_token(i)!r} in the draft but "
                f"{tt.id_to_token(i)!r} in the target (the vocabularies differ)"
            )
    if draft.n_params > target.n_params:
        raise InvalidRequest(
            f"{where}: the draft ({draft.n_params / 1e6:.0f} M parameters) is larger than "
            f"the target ({target.n_params / 1e6:.0f} M); a draft must be cheaper to run"
        )


class _RenamedLayers:
    """A model's weights seen by a graph of fewer layers: its ``blk.i`` is ``blk.keep[i]``."""

    def __init__(self, weights: object, keep: Sequence[int]):
        self._weights, self._keep = weights, list(keep)
        if hasattr(weights, "source"):
            self.source = lambda names: weights.source(tuple(map(self._name, names)))

    def _name(self, name: str) -> str:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        return f"blk.{self._keep[int(m[1])]}.{m[2]}" if m else name

    def raw(self, name: str) -> np.ndarray:
        return self._weights.raw(self._name(name))

    def tensor_type(self, name: str) -> int:
        return self._weights.tensor_type(self._name(name))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._weights.tensor_shape(self._name(name))

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self._weights.read_rows(self._name(name), ids)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        self._weights.release(self._name(name), rows)


def skipped_layers_graph(model: LoadedModel, keep: Sequence[int]) -> tuple[Graph, HParams]:
    """``model``'s forward pass through its layers ``keep`` only (a layer-skipping draft)."""
    from dynalm.ir.passes import optimize
    from dynalm.models.arch import build_graph, tensor_types

    hp, keep = model.hparams, list(keep)
    if not keep or sorted(set(keep)) != keep or keep[-1] >= hp.n_layers:
        raise InvalidRequest(f"layers to keep must be increasing ids below {hp.n_layers}")
    meta = dict(model.gguf.metadata)
    meta[f"{hp.arch}.block_count"] = len(keep)
    for key, value in meta.items():  # per-layer metadata follows its layers
        if isinstance(value, list) and len(value) == hp.n_layers and key.startswith(hp.arch):
            meta[key] = [value[i] for i in keep]
    types = {}
    for name, t in tensor_types(model.gguf).items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None:
            types[name] = t
        elif int(m[1]) in keep:
            types[f"blk.{keep.index(int(m[1]))}.{m[2]}"] = t
    graph = optimize(build_graph(hp.arch, meta, types))
    return graph, dataclasses.replace(hp, n_layers=len(keep))


class ModelDrafter(Drafter):
    """Drafts greedily with a model graph of the target's vocabulary, run as the engine runs
    its own: an executor over a paged KV pool, one sequence per request that follows the
    target's tokens (after a rejection it rolls back to the tokens they share), each pass
    of the draft model one flat batch of every drafting sequence."""

    def __init__(
        self,
        name: str,
        graph: Graph,
        weights: object,
        hp: HParams,
        device: Device,
        *,
        cost: float,
        n_vocab: int,
        ctx: int,
        max_num_seqs: int,
        max_tokens: int = 512,
        page_size: int = 16,
    ):
        from dynalm.runtime.engine.engine import EngineConfig
        from dynalm.runtime.engine.memory_plan import kv_pool_size

        self.name, self.cost, self.n_vocab = name, cost, n_vocab
        # sized as the engine sizes its own f16 pool for the same contexts
        config = EngineConfig(ctx=ctx, max_num_seqs=max_num_seqs, page_size=page_size)
        n_tokens, _ = kv_pool_size(hp, config)
        self.pool = PagePool(
            hp.n_layers,
            hp.n_kv_heads,
            hp.head_dim,
            -(-n_tokens // page_size),
            page_size,
            device=device,
        )
        self.kv = KVCacheManager(self.pool, RadixCache(self.pool, enabled=False))
        self.executor = Executor(graph, device, weights, max_tokens=max_tokens)
        self.max_tokens = max_tokens
        self._seqs: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # tokens each sequence shares with its target
        self.steps = StepCost()  # its passes' times, measured

    def pass_time(self, n_seqs: int, target: StepCost) -> float:
        if self.steps.measured and target.measured:  # both in seconds
            return self.steps(n_seqs)
        return super().pass_time(n_seqs, target)

    @classmethod
    def for_model(
        cls, draft: LoadedModel, target: LoadedModel, device: Device, **config: int
    ) -> ModelDrafter:
        """``draft`` drafting for ``target`` (checked: same vocabulary, smaller)."""
        check_vocabularies(draft, target)
        return cls(
            draft.name,
            draft.graph,
            draft.weights,
            draft.hparams,
            device,
            cost=draft.gguf.path.stat().st_size / target.gguf.path.stat().st_size,
            n_vocab=target.hparams.n_vocab,
            **config,
        )

    @classmethod
    def layer_skip(
        cls,
        target: LoadedModel,
        device: Device,
        keep: Sequence[int] | None = None,
        **config: int,
    ) -> ModelDrafter:
        """The target with some layers skipped as its own draft; by default it skips the
        middle eighth of its layers (SmolLM2-135M, 30 layers: skipping 2 middle ones kept
        ~27 % of drafts, every third one none; deep models tolerate more)."""
        n = target.hparams.n_layers
        if keep is None:
            lo = (n - n // 8) // 2
            keep = [i for i in range(n) if not lo <= i < lo + n // 8]
        graph, hp = skipped_layers_graph(target, keep)
        weights = _RenamedLayers(target.weights, keep)
        name = f"{target.name} on {len(keep)} of {n} layers"
        return cls(
            name, graph, weights, hp, device, cost=len(keep) / n, n_vocab=target.hparams.n_vocab,
            **config,
        )  # fmt: skip

    def _follow(self, req: Request) -> Request:
        """The draft sequence of ``req``, rolled back to the tokens it shares with it."""
        rid = req.request_id
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = Request(rid, [], 0)
            self._synced[rid] = 0
        same, mine = self._synced[rid], seq.token_ids
        while same < min(len(mine), req.num_tokens) and mine[same] == req.token_ids[same]:
            same += 1
        if same < seq.num_computed_tokens:
            self.kv.rollback(seq, same)
        del mine[same:]
        mine += req.token_ids[same:]
        self._synced[rid] = req.num_tokens
        return seq

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        want = {i: k for i, k in enumerate(ks) if k}
        seqs = {i: self._follow(requests[i]) for i in want}
        while want:
            budget, chunks, owners = self.max_tokens, [], []
            for i in list(want):
                seq = seqs[i]
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 0:
                    break
                if not self.kv.allocate(seq, seq.num_computed_tokens + n):
                    del want[i]  # the draft pool is full: this one goes without a draft
                    self.release(seq.request_id)
                    continue
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                owners.append(i)
                budget -= n
            if not chunks:
                break
            from dynalm.runtime.engine.engine import flat_batch

            t0, setup = time.perf_counter(), self.executor.setup_seconds
            tokens, positions, batch = flat_batch(self.pool, chunks)
            ends = batch.query_start[1:] - 1
            sampling = [j for j, c in enumerate(chunks) if c.samples]
            logits = self.executor.run(tokens, positions, ends[sampling], batch)
            best = logits.argmax(axis=1).tolist()
            setup = self.executor.setup_seconds - setup  # (compiling a new shape)
            self.steps.record(len(tokens), time.perf_counter() - t0 - setup)
            for chunk in chunks:
                chunk.request.num_computed_tokens = chunk.start + chunk.n
            for row, j in enumerate(sampling):
                i, token = owners[j], best[row]
                if token >= self.n_vocab:  # a padding row of a larger draft vocabulary
                    del want[i]
                    continue
                seqs[i].token_ids.append(token)
                drafts[i].tokens.append(token)
                want[i] -= 1
                if not want[i]:
                    del want[i]
        return drafts

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._synced.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)


DRAFTERS = ("ngram", "layer-skip")


def build_drafter(
    speculative: str | None,
    draft: LoadedModel | None,
    target: LoadedModel,
    device: Device,
    *,
    ctx: int,
    max_num_seqs: int,
    num_draft_tokens: int,
) -> Drafter | None:
    """The drafter of ``--speculative`` (ngram | layer-skip) or ``--draft`` (a model)."""
    check_num_draft_tokens(num_draft_tokens)
    if speculative is not None and draft is not None:
        raise InvalidRequest("--draft and --speculative exclude each other: choose one drafter")
    if speculative not in (None, *DRAFTERS):
        raise InvalidRequest(
            f"--speculative {speculative!r}: choose from {', '.join(DRAFTERS)} (or --draft MODEL)"
        )
    config = {"ctx": ctx, "max_num_seqs": max_num_seqs}
    if draft is not None:
        return ModelDrafter.for_model(draft, target, device, **config)
    if speculative == "ngram":
        return NgramDrafter()
    if speculative == "layer-skip":
        return ModelDrafter.layer_skip(target, device, **config)
    return None
