"""``dynalm embed`` end to end (a real subprocess, as test_cli runs the CLI): one vector per
line or one JSON object, the texts from stdin, and bad input as one error line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_bert
from test_cli import assert_one_line_error, dynalm


@pytest.fixture(scope="module")
def bert_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("embed-cli")
    return tiny_bert.write_gguf(tiny_bert.reference_model(), d / "bert.gguf", "mean")


def test_one_vector_per_line_matching_json(bert_gguf: Path, tmp_path: Path) -> None:
    texts = ["hello world", "the cat sat"]
    plain = dynalm("embed", str(bert_gguf), *texts, "--cpu", home=tmp_path)
    assert plain.returncode == 0, plain.stderr
    rows = [[float(x) for x in line.split()] for line in plain.stdout.splitlines()]
    assert len(rows) == 2 and all(len(r) == 32 for r in rows)
    as_json = dynalm("embed", str(bert_gguf), *texts, "--json", "--cpu", home=tmp_path)
    body = json.loads(as_json.stdout)
    assert body["tokens"] == [4, 5]  # [CLS] ... [SEP]
    np.testing.assert_allclose(body["embeddings"], rows, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(body["embeddings"], axis=1), 1.0, atol=1e-5)
    piped = dynalm("embed", str(bert_gguf), "-", "--json", "--cpu", stdin="\n".join(texts) + "\n",
                   home=tmp_path)  # fmt: skip
    assert json.loads(piped.stdout)["embeddings"] == body["embeddings"]


def test_too_long_is_one_error_line_unless_truncate(bert_gguf: Path, tmp_path: Path) -> None:
    long = " ".join(["cat"] * 40)
    refused = dynalm("embed", str(bert_gguf), "cat", long, "--cpu", home=tmp_path)
    assert_one_line_error(refused, "input[1] has 42 tokens", "maximum length 32")
    cut = dynalm("embed", str(bert_gguf), long, "--truncate", "--json", "--cpu", home=tmp_path)
    assert json.loads(cut.stdout)["tokens"] == [32]


def test_a_generation_model_cannot_embed(smollm2_gguf: Path, tmp_path: Path) -> None:
    result = dynalm("embed", str(smollm2_gguf), "hi", "--cpu", home=tmp_path)
    assert_one_line_error(result, "is a generation model (llama); it has no embedding output")
