"""``/v1/completions``'s log-probs on the wire: OpenAI's legacy ``logprobs`` (of the answer,
and with ``echo`` of the prompt ahead of it, its first token null) and vLLM's
``prompt_logprobs`` (per prompt token, a dict by token id of logprob, rank and text)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynalm.models.tokenizer import StreamDecoder, Tokenizer
from dynalm.runtime.engine.engine import TokenLogprob
from dynalm.runtime.engine.prompt_logprobs import ScoredLogprob
from dynalm.runtime.serve import protocol as p


@dataclass
class PromptEcho:
    """What a completion request asked to see of its prompts."""

    texts: list[str] | None  # echo: each prompt's text, put before its answers
    echo_top: int | None  # echo with logprobs: alternatives per token (None: no log-probs)
    vllm_top: int | None  # prompt_logprobs: alternatives per token (None: not asked)

    def text(self, prompt: int) -> str:
        return self.texts[prompt] if self.texts is not None else ""

    def logprobs(
        self,
        tokenizer: Tokenizer,
        prompt: int,
        prompt_ids: Sequence[int],
        scored: Sequence[ScoredLogprob],
    ) -> p.CompletionLogprobs | None:
        """The prompt's part of OpenAI's ``logprobs`` (echo with logprobs), else None."""
        if self.texts is None or self.echo_top is None:
            return None
        echoed = self.text(prompt)
        decoder = StreamDecoder(tokenizer)  # one over the whole prompt, its first token too
        first = decoder.push(prompt_ids[0])
        head = p.CompletionLogprobs(
            tokens=[_text(tokenizer, prompt_ids[0])],
            token_logprobs=[None],
            top_logprobs=[None],
            text_offset=[0],
        )
        start = min(len(first), len(echoed))
        rest = legacy_logprobs(tokenizer, scored, start, len(echoed), self.echo_top, decoder)
        return joined(head, rest)

    def vllm(
        self, tokenizer: Tokenizer, scored: Sequence[ScoredLogprob]
    ) -> list[dict[str, p.PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: null for the first token, then for each its own entry
        and the ``vllm_top`` most likely tokens'."""
        if self.vllm_top is None:
            return None
        out: list[dict[str, p.PromptLogprob] | None] = [None]
        for lp in scored:
            entry = {
                str(t): p.PromptLogprob(logprob=v, rank=r, decoded_token=_text(tokenizer, t))
                for r, (t, v) in enumerate(lp.top_logprobs[: self.vllm_top], start=1)
            }
            entry[str(lp.token_id)] = p.PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=_text(tokenizer, lp.token_id)
            )
            out.append(entry)
        return out


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def legacy_logprobs(
    tokenizer: Tokenizer,
    lps: Sequence[TokenLogprob | ScoredLogprob],
    offset: int,
    end: int,
    top: int | None = None,
    decoder: StreamDecoder | None = None,
) -> p.CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` of tokens whose text is the choice's text from ``offset``
    to ``end``, with at most ``top`` alternatives each.

    Each token's ``text_offset`` is where its characters start in that text, counted as the
    text is decoded (a token of part of a UTF-8 character adds none, a special token none),
    not by the length of its own piece (one U+FFFD per partial byte, a control token's
    name): so the offsets never go backwards, and stay within ``offset..end``. ``decoder``:
    one that has decoded the tokens before these."""
    out = p.CompletionLogprobs()
    decoder = decoder or StreamDecoder(tokenizer)
    at = offset
    for lp in lps:
        out.tokens.append(_text(tokenizer, lp.token_id))
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_text(tokenizer, t): v for t, v in lp.top_logprobs[:top]})
        out.text_offset.append(min(at, end))
        at += len(decoder.push(lp.token_id))
    return out


def joined(
    first: p.CompletionLogprobs | None, then: p.CompletionLogprobs | None
) -> p.CompletionLogprobs | None:
    """One ``logprobs`` of the prompt's tokens followed by the answer's."""
    if first is None or then is None:
        return first or then
    return p.CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )
