"""The GGUF tokenizer against transformers' GGUF tokenizer, on SmolLM2 (byte-level BPE) and on a
small sentencepiece vocabulary trained here and written into a llama GGUF."""

from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from dynalm.errors import ModelFormatError, UnsupportedModel
from dynalm.models.chat_template import ChatTemplate
from dynalm.models.tokenizer import StreamDecoder, Tokenizer


def read_metadata(path: Path) -> dict:
    """GGUF metadata shaped like `GGUFFile.metadata`: str, list[str], numpy arrays, scalars."""
    out: dict = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        kind = field.types[0] if field.types else None
        if key.startswith("GGUF."):
            continue
        if kind == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            out[key] = [bytes(field.parts[i]).decode() for i in field.data]
        elif kind == gguf.GGUFValueType.ARRAY:
            out[key] = np.concatenate([field.parts[i] for i in field.data])
        elif kind == gguf.GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out


_SNIPPETS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    " \t \n ",
    "Hello world",
    " Hello world",
    "Hello world ",
    "  leading and trailing  ",
    "Hello, World! How's it going? I'm fine; you'd say we'll see.",
    "THE QUICK BROWN FOX JUMPED OVER THE LAZY DOG'S BACK",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "const x = {a: 1, 'b': [2, 3]};  // comment\n\tconsole.log(x?.a ?? 0);",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    '<html><body class="main">&amp; &lt;tag&gt;</body></html>',
    "1234567890",
    "3.14159 2.71828 1e-10 -42 +7 0x1F 1,000,000",
    "Price: $19.99 (was €25,00) — save 20%!",
    "naïve café résumé façade Ångström über straße",
    "Ça va? Très bien, merci. ¿Qué tal? ¡Genial!",
    "日本語のテキストです。東京は大きい。",
    "中文分词测试：你好，世界！",
    "한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "Привет, как дела? Всё хорошо.",
    "Ελληνικά γράμματα αβγδ",
    "हिन्दी में पाठ",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "math: ∑ x² ≤ ∞, α→β, √2 ≈ 1.414",
    "tabs\tbetween\twords\t\tand\t\t\tmore",
    "line1\r\nline2\rline3\n\nline5",
    "multiple     spaces      here",
    "trailing newline\n",
    "   \n\n   indented block\n      more\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "not special: <|im_start |> <im_start> |im_end|",
    "<s> </s> <unk> <tool> inside text",
    "a<s>b</s>c<tool>d",
    "don't won't can't shouldn't y'all",
    "URL: https://example.com/path?q=1&r=two#frag",
    "email@example.org, @handle #hashtag",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "...!!!???---___***",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "ﬁ ligature and ｆｕｌｌｗｉｄｔｈ",
    "mixed 123abc456 def789",
    "x" * 300,
    "ab " * 100,
]

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "I",
    "at",
    "be",
    "this",
    "have",
    "from",
    "code",
    "model",
    "token",
    "Python",
    "llama",
    "GGUF",
    "quantize",
    "42",
    "7",
    "2024",
    "café",
    "über",
    "東京",
    "你好",
    "😀",
    "naïve",
    "print()",
    "{x}",
    "[1,2]",
    "<tag>",
    "->",
    "=>",
    "==",
    "!=",
    "'quote'",
    '"dq"',
    "#define",
    "std::vector<int>",
    "λ",
    "∑",
    "ü",
    "ß",
]
_SEPS = [" ", " ", " ", "  ", "\n", "\t", ", ", ". ", "\n\n", "", " \n"]


def corpus(n: int = 260) -> list[str]:
    """The snippets above plus random mixtures of words, scripts and whitespace (seeded)."""
    rng = random.Random(1234)
    out = list(_SNIPPETS)
    while len(out) < n:
        words = rng.choices(_WORDS, k=rng.randint(1, 25))
        text = "".join(w + rng.choice(_SEPS) for w in words)
        if rng.random() < 0.3:
            text = " " * rng.randint(1, 3) + text
        out.append(text)
    return out


CORPUS = corpus()


@pytest.fixture(scope="session")
def smol_metadata(smollm2_gguf: Path) -> dict:
    return read_metadata(smollm2_gguf)


@pytest.fixture(scope="session")
def smol(smol_metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_metadata)


