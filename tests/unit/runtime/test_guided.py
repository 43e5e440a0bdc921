"""Token masks without a model: llguidance over a byte vocabulary, masks applied to rows of
logits exactly as llguidance's own reference applies them, and a guide that ends."""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from dynalm.runtime.engine.guided import Guide, MaskWorker, apply_masks


def byte_guide(regex: str) -> tuple[llguidance.LLTokenizer, Guide]:
    tokenizer = llguidance.LLTokenizer("byte")  # one token per byte, 256 + specials
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    return tokenizer, Guide(llguidance.LLMatcher(tokenizer, grammar, log_level=0))


def test_masks_match_llguidance_reference_on_the_constrained_rows_only() -> None:
    tokenizer, guide = byte_guide("(yes|no)")
    other = guide.copy()
    other.consume(tokenizer.tokenize_str("n")[0])
    n_vocab = tokenizer.vocab_size
    masks = MaskWorker(n_vocab).start([guide, other]).result()
    logits = np.random.default_rng(1).normal(size=(3, n_vocab)).astype(np.float32)
    free_row = logits[1].copy()
    reference = logits[[0, 2]].copy()
    llguidance.numpy.apply_token_bitmask_inplace(reference, masks)
    apply_masks(logits, [0, 2], masks)
    np.testing.assert_array_equal(logits[[0, 2]], reference)
    np.testing.assert_array_equal(logits[1], free_row)  # the unconstrained row untouched
    allowed = [tokenizer.decode_str([int(t)]) for t in np.flatnonzero(np.isfinite(logits[0]))]
    assert sorted(allowed) == ["n", "y"]
    assert [tokenizer.decode_str([int(t)]) for t in np.flatnonzero(np.isfinite(logits[2]))] == ["o"]


def test_a_guide_is_done_after_its_end_token() -> None:
    tokenizer, guide = byte_guide("ok")
    for token in tokenizer.tokenize_str("ok"):
        assert not guide.done
        guide.consume(token)
    guide.consume(tokenizer.eos_token)
    assert guide.done


def test_a_refused_token_stops_the_guide_instead_of_failing_the_step() -> None:
    tokenizer, guide = byte_guide("ab")
    guide.consume(tokenizer.tokenize_str("x")[0])
    assert guide.done
    assert "gave up" in str(guide.failure(ending=True))  # never an answer that "stopped"


def test_failure_names_the_grammar_and_why() -> None:
    tokenizer = llguidance.LLTokenizer("byte")
    options = json.dumps([f"opt{i}" for i in range(10_000)])  # over the parser's row limit
    grammar = llguidance.grammar_from("choice", options)
    guide = Guide(llguidance.LLMatcher(tokenizer, grammar, log_level=0), "guided_choice")
    assert guide.failure(ending=False) is None
    guide.consume(tokenizer.tokenize_str("o")[0])
    failed = guide.failure(ending=False)
    assert str(failed).startswith("guided_choice: the grammar engine gave up on it (Parser Error")
    assert "\n" not in str(failed)
    tokenizer, guide = byte_guide("abc")
    guide.consume(tokenizer.tokenize_str("a")[0])
    assert guide.failure(ending=False) is None  # on its way
    assert "ended before it matched" in str(guide.failure(ending=True))  # cut short
    for token in tokenizer.tokenize_str("bc"):
        guide.consume(token)
    assert guide.failure(ending=True) is None
