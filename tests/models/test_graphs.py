"""DynaIR graphs of every family: built exactly as pinned in ``graphs/*.dynair``, and
their text reads back to the same graph, before and after the passes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from graph_cases import CASES, GRAPHS, case_path

from dynalm.ir.graph import Graph
from dynalm.ir.passes import optimize, verify
from dynalm.ir.text import parse_graph, print_graph
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hparams import read_hparams
from dynalm.models.loader import model_graph


@pytest.fixture(scope="module", params=CASES)
def built(
    request: pytest.FixtureRequest, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Graph]]:
    path = case_path(request.param, smollm2_gguf, tmp_path_factory.mktemp("graphs"))
    gguf = GGUFFile(path)
    try:
        hp = read_hparams(gguf.metadata, {n: t.shape for n, t in gguf.tensors.items()})
        yield request.param, model_graph(gguf, hp)
    finally:
        gguf.close()


def test_family_builds_the_pinned_graph(built: tuple[str, Graph]) -> None:
    name, graph = built
    want = (GRAPHS / f"{name}.dynair").read_text()
    assert print_graph(graph) + "\n" == want


def test_text_reads_back_before_and_after_the_passes(built: tuple[str, Graph]) -> None:
    _, graph = built
    optimized = optimize(graph)
    assert "split" in {n.op for n in optimized.nodes}  # merged weights and their splits
    assert any(n.attrs.get("view") for n in optimized.nodes)
    for g in (graph, optimized):
        text = print_graph(g)
        back = parse_graph(text)
        assert back == g
        verify(back)
        assert print_graph(back) == text
