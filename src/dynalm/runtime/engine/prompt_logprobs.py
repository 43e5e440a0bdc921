"""Log-probabilities of a prompt's own tokens: OpenAI's ``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``, and ``dynalm perplexity``.

The logits at position ``i`` score token ``i + 1``. A request that wants its prompt scored
from token ``k`` on (`Request.scored_until` = ``k`` at first) has the logits of positions
``k - 1`` ... ``len(prompt) - 2`` computed alongside its step's sampling rows, chunk by
chunk, and it takes from the prefix cache only what precedes them (`KVCacheManager.match`),
since a cached position yields no logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dynalm.errors import NonFiniteLogits
from dynalm.runtime.engine.scheduler import Request, ScheduledChunk


@dataclass
class ScoredLogprob:
    """A prompt token's log-probability, its rank in the distribution (1 = the most likely)
    and the ``top`` most likely tokens, from the raw logits (no penalties, temperature 1)."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass
class PromptRows:
    """The rows of a step's flat batch whose logits score prompt tokens, and whose they are:
    per request, the index of the first prompt token its rows score and how many."""

    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    spans: list[tuple[Request, int, int]] = field(default_factory=list)


def prompt_rows(chunks: Sequence[ScheduledChunk], query_start: np.ndarray) -> PromptRows:
    """The flat-batch rows of ``chunks`` that score prompt tokens not scored yet."""
    rows, spans = [], []
    for chunk, first_row in zip(chunks, query_start, strict=False):
        req = chunk.request
        if req.scored_until is None:  # most requests: a test per chunk and step
            continue
        begin = max(chunk.start, req.scored_until - 1)
        end = min(chunk.start + chunk.n, len(req.prompt_ids) - 1)
        if begin < end:
            rows.append(np.arange(begin, end, dtype=np.int64) - chunk.start + first_row)
            spans.append((req, begin + 1, end - begin))
    return PromptRows(np.concatenate(rows), spans) if rows else PromptRows()


def score_rows(logits: np.ndarray, targets: Sequence[int], top: int) -> list[ScoredLogprob]:
    """The log-probability of ``targets[i]`` under row ``i`` of ``logits``, with its rank and
    the ``top`` best tokens. Row by row: the exponentials stay in float32 (a row's worth),
    summed in float64."""
    out = []
    for row, target in zip(logits, targets, strict=True):
        best = float(row.max())
        if not math.isfinite(best):
            raise NonFiniteLogits("the model produced logits that are not finite (NaN or inf)")
        log_norm = best + math.log(float(np.exp(row - best).sum(dtype=np.float64)))
        value = row[target]
        rank = int(np.count_nonzero(row > value)) + 1
        alternatives: list[tuple[int, float]] = []
        if top:
            best_ids = np.argpartition(-row, top - 1)[:top]
            best_ids = best_ids[np.argsort(-row[best_ids], kind="stable")]
            alternatives = [(int(t), float(row[t]) - log_norm) for t in best_ids]
        out.append(ScoredLogprob(int(target), float(value) - log_norm, rank, alternatives))
    return out