@pytest.fixture(scope="session")
def smol_hf_gguf(smollm2_gguf: Path):
    """transformers' tokenizer from the GGUF, as transformers builds it."""
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smol_hf(smol_hf_gguf):
    """The same, with SmolLM2's own pre-tokenizer (its tokenizer.json: digits split one by one,
    then GPT-2's byte-level split), which llama.cpp's `smollm` pre-tokenizer also follows.
    transformers' GGUF loader does not know `smollm` and leaves the digit split out."""
    hf = copy.deepcopy(smol_hf_gguf)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return hf


_SPM_KINDS = {"normal": 1, "unknown": 2, "control": 3, "user_defined": 4, "unused": 5, "byte": 6}


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama GGUF holding a sentencepiece BPE vocabulary (~500 pieces, byte fallback)."""
    tmp = tmp_path_factory.mktemp("spm")
    rng = random.Random(7)
    sentences = [
        " ".join(rng.choices(_WORDS[:40], k=rng.randint(3, 12)))
        + rng.choice([".", "!", "?", ", fine.", " café."])
        for _ in range(600)
    ]
    (tmp / "corpus.txt").write_text("\n".join(sentences), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"),
        model_prefix=str(tmp / "sp"),
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        user_defined_symbols=["<tool>"],
        character_coverage=1.0,
        minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    kinds = [
        _SPM_KINDS["control"]
        if sp.is_control(i)
        else _SPM_KINDS["unknown"]
        if sp.is_unknown(i)
        else _SPM_KINDS["byte"]
        if sp.is_byte(i)
        else _SPM_KINDS["user_defined"]
        if pieces[i] == "<tool>"
        else _SPM_KINDS["normal"]
        for i in range(len(pieces))
    ]
    path = tmp / "spm-llama.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    w.add_token_types(kinds)
    w.add_unk_token_id(sp.unk_id())
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def spm(spm_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(spm_gguf))


@pytest.fixture(scope="session")
def spm_hf(spm_gguf: Path):
    return AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)


def _assert_same_ids(ours: Tokenizer, hf, texts: list[str]) -> None:
    bad = [
        (t, ours.encode(t, add_special=s), hf.encode(t, add_special_tokens=s))
        for t in texts
        for s in (False, True)
        if ours.encode(t, add_special=s) != hf.encode(t, add_special_tokens=s)
    ]
    assert not bad, f"{len(bad)} mismatches, first: {bad[:3]}"


def _assert_streams(tok: Tokenizer, texts: list[str], skip_special: bool) -> None:
    for text in texts:
        ids = tok.encode(text)
        stream = StreamDecoder(tok, skip_special=skip_special)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special=skip_special), (text, pieces)
        if "\ufffd" not in text:
            assert not any("\ufffd" in p for p in pieces), (text, pieces)


def test_corpus_is_varied() -> None:
    assert len(CORPUS) >= 200 and len(set(CORPUS)) >= 200


def test_smollm2_matches_transformers(smol: Tokenizer, smol_hf, smol_hf_gguf) -> None:
    _assert_same_ids(smol, smol_hf, CORPUS)
    # transformers' own GGUF tokenizer differs only where a digit follows whitespace
    _assert_same_ids(smol, smol_hf_gguf, [t for t in CORPUS if not any(c.isdigit() for c in t)])
    assert smol.encode("  7") == [smol.token_to_id("ĠĠ"), smol.token_to_id("7")]


def test_smollm2_attributes(smol: Tokenizer, smol_metadata: dict) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.add_bos, smol.add_eos) == (1, 2, False, False)
    im_end, endoftext = smol.token_to_id("<|im_end|>"), smol.token_to_id("<|endoftext|>")
    assert smol.eog_ids == {im_end, endoftext}
    assert smol.encode("<|im_start|>user") == [smol.token_to_id("<|im_start|>"), 4093]
    assert smol.id_to_token(4093) == "user"
    assert smol.token_to_id("no such token") is None
    # specials stay whole and are dropped or kept on decode
    ids = smol.encode("a<|im_end|>b")
    assert smol.decode(ids) == "ab" and smol.decode(ids, skip_special=False) == "a<|im_end|>b"
    # SmolLM splits digits one by one (llama.cpp's smollm pre-tokenizer)
    assert len(smol.encode("12345")) == 5
    started = time.perf_counter()
    Tokenizer.from_gguf_metadata(smol_metadata)
    # a budget, not a figure: 0.08-0.12 s measured on a 2-core Zen 5, so 8x of margin for a
    # slower or busier machine; what it guards against is seconds (a Python-level BPE)
    assert time.perf_counter() - started < 1.0


def test_smollm2_round_trip_and_stream(smol: Tokenizer) -> None:
    for text in CORPUS:
        assert smol.decode(smol.encode(text), skip_special=False) == text
    _assert_streams(smol, CORPUS, skip_special=True)
    _assert_streams(smol, CORPUS, skip_special=False)


def test_stream_matches_decode_on_arbitrary_ids(smol: Tokenizer) -> None:
    """Whatever a model samples (broken byte sequences included), the stream equals decode."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 20))]
        ids += [rng.randrange(17, 300) for _ in range(rng.randint(0, 10))]  # byte tokens
        rng.shuffle(ids)
        for skip in (True, False):
            stream = StreamDecoder(smol, skip_special=skip)
            text = "".join(stream.push(i) for i in ids) + stream.flush()
            assert text == smol.decode(ids, skip_special=skip), ids


