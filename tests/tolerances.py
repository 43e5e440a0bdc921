"""Error budgets derived from fp32 arithmetic, for tests that compare two computations of
the same values: numpy (OpenBLAS, whose kernels differ per CPU: AVX2, AVX-512, AMX) against
the JIT kernels, or fp32 against an fp64 reference. None of them is tuned to one machine.

A sum of n fp32 terms, added in any order, lies within ``lam * sqrt(n) * u * sum(|terms|)``
of the exact sum with probability at least ``1 - 2 * exp(-lam**2 / 2)`` (rounding errors
modelled as independent and of mean zero: Higham & Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019). ``LAMBDA`` = 8 puts a failure
at ~1e-14 per value: the bound holds on any host and any summation order, while a wrong
result (a dropped block, a wrong scale, a missing epsilon) misses it by orders of magnitude.

A network of ``n_layers`` blocks adds such an error, relative to the magnitudes it carries,
in every block; in the residual stream they add up as a random walk. So two fp32 forward
passes of one model differ per logit by about ``sqrt(n_layers * k_max) * u`` times the
logits' scale, ``k_max`` the longest summation of a block (the FFN's inner dimension). The
scale is a position's largest |logit|: a logit's error follows |W_j| |h| of the head's row
and the hidden state, not the logit itself, and a random-weight model amplifies rounding
more than a trained one (tiny llama: 3e-5 of the rms logit, 1.03 of an rms-based bound).
"""

from __future__ import annotations

import math

import numpy as np

U = 2.0**-24  # fp32 unit roundoff
LAMBDA = 8.0


def sum_bound(n: int, magnitude: float | np.ndarray) -> float | np.ndarray:
    """Largest error of an fp32 sum of ``n`` terms whose absolute values sum to
    ``magnitude``, against the exact sum."""
    return LAMBDA * math.sqrt(n) * U * magnitude


def forward_bound(n_layers: int, k_max: int, scale: float | np.ndarray) -> float | np.ndarray:
    """Largest difference between two fp32 forward passes of one network (each its own
    summation orders), per output of typical magnitude ``scale``: each pass within
    ``sum_bound(n_layers * k_max, scale)`` of the exact one."""
    return 2 * sum_bound(n_layers * k_max, scale)


def logit_scale(logits: np.ndarray) -> np.ndarray:
    """Per position (row), the largest |logit|: the scale `forward_bound` is relative to."""
    return np.abs(logits).max(axis=-1, keepdims=True)
