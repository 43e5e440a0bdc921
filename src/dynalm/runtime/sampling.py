"""Sampling: turn one row of logits into the next token, and detect stop strings.

The order follows llama.cpp: penalties and logit bias on the raw logits, then
greedy (temperature 0) or top-k -> temperature -> top-p -> min-p -> draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dynalm.errors import InvalidRequest


@dataclass
class SamplingParams:
    max_tokens: int = 512
    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.9  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.1  # 1 = off (divides positive logits of recent tokens)
    repeat_last_n: int = 64  # window of recent tokens the penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self) -> SamplingParams:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidRequest(message)

        need(self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.repeat_penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        need(self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        need(
            -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        need(
            -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        return self


class Sampler:
    """Per-sequence sampler; a fixed seed gives the same tokens on every run."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def apply_penalties(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Penalised and biased logits as a float64 copy; ``logits`` itself when no penalty
        or bias applies."""
        p = self.params
        penalize = p.repeat_penalty != 1 or p.presence_penalty or p.frequency_penalty
        if not (penalize and p.repeat_last_n and len(history)) and not p.logit_bias:
            return logits  # nothing to change: no copy (a greedy decode step's common case)
        logits = logits.astype(np.float64)
        recent = np.asarray(history[-p.repeat_last_n :] if p.repeat_last_n else [], np.int64)
        if recent.size and penalize:
            ids, counts = np.unique(recent, return_counts=True)
            vals = logits[ids]
            logits[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        for token, bias in p.logit_bias.items():
            if 0 <= token < logits.size:
                logits[token] += bias
        return logits

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        return self.pick(self.apply_penalties(logits, history))

    def pick(self, logits: np.ndarray) -> int:
        """Draw the next token from already penalised logits."""
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        candidates = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            candidates = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        cand_logits = logits[candidates].astype(np.float64) / p.temperature
        order = np.argsort(-cand_logits, kind="stable")
        candidates, cand_logits = candidates[order], cand_logits[order]
        probs = np.exp(cand_logits - cand_logits[0])
        probs /= probs.sum()
        keep = probs.size
        if p.top_p < 1:  # smallest prefix whose mass reaches top_p
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(candidates[self.rng.choice(keep, p=probs)])


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        buf = self._held + text
        if not self.stops:
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
