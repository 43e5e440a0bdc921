"""Constrained decoding with llguidance: grammars checked against the model's vocabulary,
a matcher per sequence, and the token masks of a step applied to its rows of logits.

A grammar is llguidance's own JSON form (`llguidance.grammar_from` makes it from a JSON
schema, a regex, a list of choices or a Lark grammar). `GrammarCompiler.compile` checks it
once per request (a grammar llguidance rejects is an `InvalidRequest` naming the problem)
and returns a `Guide`; each sequence of the request gets its own copy. The engine asks
`MaskWorker` for the masks of a step's guided sequences before it runs the model, so
llguidance computes them on its own thread while the model's kernels run, then bans each
guided row's disallowed tokens (-inf) before the sampler sees it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from dynalm.errors import InvalidRequest
from dynalm.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where used: `dynalm run` without a schema never needs it
    import llguidance

log = logging.getLogger(__name__)

# Grammar size and per-step work are bounded (a hostile schema cannot stall the engine):
# llguidance's defaults, with its error messages kept short (no parser state dumped).
_LIMITS = dict(verbose_errors=False)


class _VocabularyView:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer: each id's bytes, the special
    ids and an encoder (the GGUF vocabulary has no tokenizer.json of its own)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer
        self._byte_ids: dict[int, int] = {}  # a token of each single byte
        for i, data in enumerate(self.tokens):
            if len(data) == 1:
                self._byte_ids.setdefault(data[0], i)

    def __call__(self, text: str) -> list[int]:
        ids = self._tokenizer.encode_continuation(text)
        data = text.encode()
        if b"".join(self.tokens[i] for i in ids) == data or not set(data) <= self._byte_ids.keys():
            return ids
        # The ids spell other bytes than the text: a sentencepiece space falls back to the
        # bytes of "▁" where the vocabulary has no "▁" piece. Spell the text byte by byte.
        return [self._byte_ids[b] for b in data]


class Guide:
    """One sequence's place in its grammar: which tokens may come next, and when it is done.
    ``what`` names the grammar's source (a request field, a flag) for error messages;
    ``grammar`` is that source (plain text: what a cluster's ingress ships to the replica,
    which compiles its own guide)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, what: str = "the grammar", grammar: str = ""
    ) -> None:
        self.matcher = matcher
        self.what = what
        self.grammar = grammar

    def copy(self) -> Guide:
        return Guide(self.matcher.deep_copy(), self.what, self.grammar)

    def consume(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed). A matcher that fails (over
        llguidance's limits) stops: `failure` then says why."""
        if not self.matcher.consume_token(token):
            log.info("grammar stopped at token %d: %s", token, self.matcher.get_error())

    @property
    def done(self) -> bool:
        """Whether the grammar is complete: nothing may follow (an end token was taken)."""
        return self.matcher.is_stopped()

    def failure(self, ending: bool) -> InvalidRequest | None:
        """Why the output so far cannot be answered as matching its grammar: llguidance gave
        up (a limit hit; its mask then allows only end tokens, and the model would stop with
        invalid text), or the answer ``ending`` here is incomplete. None if it is fine."""
        if self.matcher.is_error():
            why = _one_line(self.matcher.get_error())
            return InvalidRequest(f"{self.what}: the grammar engine gave up on it ({why})")
        if ending and not (self.matcher.is_accepting() or self.matcher.is_stopped()):
            return InvalidRequest(f"{self.what}: the answer ended before it matched the grammar")
        return None


class GrammarCompiler:
    """Grammars for one model's vocabulary. Reading the vocabulary into llguidance takes
    ~0.2 s for 49k tokens, so it happens at the first constrained request."""

    def __init__(self, tokenizer: Tokenizer, end_ids: frozenset[int], n_vocab: int) -> None:
        self._source = tokenizer
        self._n_vocab = max(n_vocab, tokenizer.vocab_size)  # the logits' width
        self._end_ids = sorted(end_ids) or [tokenizer.eos_id or 0]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                wrapper = llguidance.TokenizerWrapper(_VocabularyView(self._source))
                self._tokenizer = llguidance.LLTokenizer(
                    wrapper, n_vocab=self._n_vocab, eos_token=self._end_ids
                )
            return self._tokenizer

    def compile(self, grammar: str, what: str = "the grammar") -> Guide:
        """A guide at the start of ``grammar``; `InvalidRequest` if llguidance rejects it."""
        import llguidance
        import llguidance.numpy

        limits = llguidance.LLParserLimits(**_LIMITS)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            # the first mask: grammars that can never produce a token (a $ref loop) fail
            # here, before generation, instead of ending the answer empty
            mask = llguidance.numpy.allocate_token_bitmask(1, self._n_vocab)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            raise InvalidRequest(f"{what} cannot be used: {_one_line(matcher.get_error())}")
        return Guide(matcher, what, grammar)


_SOURCE_ECHO = re.compile(r"\s*(\d+\s*\|.*|[\^~]+|\|)\s*")  # llguidance's quote of the source


def _one_line(message: str, limit: int = 500) -> str:
    """llguidance's error as one line: its lines joined, the quoted source left out."""
    lines = [ln.strip() for ln in message.splitlines()]
    text = " ".join(ln for ln in lines if ln and not _SOURCE_ECHO.fullmatch(ln))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MaskWorker:
    """Computes a step's token masks on a thread of its own (llguidance releases the GIL),
    so the work overlaps the model's forward pass."""

    def __init__(self, n_vocab: int) -> None:
        import llguidance

        self.n_vocab = n_vocab
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynalm-masks")
        self._executor = llguidance.LLExecutor()

    def start(self, guides: Sequence[Guide]) -> Future[np.ndarray]:
        """The masks of ``guides`` (one bit per token, a row each), computed in the background."""
        return self._thread.submit(self._compute, list(guides))

    def _compute(self, guides: list[Guide]) -> np.ndarray:
        import llguidance.numpy

        masks = llguidance.numpy.allocate_token_bitmask(len(guides), self.n_vocab)
        pairs = [(g.matcher, i) for i, g in enumerate(guides)]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, masks)
        return masks


def apply_masks(logits: np.ndarray, rows: Sequence[int], masks: np.ndarray) -> None:
    """Set the logits of the tokens each mask bans to -inf, in place (``rows[i]`` is the
    row of logits that ``masks[i]`` constrains)."""
    n_vocab = logits.shape[1]
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, count=n_vocab, bitorder="little")
    for mask_row, row in enumerate(rows):
        np.copyto(logits[row], -np.inf, where=allowed[mask_row] == 0)
