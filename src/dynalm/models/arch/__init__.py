"""Architectures: one ``.lum`` file per family in this folder (see ``docs/lumen.md``).

A file's first ``family`` line names the GGUF architectures it serves. To add a family,
write its ``.lum`` file here (and a test against transformers); if it needs an op DynaIR
lacks, add the op to ``dynalm.ir.ops`` and its kernels first.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

from dynalm.core.quant import tensor_type_name
from dynalm.errors import UnsupportedModel, show
from dynalm.ir.graph import Graph, TensorType
from dynalm.ir.lumen import Elaborator, Program, load_file
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hf_dir import HFDirectory

ARCH_DIR = Path(__file__).parent
_FAMILY = re.compile(r"^family\s+(.+)$", re.MULTILINE)


@cache
def family_files() -> dict[str, Path]:
    """GGUF architecture name -> the ``.lum`` file that builds it (read from the files'
    ``family`` lines without parsing them)."""
    files: dict[str, Path] = {}
    for path in sorted(ARCH_DIR.glob("*.lum")):
        found = _FAMILY.search(path.read_text())
        for name in found.group(1).split("#")[0].split(",") if found else ():
            files[name.strip()] = path
    return files


def family_file(arch: str) -> Path:
    files = family_files()
    if arch not in files:
        raise UnsupportedModel(
            f"unknown architecture {show(arch)} (supported: {', '.join(sorted(files))})"
        )
    return files[arch]


@cache
def family_program(path: Path) -> Program:
    return load_file(path)


def tensor_types(gguf: GGUFFile | HFDirectory) -> dict[str, TensorType]:
    """A model file's tensor directory as DynaIR types (stored dtype, shape)."""
    return {n: TensorType(tensor_type_name(t.ggml_type), t.shape) for n, t in gguf.tensors.items()}


def build_graph(arch: str, metadata: dict[str, Any], weight_types: dict[str, TensorType]) -> Graph:
    """The forward pass of a model of architecture ``arch``, from its family's ``.lum``."""
    return Elaborator(family_program(family_file(arch)), arch, metadata, weight_types).run()


def check_file(path: Path, model: Path | None = None) -> str:
    """``dynalm check``: parse and check a ``.lum`` file; with ``model``, also elaborate it
    against that GGUF file's metadata and tensor types and verify the graph. Returns a
    summary line; a fault raises a one-line error naming ``file:line:col``."""
    from dynalm.ir.passes import verify

    program = load_file(path)
    summary = (
        f"{path}: ok (family {', '.join(program.families)}; {len(program.params)} parameters, "
        f"{len(program.fns)} functions)"
    )
    if model is None:
        return summary
    with GGUFFile(model) as gguf:
        arch = gguf.architecture
        if arch not in program.families:
            raise UnsupportedModel(
                f"{model} is a {show(arch)} model; {path} builds {', '.join(program.families)}"
            )
        graph = Elaborator(program, arch, gguf.metadata, tensor_types(gguf)).run()
    verify(graph)
    return f"{summary}; {model}: a graph of {len(graph.nodes)} nodes"