def test_stream_holds_back_partial_characters(smol: Tokenizer) -> None:
    ids = smol.encode("😀")
    assert len(ids) > 1  # one emoji, several byte tokens
    stream = StreamDecoder(smol)
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    stream = StreamDecoder(smol)
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"


def test_spm_matches_transformers(spm: Tokenizer, spm_hf) -> None:
    _assert_same_ids(spm, spm_hf, CORPUS)
    assert spm.encode("Hi")[0] == spm.bos_id and spm.add_bos
    assert spm.id_to_token(spm.encode("café", add_special=False)[0]).startswith("▁")
    # characters the vocabulary lacks fall back to <0x..> byte tokens
    assert spm.id_to_token(spm.encode("Ж", add_special=False)[-1]) == "<0x96>"
    assert spm.encode("<tool>", add_special=False) == [spm.token_to_id("<tool>")]


def test_spm_round_trip_and_stream(spm: Tokenizer, spm_hf) -> None:
    for text in CORPUS:
        ids = spm.encode(text, add_special=False)
        # like transformers (Metaspace, prepend "first"): text already starting with a space gets
        # no extra "▁", and decoding strips one leading space
        assert spm.decode(ids, skip_special=False) == text.removeprefix(" ")
        ids = spm.encode(text)
        assert spm.decode(ids) == spm_hf.decode(ids, skip_special_tokens=True)
    _assert_streams(spm, CORPUS, skip_special=True)
    _assert_streams(spm, CORPUS, skip_special=False)


def test_chat_prompt_ids_match_transformers(smol: Tokenizer, smol_metadata: dict, smol_hf) -> None:
    template = ChatTemplate.from_gguf_metadata(smol_metadata, smol)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? 😀"},
    ]
    expected = smol_hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert smol.encode(template.render(messages), add_special=False) == list(expected)


def _gpt2_metadata(**extra: object) -> dict:
    letters = [chr(c) for c in range(33, 127)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<|endoftext|>", *letters],
        "tokenizer.ggml.token_type": np.array([3] + [1] * len(letters), dtype=np.int32),
        "tokenizer.ggml.merges": [],
        **extra,
    }


def test_pre_tokenizer_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf_metadata(_gpt2_metadata(**{"tokenizer.ggml.pre": "mystery"}))
    assert "mystery" in caplog.text
    assert tok.decode(tok.encode("ab<|endoftext|>")) == "ab"
    for pre in ("llama-bpe", "qwen2", "gpt2", "default", "smollm"):
        tok = Tokenizer.from_gguf_metadata(_gpt2_metadata(**{"tokenizer.ggml.pre": pre}))
        assert tok.decode(tok.encode("x=1;y")) == "x=1;y"
        assert tok.eog_ids == {0}


def test_bad_metadata() -> None:
    with pytest.raises(UnsupportedModel, match="rwkv"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelFormatError, match="token_type"):
        Tokenizer.from_gguf_metadata(
            _gpt2_metadata(**{"tokenizer.ggml.token_type": np.array([1], dtype=np.int32)})
        )
