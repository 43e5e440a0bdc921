"""``dynalm rerank`` end to end (a real subprocess, as test_cli runs the CLI): one line per
document, best first, the same scores as --json and as transformers; documents from stdin;
and bad input as one error line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tiny_bert
from test_cli import assert_one_line_error, dynalm

QUERY = "the cat sat"
DOCS = ["dog", "the cat sat on the mat.", "hello world"]


@pytest.fixture(scope="module")
def reranker_model() -> tiny_bert.BertForSequenceClassification:
    return tiny_bert.reference_reranker()


@pytest.fixture(scope="module")
def reranker_gguf(reranker_model, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rerank-cli")
    return tiny_bert.write_gguf(reranker_model, d / "rr.gguf", pooler=True)


def test_one_line_per_document_best_first(reranker_model, reranker_gguf, tmp_path) -> None:
    plain = dynalm("rerank", str(reranker_gguf), QUERY, *DOCS, "--cpu", home=tmp_path)
    assert plain.returncode == 0, plain.stderr
    lines = [line.split("\t") for line in plain.stdout.splitlines()]
    tok = tiny_bert.reference_tokenizer(tmp_path)
    pairs = [(e["input_ids"], e["token_type_ids"]) for e in (tok(QUERY, d) for d in DOCS)]
    ref = [1 / (1 + math.exp(-x)) for x in tiny_bert.reference_scores(reranker_model, pairs)]
    assert [int(i) for _, i, _ in lines] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for score, index, text in lines:
        assert abs(float(score) - ref[int(index)]) <= 1e-4 and text == DOCS[int(index)]
    as_json = dynalm("rerank", str(reranker_gguf), QUERY, "-", "--json", "--cpu",
                     stdin="\n".join(DOCS) + "\n", home=tmp_path)  # fmt: skip
    body = json.loads(as_json.stdout)
    assert [(x["index"], x["document"]) for x in body["results"]] == [
        (int(i), t) for _, i, t in lines
    ]


def test_bad_input_is_one_error_line(reranker_gguf: Path, tmp_path: Path) -> None:
    long = " ".join(["cat"] * 40)
    refused = dynalm("rerank", str(reranker_gguf), QUERY, "dog", long, "--cpu", home=tmp_path)
    assert_one_line_error(refused, "documents[1] with the query has 46 tokens", "length 32")
    cut = dynalm("rerank", str(reranker_gguf), QUERY, long, "--truncate", "--cpu", home=tmp_path)
    assert cut.returncode == 0 and len(cut.stdout.splitlines()) == 1
    empty = dynalm("rerank", str(reranker_gguf), "", "dog", "--cpu", home=tmp_path)
    assert_one_line_error(empty, "query is an empty string")


def test_an_embedding_or_generation_model_cannot_rerank(smollm2_gguf, tmp_path: Path) -> None:
    encoder = tiny_bert.write_gguf(tiny_bert.reference_model(), tmp_path / "e.gguf")
    result = dynalm("rerank", str(encoder), QUERY, "dog", "--cpu", home=tmp_path)
    assert_one_line_error(result, "is an embedding model (bert); it has no classification head")
    result = dynalm("rerank", str(smollm2_gguf), QUERY, "dog", "--cpu", home=tmp_path)
    assert_one_line_error(result, "is a generation model (llama); it has no classification head")
