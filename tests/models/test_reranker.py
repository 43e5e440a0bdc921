"""The reranker (a cross-encoder: ``bert.lum`` with its classification head): a tiny random
``BertForSequenceClassification`` written as llama.cpp's converter writes it (``tiny_bert``),
scored by DynaLM against transformers' logits; the pair's tokens and token types against
transformers' BertTokenizer; the document cut at the maximum length; and the same file read
by llama.cpp (llama-cpp-python, rank pooling)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_bert

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import InvalidRequest, UnsupportedModel
from dynalm.ir.passes import optimize, verify
from dynalm.ir.text import parse_graph, print_graph
from dynalm.models.loader import load_model, model_graph
from dynalm.runtime.embed import Embedder, Reranker, relevance
from dynalm.runtime.engine.engine import Engine

QUERY = "the cat sat"
DOCS = ["hello world!", "the cat sat on the mat.", "dog", "embedding xyz", "a b c", "Cat?"]
TOLERANCE = 1e-4  # the bound on a score against the reference's


@pytest.fixture(scope="module")
def reranker_model() -> tiny_bert.BertForSequenceClassification:
    return tiny_bert.reference_reranker()


@pytest.fixture(scope="module")
def files(reranker_model, tmp_path_factory) -> dict[bool, Path]:
    """pooler False: the converter's file (bert.pooler.dense dropped); True: kept as cls."""
    d = tmp_path_factory.mktemp("reranker")
    return {
        pooler: tiny_bert.write_gguf(reranker_model, d / f"pooler-{pooler}.gguf", pooler=pooler)
        for pooler in (False, True)
    }


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize("pooler", [False, True], ids=["converter", "with-pooler"])
def test_scores_match_transformers(reranker_model, files, pooler: bool, mode: str) -> None:
    r = Reranker(load_model(files[pooler]), backend="cpu", mode=mode)
    ids, types = r.pairs(QUERY, DOCS)
    ref = tiny_bert.reference_scores(reranker_model, list(zip(ids, types, strict=True)), pooler)
    got = r.score(QUERY, DOCS)
    assert np.abs(got - ref).max() <= TOLERANCE, (got, ref)
    assert list(np.argsort(-got, kind="stable")) == list(np.argsort(-ref, kind="stable"))
    assert len(set(np.round(ref, 3))) == len(DOCS)  # distinct scores: the order means something


def test_a_squeezed_head_reads_as_its_matrix(reranker_model, tmp_path: Path) -> None:
    """cls.output.weight written as [d] (converters that squeeze, as published GGUFs of
    BERT rerankers have it): read as ggml reads it, [1, d], the same scores."""
    path = tiny_bert.write_gguf(reranker_model, tmp_path / "sq.gguf", pooler=True, squeeze=True)
    model = load_model(path)
    assert model.gguf.tensors["cls.output.weight"].shape == (32,)
    r = Reranker(model, backend="cpu", mode="exact")
    ids, types = r.pairs(QUERY, DOCS)
    ref = tiny_bert.reference_scores(reranker_model, list(zip(ids, types, strict=True)))
    assert np.abs(r.score(QUERY, DOCS) - ref).max() <= TOLERANCE


def test_pairs_are_tokenised_as_transformers_does(files, tmp_path: Path) -> None:
    """[CLS] query [SEP] document [SEP], token types 0 then 1: BertTokenizer's pair."""
    ref = tiny_bert.reference_tokenizer(tmp_path)
    r = Reranker(load_model(files[False]), backend="cpu", mode="exact")
    ids, types = r.pairs(QUERY, DOCS)
    for i, doc in enumerate(DOCS):
        enc = ref(QUERY, doc)
        assert (ids[i], types[i]) == (enc["input_ids"], enc["token_type_ids"])


def test_a_long_document_is_refused_naming_it_or_cut(reranker_model, files) -> None:
    r = Reranker(load_model(files[True]), backend="cpu", mode="exact")
    long = " ".join(["cat"] * 40)  # 40 tokens + the query's 5 + [SEP]: past 32 positions
    docs = ["dog", long]
    with pytest.raises(InvalidRequest, match=r"documents\[1\] with the query has 46 tokens, "
                       r"more than the model's maximum length 32 \(ask for truncate"):  # fmt: skip
        r.pairs(QUERY, docs)
    ids, types = r.pairs(QUERY, docs, truncate=True)
    assert len(ids[1]) == 32 and ids[1][-1] == ids[0][-1]  # cut to fit, [SEP] kept
    ref = tiny_bert.reference_scores(reranker_model, list(zip(ids, types, strict=True)))
    assert np.abs(r.score(QUERY, docs, truncate=True) - ref).max() <= TOLERANCE
    with pytest.raises(InvalidRequest, match="query has 42 tokens, which leaves no room"):
        r.pairs(long, ["dog"])


