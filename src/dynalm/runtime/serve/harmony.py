"""gpt-oss's "harmony" answers read back, as they stream.

A harmony turn is a run of messages, each ``[<|start|>assistant][ to=RECIPIENT]<|channel|>
CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY`` closed by ``<|end|>`` (more
messages follow), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call: the caller
answers). The chat template's generation prompt already wrote the first ``<|start|>assistant``.
Channels: ``analysis`` is reasoning, ``final`` the answer, ``commentary`` a tool call when it
names a recipient (``to=functions.NAME``) and otherwise text for the user (a preamble).

`HarmonyReader` turns the text (control tokens kept) into `Part` s: reasoning and content as
soon as they arrive, a message to a recipient whole when it closes. A tail that may be the
start of a control token is held until the next text decides it. Malformed text loses
nothing: a message cut off (no closing token) ends with the text, text outside any message
(no header) is content, and a header cut off before ``<|message|>`` is dropped (it is
structure, not text). Control tokens never reach a `Part`. A linear scan, no regex.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynalm.models.tokenizer import StreamDecoder, Tokenizer

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
# what ends a message's body: its closing tokens, or (where the decoder dropped <|end|>, or
# the model forgot it) the next message's header
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
_CLOSING = (END, CALL, RETURN)


@dataclass
class Part:
    """A piece of the answer: ``kind`` "reasoning" or "content" (text as it streams), or
    "message" (a message to ``recipient``, whole; ``closed``: it ended with a closing token
    rather than with the text)."""

    kind: str
    text: str
    recipient: str | None = None
    closed: bool = True


class HarmonyText:
    """An answer's token ids as harmony text, as they stream: the format's control tokens
    kept (the engine's own text drops every control token), any other (a stop token) dropped."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = StreamDecoder(tokenizer, skip_special=False)

    def push(self, ids: list[int]) -> str:
        tok = self._tokenizer
        kept = [i for i in ids if not tok.is_special(i) or tok.id_to_token(i) in MARKERS]
        return "".join(map(self._decoder.push, kept))

    def flush(self) -> str:
        return self._decoder.flush()


def _find_first(text: str, needles: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of ``needles`` starts in ``text``, and which: (-1, "") if none."""
    best, which = -1, ""
    for n in needles:
        i = text.find(n)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, n
    return best, which


def _held(text: str) -> int:
    """How many characters at the end of ``text`` may begin a control token."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


def _plain(text: str) -> str:
    """``text`` without control tokens (a stray one inside a body)."""
    for m in MARKERS:
        text = text.replace(m, "")
    return text


def _header(text: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header: the word after ``<|channel|>`` and the
    ``to=`` target wherever it stands (``assistant`` as a target means none)."""
    words = text.replace(START, " ").replace(CHANNEL, f" {CHANNEL}").replace(CONSTRAIN, " ")
    channel, recipient, after_channel = "", None, False
    for word in words.split():
        if word.startswith(CHANNEL):
            word, after_channel = word[len(CHANNEL) :], True
            if word:
                channel, after_channel = word, False
        elif after_channel:
            channel, after_channel = word, False
        if word.startswith("to="):
            recipient = word[3:] or None
    return channel, None if recipient == "assistant" else recipient


class HarmonyReader:
    """Reads one answer's harmony text incrementally: `push` text, then `finish`."""

    def __init__(self) -> None:
        self._pending = ""  # text not read yet
        self._in_body = False
        self._kind = ""  # of the open message: "reasoning", "content" or "message"
        self._recipient: str | None = None
        self._body: list[str] = []  # the open message's body (to a recipient: held whole)
        self._header = ""  # the header read so far

    def push(self, text: str) -> list[Part]:
        self._pending += text
        return self._read(final=False)

    def finish(self) -> list[Part]:
        """The end of the text: what was held, the open message."""
        return self._read(final=True)

    def _read(self, final: bool) -> list[Part]:
        parts: list[Part] = []
        while self._pending:
            if self._in_body:
                at, which = _find_first(self._pending, _BODY_ENDS)
                if at < 0:
                    keep = 0 if final else _held(self._pending)
                    self._text(parts, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._text(parts, self._pending[:at])
                self._close(parts, closed=True)
                self._pending = self._pending[at + (len(which) if which in _CLOSING else 0) :]
            else:
                at, which = _find_first(self._pending, (MESSAGE, *_CLOSING))
                if at < 0:
                    break
                head, self._pending = self._pending[:at], self._pending[at + len(which) :]
                self._header += head
                if which == MESSAGE:
                    self._open(*_header(self._header))
                else:  # closed before any <|message|>: text outside a message
                    self._outside(parts)
        if final:
            if self._in_body:
                self._close(parts, closed=False)
            else:
                self._header += self._pending
                self._pending = ""
                self._outside(parts)
        return parts

    def _open(self, channel: str, recipient: str | None) -> None:
        self._in_body, self._header, self._recipient = True, "", recipient
        if recipient is not None:
            self._kind = "message"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _text(self, parts: list[Part], text: str) -> None:
        text = _plain(text)
        if not text:
            return
        if self._kind == "message":
            self._body.append(text)
        elif parts and parts[-1].kind == self._kind:
            parts[-1].text += text
        else:
            parts.append(Part(self._kind, text))

    def _close(self, parts: list[Part], closed: bool) -> None:
        if self._kind == "message":
            parts.append(Part("message", "".join(self._body), self._recipient, closed))
        self._in_body, self._body = False, []

    def _outside(self, parts: list[Part]) -> None:
        """A header that never reached ``<|message|>``: plain text (a model that wrote no
        harmony) is content; a cut-off header is dropped."""
        if self._header and not any(m in self._header for m in MARKERS):
            parts.append(Part("content", self._header))
        self._header = ""
