"""BERT from a SafeTensors folder in the sentence-transformers layout: ``config.json`` and
``model.safetensors`` (transformers' ``save_pretrained``), ``tokenizer.json`` (a fast
BertTokenizer's), ``modules.json`` with its ``1_Pooling/config.json`` and an optional
``2_Normalize``, and ``sentence_bert_config.json``.

sentence-transformers is not installed in the project's environment, so the folders are
written here by hand as ``SentenceTransformer.save`` lays them out, and the reference is what
its modules compute: transformers' ``BertModel``, then the pooling, then ``F.normalize`` when
``modules.json`` lists a Normalize module (``tiny_bert.reference_embeddings``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_bert
from test_cli import dynalm
from transformers import BertTokenizerFast

from dynalm.errors import InvalidRequest, ModelFormatError, UnsupportedModel
from dynalm.models.loader import load_model
from dynalm.runtime.embed import Embedder

TEXTS = ["Hello world!", "the cat sat on the mat.", "Embeddings, dog?", "HELLO Dog", "a b c d e"]
MIN_COSINE = {"exact": 0.99999, "auto": 0.999}
ST = "sentence_transformers.models."
MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
         "last": "pooling_mode_lasttoken"}  # fmt: skip


def write_st_dir(
    model: tiny_bert.BertModel,
    path: Path,
    pooling: str = "mean",
    normalize: bool = True,
    lowercase: bool = True,
    max_seq_length: int | None = None,
) -> Path:
    """A sentence-transformers folder of ``model``, as ``SentenceTransformer.save`` writes it."""
    path.mkdir()
    model.save_pretrained(path, safe_serialization=True)
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(tiny_bert.VOCAB) + "\n")
    BertTokenizerFast(str(vocab), do_lower_case=lowercase).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]  # fmt: skip
    (path / "1_Pooling").mkdir()
    pool = {"word_embedding_dimension": model.config.hidden_size, "include_prompt": True}
    pool |= {mode: name == pooling for name, mode in MODES.items()}
    pool |= {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False}  # fmt: skip
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules))
    st_config = {"max_seq_length": max_seq_length or model.config.max_position_embeddings,
                 "do_lower_case": False}  # fmt: skip
    (path / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return path


def reference(model, tokenizer: BertTokenizerFast, pooling: str, normalize: bool) -> np.ndarray:
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    out = tiny_bert.reference_embeddings(model, ids, pooling)
    if not normalize:  # undo reference_embeddings' normalisation: pool only
        import torch

        with torch.no_grad():
            hs = [model(torch.tensor([s])).last_hidden_state[0].double() for s in ids]
        out = np.stack([{"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling].numpy()
                        for h in hs])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def bert() -> tiny_bert.BertModel:
    return tiny_bert.reference_model()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize(
    "pooling, normalize, lowercase",
    [("mean", True, True), ("cls", False, True), ("last", True, False)],
)
@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_st_folder_matches_sentence_transformers(
    bert, tmp_path: Path, pooling, normalize, lowercase, mode
) -> None:
    d = write_st_dir(bert, tmp_path / "st", pooling, normalize, lowercase)
    ref_tok = BertTokenizerFast.from_pretrained(d)
    want = reference(bert, ref_tok, pooling, normalize)
    model = load_model(d)
    assert [model.tokenizer.encode(t) for t in TEXTS] == [ref_tok(t)["input_ids"] for t in TEXTS]
    emb = Embedder(model, backend="cpu", mode=mode)
    got = emb.embed([emb.tokenize(t) for t in TEXTS])
    assert _cosines(got, want).min() >= MIN_COSINE[mode]
    # the vectors' length too: normalised only with a Normalize module
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), 1e-4)


def test_cased_tokenizer_keeps_case(bert, tmp_path: Path) -> None:
    """tokenizer.json's BertNormalizer says lowercase false: "HELLO" stays upper-case (its
    letters are unknown to the tiny lower-case vocabulary), as transformers tokenises it."""
    d = write_st_dir(bert, tmp_path / "cased", lowercase=False)
    tok = load_model(d).tokenizer
    unk = tiny_bert.VOCAB.index("[UNK]")
    assert tok.encode("HELLO") == [2, unk, 3]
    assert tok.encode("hello") == [2, tiny_bert.VOCAB.index("hello"), 3]


def test_dynalm_embed_reads_the_folder(bert, tmp_path: Path) -> None:
    d = write_st_dir(bert, tmp_path / "st")
    want = reference(bert, BertTokenizerFast.from_pretrained(d), "mean", True)
    result = dynalm("embed", str(d), *TEXTS[:2], "--cpu", "--mode", "exact", home=tmp_path)
    assert result.returncode == 0, result.stderr
    got = np.array([[float(x) for x in line.split()] for line in result.stdout.splitlines()])
    assert _cosines(got, want[:2]).min() >= MIN_COSINE["exact"]


def test_max_seq_length_bounds_the_input(bert, tmp_path: Path) -> None:
    d = write_st_dir(bert, tmp_path / "st", max_seq_length=8)
    emb = Embedder(load_model(d), backend="cpu", mode="exact")
    assert emb.max_length == 8
    with pytest.raises(InvalidRequest, match=r"input\[0\] has 12 tokens, more than the "
                       r"model's maximum length 8"):  # fmt: skip
        emb.tokenize("a b c d e f g h i j")
    assert len(emb.tokenize("a b c d e f g h i j", truncate=True)) == 8


def _edit(d: Path, name: str, value) -> None:
    (d / name).write_text(json.dumps(value))


@pytest.mark.parametrize(
    "file, value, error, message",
    [
        ("sentence_bert_config.json", {"max_seq_length": 0}, ModelFormatError,
         r"sentence_bert_config.json: max_seq_length = 0, expected an integer in \[1, 32\]"),
        ("sentence_bert_config.json", {"max_seq_length": 33}, ModelFormatError,
         r"max_seq_length = 33, expected an integer in \[1, 32\]"),
        ("sentence_bert_config.json", {"max_seq_length": "8"}, ModelFormatError,
         r"max_seq_length = '8'"),
        ("modules.json", {"0": 1}, ModelFormatError, r"modules.json: .* is not a list of objects"),
        ("modules.json", [{"type": ST + "Dense", "path": "2_Dense"}], UnsupportedModel,
         r"modules.json: module 0 \('sentence_transformers.models.Dense', path '2_Dense'\) is "
         r"not supported"),
        ("modules.json", [{"type": ST + "Pooling", "path": "../x"}], ModelFormatError,
         r"modules.json: module 0's path '../x'"),
        ("modules.json", [{"type": ST + "Pooling", "path": "missing"}], Exception,
         r"missing/config.json: no such file"),
        ("1_Pooling/config.json", {"pooling_mode_max_tokens": True}, UnsupportedModel,
         r"1_Pooling/config.json: pooling \{'pooling_mode_max_tokens': True\} is not supported"),
        ("1_Pooling/config.json", {"pooling_mode_mean_tokens": True,
                                   "pooling_mode_cls_token": True}, UnsupportedModel,
         r"pooling .* is not supported \(exactly one of"),
        ("1_Pooling/config.json", {"pooling_mode_mean_tokens": 1}, UnsupportedModel,
         r"pooling \{'pooling_mode_mean_tokens': 1\}"),
        ("1_Pooling/config.json", {"word_embedding_dimension": 64,
                                   "pooling_mode_mean_tokens": True}, ModelFormatError,
         r"word_embedding_dimension = 64 but hidden_size is 32"),
        ("1_Pooling/config.json", [], ModelFormatError, r"1_Pooling/config.json: \[\] is not an"),
    ],
)  # fmt: skip
def test_bad_sentence_transformers_files_are_named(
    bert, tmp_path: Path, file, value, error, message
) -> None:
    d = write_st_dir(bert, tmp_path / "st")
    _edit(d, file, value)
    with pytest.raises(error, match=message):
        load_model(d)


def test_a_fifo_for_modules_json_is_refused_not_waited_on(bert, tmp_path: Path) -> None:
    import os

    d = write_st_dir(bert, tmp_path / "st")
    (d / "modules.json").unlink()
    os.mkfifo(d / "modules.json")
    with pytest.raises(ModelFormatError, match=r"modules.json"):
        load_model(d)


def test_relative_position_embeddings_are_refused(bert, tmp_path: Path) -> None:
    d = write_st_dir(bert, tmp_path / "st")
    config = json.loads((d / "config.json").read_text())
    _edit(d, "config.json", config | {"position_embedding_type": "relative_key"})
    with pytest.raises(UnsupportedModel, match=r"position_embedding_type 'relative_key' is not"):
        load_model(d)
