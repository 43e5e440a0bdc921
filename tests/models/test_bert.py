"""The ``bert`` family (``bert.lum``): tiny random-weight BERT encoders written as llama.cpp
writes them (``tiny_bert``), embedded by DynaLM and compared with transformers' BertModel plus
sentence-transformers' pooling and normalisation, in each mode and pooling; WordPiece
tokenisation against transformers' BertTokenizer; the packed (padding-free) batch; the
maximum length; and what an encoder file may not say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_bert
from gguf import GGMLQuantizationType

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import InvalidRequest, ModelFormatError, UnsupportedModel
from dynalm.ir.lumen.tree import LumenError
from dynalm.ir.passes import optimize, verify
from dynalm.ir.text import parse_graph, print_graph
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hparams import read_hparams
from dynalm.models.loader import load_model, model_graph
from dynalm.models.tokenizer import Tokenizer
from dynalm.runtime.embed import Embedder
from dynalm.runtime.engine.engine import Engine

TEXTS = [
    "Hello world!",
    "the cat sat on the mat.",
    "Embeddings, dog?",
    "xyz q",
    "HELLO",
    "a b c d e f g h i j k l m n o p",
]
# exact: the fp32 kernels (the reference is computed in fp32 by torch, pooled in fp64);
# auto: the fast path, allowed int8 activations where the weights are quantised
MIN_COSINE = {"safe": 0.99999, "exact": 0.99999, "auto": 0.999}


@pytest.fixture(scope="module")
def bert() -> tiny_bert.BertModel:
    return tiny_bert.reference_model()


@pytest.fixture(scope="module")
def bert_files(bert, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bert")
    return {p: tiny_bert.write_gguf(bert, d / f"{p}.gguf", p) for p in tiny_bert.POOLING}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_wordpiece_matches_bert_tokenizer(bert_files, tmp_path: Path) -> None:
    ours = load_model(bert_files["mean"]).tokenizer
    ref = tiny_bert.reference_tokenizer(tmp_path)
    for text in [*TEXTS, "  spaces\tand\nlines ", "Ünïcödé accents", "unknownword!!"]:
        assert ours.encode(text) == ref(text)["input_ids"], text
    assert ours.decode(ours.encode("the cat sat")) == "the cat sat"


@pytest.mark.parametrize("mode", ["safe", "exact", "auto"])
@pytest.mark.parametrize("pooling", list(tiny_bert.POOLING))
def test_embeddings_match_transformers(bert, bert_files, pooling: str, mode: str) -> None:
    embedder = Embedder(load_model(bert_files[pooling]), backend="cpu", mode=mode)
    ids = [embedder.tokenize(t) for t in TEXTS]
    got = embedder.embed(ids)
    ref = tiny_bert.reference_embeddings(bert, ids, pooling)
    assert got.shape == (len(TEXTS), bert.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, ref).min() >= MIN_COSINE[mode]


def test_q8_0_auto_within_budget(bert, tmp_path: Path) -> None:
    """Quantised weights: auto mode (int8 activations) stays near the fp32 reference."""
    path = tiny_bert.write_gguf(bert, tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    embedder = Embedder(load_model(path), backend="cpu", mode="auto")
    ids = [embedder.tokenize(t) for t in TEXTS]
    ref = tiny_bert.reference_embeddings(bert, ids, "mean")
    assert _cosines(embedder.embed(ids), ref).min() >= 0.99


@pytest.mark.parametrize("mode", ["safe", "exact"])
def test_packed_batch_equals_one_at_a_time(bert_files, mode: str) -> None:
    """Sequences of different lengths share a step without padding, each attending only
    within itself: packed, each gets the vector it gets alone (steps split at max_tokens)."""
    embedder = Embedder(load_model(bert_files["mean"]), backend="cpu", mode=mode, max_tokens=40)
    ids = [embedder.tokenize(t) for t in TEXTS]
    together = embedder.embed(ids)
    alone = np.concatenate([embedder.embed([s]) for s in ids])
    np.testing.assert_allclose(together, alone, atol=1e-6)


def test_longer_than_max_length_is_refused_or_truncated(bert, bert_files) -> None:
    embedder = Embedder(load_model(bert_files["cls"]), backend="cpu", mode="exact")
    long = " ".join(["cat"] * 40)  # 42 tokens with [CLS] and [SEP]; the model takes 32
    with pytest.raises(InvalidRequest, match=r"input\[3\] has 42 tokens, more than the "
                       r"model's maximum length 32"):  # fmt: skip
        embedder.tokenize(long, index=3)
    ids = embedder.tokenize(long, truncate=True)
    assert len(ids) == 32 and ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    ref = tiny_bert.reference_embeddings(bert, [ids], "cls")
    assert _cosines(embedder.embed([ids]), ref).min() >= 0.99999


def test_a_file_claiming_a_huge_context_is_held_to_max_length(tmp_path: Path) -> None:
    """A step holds a whole input, so its buffers are sized by the longest: a file whose
    position table claims more than MAX_LENGTH rows is embedded up to MAX_LENGTH tokens."""
    from dynalm.runtime.embed import MAX_LENGTH

    model = tiny_bert.reference_model(n_layers=1, positions=MAX_LENGTH + 8)
    embedder = Embedder(load_model(tiny_bert.write_gguf(model, tmp_path / "long.gguf")),
                        backend="cpu", mode="exact")  # fmt: skip
    assert embedder.max_length == MAX_LENGTH
    with pytest.raises(InvalidRequest, match=rf"input\[0\] has {MAX_LENGTH + 1} tokens, more "
                       rf"than the model's maximum length {MAX_LENGTH}"):  # fmt: skip
        embedder.check([5] * (MAX_LENGTH + 1))


def test_bad_ids_are_refused(bert_files) -> None:
    embedder = Embedder(load_model(bert_files["mean"]), backend="cpu", mode="exact")
    n = len(tiny_bert.VOCAB)
    with pytest.raises(InvalidRequest, match=rf"input\[1\]: token id {n} is outside the "
                       rf"vocabulary \[0, {n - 1}\]"):  # fmt: skip
        embedder.check([2, n, 3], index=1)
    with pytest.raises(InvalidRequest, match=r"input\[0\]: token id -1 is outside"):
        embedder.check([-1])
    with pytest.raises(InvalidRequest, match=r"input\[2\] is empty"):
        embedder.check([], index=2)


def test_unsupported_pooling_type_is_refused(bert, tmp_path: Path) -> None:
    """llama.cpp's pooling numbers 0 (none) and 5 give no sentence vector here; 4 (rank)
    needs a classification head (tests/models/test_reranker.py)."""
    path = tiny_bert.write_gguf(bert, tmp_path / "none.gguf", metadata={"bert.pooling_type": 5})
    with pytest.raises(LumenError, match=r"bert\.lum:\d+:\d+: pool\(x, logit_rows, mode = "
                       r"pooling_type\): pooling mode 5 is not one of 1 \(mean\), 2 \(cls\), "
                       r"3 \(last\)"):  # fmt: skip
        load_model(path)
    path = tiny_bert.write_gguf(bert, tmp_path / "rank.gguf", metadata={"bert.pooling_type": 4})
    with pytest.raises(ModelFormatError, match=r"bert\.lum:\d+:\d+: the model has no tensor "
                       "'cls.output.weight'"):  # fmt: skip
        load_model(path)


def test_a_generation_model_cannot_embed(tmp_path: Path) -> None:
    import tiny_models

    spec = tiny_models.SPECS["qwen3"]
    path = tiny_models.write_gguf(tiny_models.reference_model(spec), spec, tmp_path / "q.gguf")
    with pytest.raises(UnsupportedModel, match="is a generation model .qwen3.; it has no "
                       "embedding output"):  # fmt: skip
        Embedder(load_model(path), backend="cpu")


def test_graph_text_reads_back(bert_files) -> None:
    """The encoder's ops print and parse like every other (DynaIR text), before and after
    the passes (which merge q/k/v with their biases and fuse the residual adds)."""
    with GGUFFile(bert_files["cls"]) as f:
        hp = read_hparams(f.metadata, {n: t.shape for n, t in f.tensors.items()})
        graph = model_graph(f, hp)
    optimized = optimize(graph)
    ops = {n.op for n in optimized.nodes}
    assert {"layer_norm", "gelu", "encoder_attention", "pool", "l2_norm", "matmul_add"} <= ops
    for g in (graph, optimized):
        text = print_graph(g)
        back = parse_graph(text)
        assert back == g
        verify(back)
    assert "= pool %" in text and ", mode=2\n" in text  # bert.pooling_type 2: CLS


def _wordpiece_metadata(tokens: list[str], types: list[int]) -> dict:
    return {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
    }


def test_unknown_token_read_with_or_without_its_phantom_space() -> None:
    """The converter keeps only CONTROL tokens as they are; an unknown token typed UNKNOWN
    comes out as "▁[UNK]", a file written otherwise may keep "[UNK]": both are [UNK]."""
    cls, sep, unk, normal = 3, 3, 2, 1
    for spelled in ("▁[UNK]", "[UNK]"):
        tokens = ["[CLS]", "[SEP]", spelled, "▁cat", "s"]
        tok = Tokenizer.from_gguf_metadata(
            _wordpiece_metadata(tokens, [cls, sep, unk, normal, normal])
        )
        assert tok.encode("cats dog") == [0, 3, 4, 2, 1]  # [CLS] cat ##s [UNK] [SEP]


def test_wordpiece_without_an_unknown_token_is_refused() -> None:
    with pytest.raises(ModelFormatError, match=r"the WordPiece vocabulary has no unknown token"):
        Tokenizer.from_gguf_metadata(_wordpiece_metadata(["[CLS]", "▁cat"], [3, 1]))


def test_the_engine_refuses_an_embedding_model(bert_files) -> None:
    """run / bench / perplexity build an engine: an encoder has no logits to sample."""
    with pytest.raises(UnsupportedModel, match=r"tiny-bert is an embedding model \(bert\): it "
                       r"cannot generate text"):  # fmt: skip
        Engine(load_model(bert_files["mean"]), CpuDevice())
