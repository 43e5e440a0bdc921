"""Verification of draft tokens: what a request keeps of its draft, from the target's logits.

Greedy requests keep the longest prefix of the draft that matches the target's argmax, plus
the target's next token; sampled requests use the rejection rule of speculative sampling
(Leviathan et al. 2023, Chen et al. 2023) on the distribution the request's own sampler
draws from (penalties, logit bias, temperature, top-k/p, min-p applied), so their tokens
follow the target's distribution exactly. (vLLM v1's ``rejection_sampler``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynalm.runtime.engine.sampling import Sampler, _check


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
