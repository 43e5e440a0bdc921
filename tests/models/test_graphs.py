"""DynaIR graphs of every family: built exactly as pinned in ``graphs/*.dynair``, and
their text reads back to the same graph, before and after the passes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from graph_cases import CASES, GRAPHS, PINNED, case_path, gemma3_270m_layout

from dynalm.errors import ModelFormatError
from dynalm.ir.graph import Graph, TensorType
from dynalm.ir.passes import optimize, verify
from dynalm.ir.text import parse_graph, print_graph
from dynalm.models.arch import build_graph
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hparams import read_hparams
from dynalm.models.loader import _check_kv_geometry, model_graph


@pytest.fixture(scope="module")
def graph_of(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Graph]:
    """Case name -> the graph its family's ``.lum`` builds (before the passes), built once."""
    tmp = tmp_path_factory.mktemp("graphs")

    @cache
    def build(name: str) -> Graph:
        with GGUFFile(case_path(name, smollm2_gguf, tmp)) as gguf:
            hp = read_hparams(gguf.metadata, {n: t.shape for n, t in gguf.tensors.items()})
            return model_graph(gguf, hp)

    return build


@pytest.mark.parametrize("name", PINNED)
def test_family_builds_the_pinned_graph(graph_of: Callable[[str], Graph], name: str) -> None:
    want = (GRAPHS / f"{name}.dynair").read_text()
    assert print_graph(graph_of(name)) + "\n" == want


@pytest.mark.parametrize("name", CASES)
def test_text_reads_back_before_and_after_the_passes(
    graph_of: Callable[[str], Graph], name: str
) -> None:
    graph = graph_of(name)
    optimized = optimize(graph)
    assert "split" in {n.op for n in optimized.nodes}  # merged weights and their splits
    assert any(n.attrs.get("view") for n in optimized.nodes)
    for g in (graph, optimized):
        text = print_graph(g)
        back = parse_graph(text)
        assert back == g
        verify(back)
        assert print_graph(back) == text


def test_gemma3_at_a_real_layout_builds_the_pinned_graph() -> None:
    """Gemma 3 270M's shapes (18 layers: 15 local, 3 global) from its metadata and tensor
    directory alone; its text was pinned from the Python builder like the others."""
    metadata, layout = gemma3_270m_layout()
    hp = read_hparams(metadata, {n: s for n, (_, s) in layout.items()})
    graph = build_graph(hp, metadata, {n: TensorType(d, s) for n, (d, s) in layout.items()})
    assert print_graph(graph) + "\n" == (GRAPHS / "gemma3-270m-layout.dynair").read_text()
    optimized = optimize(graph)
    assert parse_graph(print_graph(optimized)) == optimized


def test_attention_must_fit_the_kv_cache_of_the_checked_hyper_parameters(
    smollm2_gguf: Path,
) -> None:
    """The KV cache is sized from read_hparams; a family file whose attention disagreed
    with them (here: the file's graph checked against hyper-parameters that say 2 kv heads)
    is refused at load."""
    with GGUFFile(smollm2_gguf) as gguf:
        hp = read_hparams(gguf.metadata, {n: t.shape for n, t in gguf.tensors.items()})
        graph = model_graph(gguf, hp)
    with pytest.raises(ModelFormatError, match="does not fit the KV cache of 30 layers, 2"):
        _check_kv_geometry(graph, dataclasses.replace(hp, n_kv_heads=2))
