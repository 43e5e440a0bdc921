"""The time of a model step by its token count, learnt online (``StepCost``): what draft
planning weighs a draft's expected gain against."""

from __future__ import annotations

import bisect

# The step-time curve's shape assumed before two sizes are measured, in one-token steps:
# 1 + 0.1 per further token. It is optimistic on purpose (SmolLM2-135M Q4_1, 2 threads:
# T = 8 costs 1.6x T = 1, T = 16 3.4x): a size thought too cheap is tried and then measured,
# a size thought too dear would never be tried, so never corrected.
PRIOR_SLOPE = 0.1
STEP_EWMA = 0.1  # weight of one measured step in its token count's time (steps are noisy)
# A token count's time not measured again in this many steps is forgotten, so a size that
# a stall or a busy machine made look dear is estimated from its neighbours and tried again.
STEP_STALE = 256


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
