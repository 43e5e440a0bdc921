"""Tokenizer built from GGUF metadata, on top of HF `tokenizers`.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), token
kinds, merges or scores and the special ids under llama.cpp's key names. We rebuild the equivalent
HF tokenizer from them, the way transformers' GGUF loader does, with the pre-tokenizer split that
llama.cpp picks from ``tokenizer.ggml.pre``:

* ``gpt2``: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM ...).
* ``bert``: WordPiece (BERT encoders), from llama.cpp's spelling of the vocabulary (a word's
  first piece starts with "▁", a continuation has no "##"), lower-cased as BERT's uncased
  models are, with ``[CLS]`` before and ``[SEP]`` after the text.
* ``llama``: sentencepiece BPE with byte fallback (``<0x..>`` tokens), spaces written as "▁" and
  an optional "▁" prefix; merges come from the file or are recovered from the token scores.

Control, user-defined and unknown tokens are matched whole in the input text, so a prompt holding
``<|im_start|>`` gets that single id. `StreamDecoder` turns ids into text one token at a time.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from array import array
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dynalm.errors import InvalidRequest, ModelFormatError, ModelNotFound, UnsupportedModel, show
from dynalm.files import read_source
from dynalm.models.hparams import MAX_VOCAB
from dynalm.models.metadata import bad, flag, integer, numbers, strings, text

log = logging.getLogger(__name__)

# llama.cpp token kinds (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")

# tokenizer.ggml.pre -> the regexes llama.cpp splits with, applied one after the other
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (r"\p{N}", _GPT2_SPLIT),
    ),
    **dict.fromkeys(_LLAMA3_PRES, (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}

# Tokens that end a turn in common templates; llama.cpp treats them as end-of-generation too.
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# tokenizer.json: 2-35 MB for real vocabularies (Gemma 3's 262k tokens: 33 MB); a file
# past this is refused by its size before the tokenizer library parses (or aborts on) it
MAX_TOKENIZER_JSON_BYTES = 128 << 20


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print stand for themselves)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover sentencepiece BPE merges: every split of a token into two tokens, best score first.

    Same order as transformers' ``generate_merges`` (so ids match its GGUF tokenizer): pairs of one
    token by (left id, right id), then a stable sort by (score, len(left), len(right)), descending.
    Pairs are kept as ids and the merges refer to the vocabulary's own strings: a 262k vocabulary
    has ~750k merges, which as sort keys and sliced strings peaked at 330 MB.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    left, right, score = array("q"), array("q"), array("d")
    for tok, tok_score in score_of.items():
        pairs = sorted(
            (vocab[a], vocab[b])
            for k in range(1, len(tok))
            if (a := tok[:k]) in vocab and (b := tok[k:]) in vocab
        )
        for a, b in pairs:
            left.append(a)
            right.append(b)
            score.append(tok_score)
    lefts, rights = np.frombuffer(left, np.int64), np.frombuffer(right, np.int64)
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    # lexsort is stable, its last key the primary one: descending by negating each key
    order = np.lexsort((-lengths[rights], -lengths[lefts], -np.frombuffer(score, np.float64)))
    pairs = zip(lefts[order].tolist(), rights[order].tolist(), strict=True)
    return [(tokens[a], tokens[b]) for a, b in pairs]


def _token_id(metadata: dict, name: str, n_tokens: int) -> int | None:
    """``tokenizer.ggml.{name}_token_id``: an id of the vocabulary, or None when absent."""
    return integer(metadata, f"tokenizer.ggml.{name}_token_id", None, hi=n_tokens - 1)


def _first(*ids: int | None) -> int | None:
    return next((i for i in ids if i is not None), None)


def _wordpiece(tokens: list[str], types: list[int]) -> HFTokenizer:
    """BERT's WordPiece from a vocabulary as llama.cpp's converter writes it (``phantom``:
    control tokens kept, a continuation's "##" dropped, "▁" before every other token; an
    unknown token is read as it is too, with or without its "▁")."""
    vocab: dict[str, int] = {}
    unk = "[UNK]"
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty == _CONTROL or (ty == _UNKNOWN and not tok.startswith("▁")):
            piece = tok
        else:
            piece = tok[1:] if tok.startswith("▁") else "##" + tok
        vocab.setdefault(piece, i)
        if ty == _UNKNOWN:
            unk = piece
    if unk not in vocab:
        raise ModelFormatError(
            f"the WordPiece vocabulary has no unknown token ({show(unk)} is no token and no "
            "token is of type unknown)"
        )
    hf = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    return hf


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]] | None, pre: str
) -> HFTokenizer:
    """GPT-2 style byte-level BPE, split first by the regexes llama.cpp uses for ``pre``."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # a normal token written with characters outside the byte alphabet is respelled (as HF does)
    vocab = {
        tok
        if ty != _NORMAL or set(tok) <= spelled
        else "".join(alphabet[b] for b in tok.encode()): i
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
    }
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 split", pre)
        splits = _PRE_SPLITS["default"]
    hf = HFTokenizer(
        models.BPE(vocab, merges or [], fuse_unk=False, ignore_merges=pre in _LLAMA3_PRES)
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(
    tokens: list[str], merges: list[tuple[str, str]] | None, metadata: dict, space_prefix: bool
) -> HFTokenizer:
    """Sentencepiece BPE with byte fallback, "▁" for spaces (as transformers' LlamaTokenizer)."""
    if merges is None:
        scores = numbers(metadata, "tokenizer.ggml.scores", len(tokens))
        scores = [0.0] * len(tokens) if scores is None else [float(s) for s in scores]
        merges = _merges_from_scores(tokens, scores)
    unk_id = _token_id(metadata, "unknown", len(tokens))
    hf = HFTokenizer(
        models.BPE(
            {tok: i for i, tok in enumerate(tokens)},
            merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(steps)
    return hf


# What json.loads may build of a tokenizer.json, counted before it runs (a 128 MiB file of
# "a b" merges is 22M strings: ~1.4 GB). Every JSON value but the first follows a ',', ':'
# or '[', counted anywhere (inside strings too: an upper bound, C speed). A tokenizer for an
# embedding of n rows holds at most n model.vocab entries (a key and an id: 2 separators; a
# Unigram [piece, score]: 3) and n added_tokens (7 keys: 14), so 18 a row; up to MAX_VOCAB
# model.merges (["a", "b"]: 3 each); and its normalizer, pre-tokenizer, post-processor and
# decoder (SmolLM2's: 245,939 in all for 49,152 rows, 48,900 merges; the bound: 7.2M). At the
# bound json.loads grows by ~0.5 GB (7.2M short strings or pairs: measured), ~0.8 GB for
# Gemma 3's 262k rows: a 128 MiB file of 22M values is refused before it.
_VALUES_PER_ROW = 18
_VALUES_PER_MERGE = 3
_VALUES_BESIDES = 1 << 16


def _check_value_count(path: Path, source: str, n_vocab: int) -> None:
    found = source.count(",") + source.count(":") + source.count("[") + 1
    bound = _VALUES_PER_ROW * n_vocab + _VALUES_PER_MERGE * MAX_VOCAB + _VALUES_BESIDES
    if found > bound:
        raise ModelFormatError(
            f"{path}: up to {found} JSON values (by its separators), more than a tokenizer "
            f"of the embedding's {n_vocab} rows holds ({bound}: {_VALUES_PER_ROW} a row, "
            f"{_VALUES_PER_MERGE} for each of up to {MAX_VOCAB} merges, {_VALUES_BESIDES} besides)"
        )


def _check_table_sizes(path: Path, spec: Any, n_vocab: int) -> None:
    """Refuse a tokenizer.json whose tables outgrow the embedding (``n_vocab`` rows, itself
    at most ``MAX_VOCAB``) before the tokenizer library builds them: under the file's byte
    bound, millions of short entries made it abort the process (issue 25)."""
    model = spec.get("model") if isinstance(spec, dict) else None
    model = model if isinstance(model, dict) else {}
    added = spec.get("added_tokens") if isinstance(spec, dict) else None
    rows = f"the embedding's {n_vocab} rows"
    for what, table, limit, why in (
        ("model.vocab", model.get("vocab"), n_vocab, rows),
        ("added_tokens", added, n_vocab, rows),
        ("model.merges", model.get("merges"), MAX_VOCAB, "the largest vocabulary read"),
    ):
        if isinstance(table, (list, dict)) and len(table) > limit:
            raise ModelFormatError(
                f"{path}: {what} has {len(table)} entries, more than {limit} ({why})"
            )


def _steps(node: Any) -> list[dict]:
    """Every component object of a tokenizer.json (normalizers, pre-tokenizers, decoders)."""
    if isinstance(node, list):
        return [s for item in node for s in _steps(item)]
    if not isinstance(node, dict):
        return []
    return [node, *(s for v in node.values() for s in _steps(v))]


def _has_step(spec: dict, kind: str) -> bool:
    """Whether tokenizer.json's normalizer, pre-tokenizer or decoder has a ``kind`` step."""
    parts = (spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder"))
    return any(s.get("type") == kind for s in _steps(list(parts)))


def _metaspace_prefix(spec: dict) -> bool:
    """A sentencepiece-style pre-tokenizer that puts "▁" before the text."""
    return any(
        s.get("type") == "Metaspace"
        and (s.get("prepend_scheme", "always") != "never" and s.get("add_prefix_space", True))
        for s in _steps(spec.get("pre_tokenizer"))
    )


def _template_specials(spec: dict) -> tuple[list[str], list[str]]:
    """The special tokens tokenizer.json's post-processor puts before and after a single
    text (TemplateProcessing, or BERT's / RoBERTa's processors: ``[CLS] text [SEP]``)."""
    for step in _steps(spec.get("post_processor")):
        if step.get("type") in ("BertProcessing", "RobertaProcessing"):
            cls, sep = step.get("cls"), step.get("sep")
            if isinstance(cls, list) and isinstance(sep, list) and cls and sep:
                return [str(cls[0])], [str(sep[0])]
        if step.get("type") == "TemplateProcessing" and isinstance(step.get("single"), list):
            before: list[str] = []
            after: list[str] = []
            side = before
            for piece in step["single"]:
                if not isinstance(piece, dict):
                    continue
                if "Sequence" in piece:
                    side = after
                elif isinstance(piece.get("SpecialToken"), dict):
                    side.append(str(piece["SpecialToken"].get("id")))
            return before, after
    return [], []


class Tokenizer:
    """Text <-> token ids for one model, built once from its GGUF metadata or from a
    Hugging Face ``tokenizer.json``."""

    def __init__(
        self,
        hf: HFTokenizer,
        token_types: list[int],
        *,
        byte_level: bool,
        strip_space_prefix: bool,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        add_eos: bool,
        eog_ids: frozenset[int],
    ) -> None:
        self._hf = hf
        self._types = token_types
        self.byte_level = byte_level
        self.strip_space_prefix = strip_space_prefix
        self.vocab_size = len(token_types)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        # gpt-oss (harmony): <|end|> closes a message inside the turn (the reasoning before
        # the answer), <|return|> and <|call|> close the turn -- as llama.cpp decides it
        if hf.token_to_id("<|return|>") is not None and hf.token_to_id("<|call|>") is not None:
            eog_ids -= {hf.token_to_id("<|end|>")}
        self.eog_ids = eog_ids

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> Tokenizer:
        """Build the tokenizer a GGUF describes (``tokenizer.ggml.*`` keys of its metadata)."""
        kind = text(metadata, "tokenizer.ggml.model", None)
        if kind not in ("gpt2", "llama", "bert"):
            raise UnsupportedModel(
                f"tokenizer.ggml.model {show(kind)} is not supported (supported: gpt2, llama, bert)"
            )
        tokens = strings(metadata, "tokenizer.ggml.tokens")
        if not tokens:
            raise bad("tokenizer.ggml.tokens", tokens, "a vocabulary")
        types_raw = numbers(metadata, "tokenizer.ggml.token_type", len(tokens), "iu")
        types = [_NORMAL] * len(tokens) if types_raw is None else types_raw.tolist()
        merges = strings(metadata, "tokenizer.ggml.merges", None)
        if merges is not None:
            merges = [tuple(m.split(" ", 1)) for m in merges]
            for i, m in enumerate(merges):
                if len(m) != 2:
                    raise bad(f"tokenizer.ggml.merges[{i}]", m[0], "two tokens and a space")
        pre = text(metadata, "tokenizer.ggml.pre", "default")
        space_prefix = flag(metadata, "tokenizer.ggml.add_space_prefix", True)
        try:
            if kind == "gpt2":
                hf = _byte_level_bpe(tokens, types, merges, pre)
                space_prefix = False
            elif kind == "bert":
                hf = _wordpiece(tokens, types)
                space_prefix = False
            else:
                hf = _sentencepiece_bpe(tokens, merges, metadata, space_prefix)
        except Exception as e:  # tokenizers' own errors (a merge of unknown tokens, ...)
            if isinstance(e, ModelFormatError):
                raise
            reason = show(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise ModelFormatError(f"the tokenizer metadata is invalid: {reason}") from e

        special = [
            AddedToken(tok, special=ty != _USER_DEFINED, normalized=False)
            for tok, ty in zip(tokens, types, strict=True)
            if ty in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
        hf.add_special_tokens([t for t in special if t.special])
        hf.add_tokens([t for t in special if not t.special])

        n = len(tokens)
        _token_id(metadata, "unknown", n)  # only sentencepiece uses it, but it must be an id
        bos_id, eos_id = _token_id(metadata, "bos", n), _token_id(metadata, "eos", n)
        if kind == "bert":  # [CLS] text [SEP], as llama.cpp's WordPiece adds them
            cls_id, sep_id = _token_id(metadata, "cls", n), _token_id(metadata, "seperator", n)
            bos_id = _first(cls_id, bos_id, hf.token_to_id("[CLS]"))
            eos_id = _first(sep_id, eos_id, hf.token_to_id("[SEP]"))
        eog = [_token_id(metadata, k, n) for k in ("eos", "eot", "eom")]
        eog += [hf.token_to_id(t) for t in _EOG_TEXTS]
        return cls(
            hf,
            types,
            byte_level=kind == "gpt2",
            strip_space_prefix=space_prefix,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=_token_id(metadata, "padding", n),
            # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise
            add_bos=flag(metadata, "tokenizer.ggml.add_bos_token", kind in ("llama", "bert")),
            add_eos=flag(metadata, "tokenizer.ggml.add_eos_token", kind == "bert"),
            eog_ids=frozenset(i for i in eog if i is not None),
        )

    @classmethod
    def from_hf_files(
        cls, tokenizer_json: Path, config: dict, n_vocab: int, eos_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory: ``tokenizer.json`` as it is,
        with ``config`` (tokenizer_config.json) naming BOS/EOS and whether BOS is added;
        ``eos_ids`` (generation_config.json) also end generation. Ids past the vocabulary
        up to ``n_vocab`` (embedding rows padded for speed) become unused special tokens."""
        try:
            source = read_source(tokenizer_json, MAX_TOKENIZER_JSON_BYTES, ModelFormatError)
            _check_value_count(tokenizer_json, source, n_vocab)
            spec = json.loads(source)
            _check_table_sizes(tokenizer_json, spec, n_vocab)
            hf = HFTokenizer.from_str(source)
        except FileNotFoundError:
            raise ModelNotFound(f"{tokenizer_json}: no such file") from None
        except ModelFormatError:
            raise
        except Exception as e:  # unreadable, not JSON, or a tokenizer `tokenizers` refuses
            reason = show(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)
            raise ModelFormatError(f"{tokenizer_json}: not a valid tokenizer ({reason})") from e
        size = hf.get_vocab_size(with_added_tokens=True)
        if size > n_vocab:
            raise ModelFormatError(
                f"{tokenizer_json} has {size} tokens but the embedding has {n_vocab} rows"
            )
        types = [_NORMAL] * n_vocab
        for tok in hf.get_added_tokens_decoder().values():
            if (i := hf.token_to_id(tok.content)) is not None:
                types[i] = _CONTROL if tok.special else _USER_DEFINED
        if size < n_vocab:
            pads = [f"[PAD{i}]" for i in range(size, n_vocab)]  # as llama.cpp's converter
            hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in pads])
            for i in range(size, n_vocab):
                types[i] = _CONTROL

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok is None:
                return None
            i = hf.token_to_id(tok) if isinstance(tok, str) else None
            if i is None:
                raise ModelFormatError(f"tokenizer_config.json: {key} {show(tok)} is no token")
            return i

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        # the post-processor's own specials: BERT's [CLS] text [SEP] (it names no BOS/EOS)
        before, after = _template_specials(spec)
        if bos_id is None and before:
            bos_id = hf.token_to_id(before[0])
        if eos_id is None and after:
            eos_id = hf.token_to_id(after[-1])
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if not isinstance(add_bos, bool):  # tokenizer.json's post-processor says it
            add_bos = bos_id is not None and hf.id_to_token(bos_id) in before
        if not isinstance(add_eos, bool):
            add_eos = eos_id is not None and hf.id_to_token(eos_id) in after
        eog = [eos_id, *eos_ids] + [hf.token_to_id(t) for t in _EOG_TEXTS]
        return cls(
            hf,
            types,
            byte_level=_has_step(spec, "ByteLevel"),
            strip_space_prefix=_has_step(spec, "Prepend") or _metaspace_prefix(spec),
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=token_id("pad_token"),
            add_bos=add_bos,
            add_eos=add_eos,
            eog_ids=frozenset(i for i in eog if i is not None and 0 <= i < n_vocab),
        )

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it are always parsed as one id.

        ``add_special`` adds BOS/EOS as the model asks (``add_bos`` / ``add_eos``).
        """
        try:
            # encode_batch releases the GIL (encode holds it: a 5.8 MB prompt froze the
            # server's other threads for 5.4 s)
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # tokenizers takes only valid Unicode
            bad_at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if bad_at is None:
                raise
            raise InvalidRequest(
                f"the text is not valid Unicode: a lone surrogate {text[bad_at]!r} at "
                f"character {bad_at} (invalid UTF-8 bytes?)"
            ) from None
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of ``text`` as it continues other text: no BOS/EOS and no sentencepiece prefix
        space (a grammar's forced text is tokenized so; special tokens are not parsed)."""
        if not self.strip_space_prefix:
            return self.encode(text, add_special=False)
        return [t.id for t in self._hf.model.tokenize(text.replace(" ", "▁"))]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; ``skip_special`` drops control and unknown tokens, not user-defined."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token as the vocabulary spells it (byte-level spelling for ``gpt2``)."""
        return self._hf.token_to_id(token)

    def id_to_token(self, id: int) -> str:
        """The vocabulary's spelling of token ``id``."""
        return self._hf.id_to_token(id)

    def is_special(self, id: int) -> bool:
        """True for the tokens ``skip_special`` drops (control and unknown)."""
        return self._types[id] in (_UNKNOWN, _CONTROL)

    def token_bytes(self, id: int) -> bytes:
        """The bytes token ``id`` stands for, before any leading-space stripping."""
        tok = self._hf.id_to_token(id)
        if self.byte_level:
            # like HF's ByteLevel decoder: a token spelled outside the byte alphabet is taken as is
            of_char = _byte_of_char()
            return bytes(of_char[c] for c in tok) if set(tok) <= of_char.keys() else tok.encode()
        if m := _BYTE_TOKEN.fullmatch(tok):
            return bytes([int(m.group(1), 16)])
        return tok.replace("▁", " ").encode()


class StreamDecoder:
    """Incremental detokeniser for streaming.

    Never emits broken UTF-8 (bytes of an incomplete character wait for the next token), strips
    the sentencepiece prefix space once at the start, and joins byte-fallback tokens, so that the
    concatenation of all pushed pieces plus `flush` equals ``tokenizer.decode(all ids)``. (The one
    exception is invalid byte sequences in a sentencepiece vocabulary: HF writes one U+FFFD per
    byte token of an invalid run, we write one per maximal invalid subsequence.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.strip_space_prefix
        self._cache: dict[int, bytes] = {}

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._skip and self._tok.is_special(token_id):
            return ""
        data = self._cache.get(token_id)
        if data is None:
            data = self._cache[token_id] = self._tok.token_bytes(token_id)
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """End of stream: return what was held back (an incomplete character becomes U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            if text[0] == " ":
                return text[1:]
        return text
