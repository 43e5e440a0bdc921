"""``dynalm perplexity``: perplexity of a model over a text, by llama-perplexity's method.

The text is tokenised once and cut into windows of ``ctx`` tokens (what is left over is
not scored); a model that starts sequences with BOS gets it as each window's first token.
In each window only the second half is scored (tokens ``ctx/2 + 1`` ... ``ctx - 1``), so
every scored token sees at least ``ctx/2`` tokens of context. The windows run through the
engine as requests with prompt log-probs (`runtime.prompt_logprobs`), batched as the
server batches requests. PPL = exp(mean NLL); its standard error is llama-perplexity's:
``PPL * sqrt(var(NLL) / (N - 1))``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynalm.errors import InvalidRequest
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams

_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, repeat_penalty=1.0)


@dataclass
class Perplexity:
    ppl: float
    stderr: float  # of the PPL estimate
    scored_tokens: int
    windows: int
    ctx: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokens run through the model (whole windows) per second."""
        return self.windows * self.ctx / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (
            f"PPL = {self.ppl:.4f} +/- {self.stderr:.4f} over {self.scored_tokens} tokens "
            f"({self.windows} windows of {self.ctx}), {self.tokens_per_second:.1f} tokens/s"
        )


def windows(ids: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """Consecutive windows of ``ctx`` tokens; the first token of each is BOS if given."""
    if ctx < 4:
        raise InvalidRequest(f"--ctx must be at least 4 to score half a window, got {ctx}")
    if len(ids) < ctx:
        raise InvalidRequest(
            f"the text has {len(ids)} tokens, fewer than one window of --ctx {ctx}; "
            "give a longer text or a smaller --ctx"
        )
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if bos_id is not None:
        for window in out:
            window[0] = bos_id
    return out


def perplexity(
    engine: Engine,
    ids: list[int],
    ctx: int,
    bos_id: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Perplexity:
    """Score ``ids`` in windows of ``ctx`` tokens; ``engine`` needs a context over ``ctx``.
    ``progress`` is called with the number of windows scored so far."""
    todo = windows(ids, ctx, bos_id)
    first = ctx // 2 + 1  # the first token of a window that is scored
    nll: list[float] = []
    in_flight, done, next_window = set(), 0, 0
    # as many at once as can run together: more would only wait in the engine's queue
    batch = engine.config.max_num_seqs
    t0 = time.perf_counter()
    while done < len(todo):
        while next_window < len(todo) and len(in_flight) < batch:
            rid = f"ppl-{next_window}"
            engine.add_request(
                rid,
                todo[next_window],
                _ONE_TOKEN,
                stop_ids=frozenset(),
                prompt_logprobs=0,
                prompt_logprobs_from=first,
            )
            in_flight.add(rid)
            next_window += 1
        for out in engine.step():
            if out.prompt_logprobs is not None:
                nll += [-lp.logprob for lp in out.prompt_logprobs]
            if out.finished:
                in_flight.discard(out.request_id)
                done += 1
                if progress is not None:
                    progress(done)
    seconds = time.perf_counter() - t0
    values = np.array(nll, np.float64)
    mean = float(values.mean())
    ppl = math.exp(mean)
    variance = max(0.0, float((values**2).mean()) - mean * mean)
    stderr = ppl * math.sqrt(variance / (len(values) - 1)) if len(values) > 1 else math.nan
    return Perplexity(ppl, stderr, len(values), len(todo), ctx, seconds)