def test_empty_query_or_document_is_refused(files) -> None:
    r = Reranker(load_model(files[False]), backend="cpu", mode="exact")
    with pytest.raises(InvalidRequest, match="query is an empty string"):
        r.pairs("", DOCS)
    with pytest.raises(InvalidRequest, match=r"documents\[2\] is an empty string"):
        r.pairs(QUERY, ["a", "b", ""])


def test_the_wrong_kind_of_model_is_refused(files, tmp_path: Path) -> None:
    """A reranker has no embedding output, an embedding model no classification head."""
    with pytest.raises(UnsupportedModel, match=r"is a reranker \(bert\); it has no embedding"):
        Embedder(load_model(files[False]), backend="cpu")
    encoder = tiny_bert.write_gguf(tiny_bert.reference_model(), tmp_path / "e.gguf", "cls")
    with pytest.raises(UnsupportedModel, match=r"is an embedding model \(bert\); it has no "
                       r"classification head"):  # fmt: skip
        Reranker(load_model(encoder), backend="cpu")


def test_the_engine_refuses_a_reranker(files) -> None:
    """dynalm run / bench / perplexity: a reranker generates no text, and is named one."""
    with pytest.raises(UnsupportedModel, match=r"is a reranker \(bert\): it cannot generate "
                       r"text \(dynalm rerank, or /v1/rerank of dynalm serve\)"):  # fmt: skip
        Engine(load_model(files[False]), CpuDevice())


def test_relevance_is_the_sigmoid_of_the_logit() -> None:
    assert relevance(0.0) == 0.5
    assert relevance(2.0) == pytest.approx(1 / (1 + np.exp(-2.0)), abs=1e-15)
    assert relevance(-800.0) == 0.0 and relevance(800.0) == 1.0  # no overflow


def test_llama_cpp_reads_the_file_and_ranks_alike(reranker_model, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, rank pooling) loads the files (without and with the
    pooler, the head squeezed to [d]) and scores each text as
    DynaLM does. llama.cpp gives every token type 0 and a tanh GELU, so the inputs are
    single texts (all of sentence A) and the bound is looser than transformers'."""
    llama_cpp = pytest.importorskip("llama_cpp")
    texts = ["hello world!", "the cat sat on the mat.", "dog", "xyz q"]
    for pooler, squeeze in ((False, False), (True, False), (False, True)):
        # a bos id: llama.cpp's tokenizer wants one (BERT's 101 is past this tiny vocabulary)
        path = tiny_bert.write_gguf(reranker_model, tmp_path / f"{pooler}-{squeeze}.gguf",
                                    pooler=pooler, squeeze=squeeze,
                                    metadata={"tokenizer.ggml.bos_token_id": 2})  # fmt: skip
        llm = llama_cpp.Llama(str(path), embedding=True, verbose=False, n_ctx=32,
                              pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK)  # fmt: skip
        theirs = np.array([llm.embed(t)[0] for t in texts])  # the score, then n_embd - 1 unset
        r = Reranker(load_model(path), backend="cpu", mode="exact")
        ids = [r.model.tokenizer.encode(t) for t in texts]
        assert ids == [llm.tokenize(t.encode()) for t in texts]
        ours = r.embed(ids)[:, 0]
        assert np.abs(ours - theirs).max() <= 2e-3, (ours, theirs)
        assert list(np.argsort(ours)) == list(np.argsort(theirs))
        llm.close()


@pytest.mark.parametrize("pooler", [False, True], ids=["converter", "with-pooler"])
def test_graph_of_the_head_reads_back(files, pooler: bool) -> None:
    """No pooling key and a classifier: llama.cpp's rank pooling, the [CLS] row (pool mode
    2) through cls + tanh when the file has it, then cls.output; the graph's output is
    ``scores``, one per pair; DynaIR text round trip before and after the passes."""
    model = load_model(files[pooler])
    graph = model_graph(model.gguf, model.hparams)
    assert list(graph.outputs) == ["scores"]
    assert graph.outputs["scores"].type.shape[1] == 1
    assert ("tanh" in {n.op for n in graph.nodes}) == pooler
    for g in (graph, optimize(graph)):
        back = parse_graph(print_graph(g))
        assert back == g
        verify(back)
    assert ", mode=2\n" in print_graph(graph)
