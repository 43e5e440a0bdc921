"""Architectures: one ``.lum`` file per family in this folder (see ``docs/lumen.md``).

A file's first ``family`` line names the GGUF architectures it serves. The model's
hyper-parameters (``models.hparams.HParams``: ``n_layers``, ``n_kv_heads``, ``norm_eps``, ...)
are read once, checked, and given to every file (RFC 005); a file declares only its own. To
add a family, write its ``.lum`` file here (and a test against transformers); if it needs an
op DynaIR lacks, add the op to ``dynalm.ir.ops`` and its kernels first.
"""

from __future__ import annotations

import dataclasses
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
from dynalm.models.hparams import HParams, read_hparams

ARCH_DIR = Path(__file__).parent
GIVEN = frozenset(f.name for f in dataclasses.fields(HParams))  # what every file may read
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
    return load_file(path, GIVEN)


def tensor_types(gguf: GGUFFile | HFDirectory) -> dict[str, TensorType]:
    """A model file's tensor directory as DynaIR types (stored dtype, shape)."""
    return {n: TensorType(tensor_type_name(t.ggml_type), t.shape) for n, t in gguf.tensors.items()}


def build_graph(
    hp: HParams, metadata: dict[str, Any], weight_types: dict[str, TensorType]
) -> Graph:
    """The forward pass of a model of hyper-parameters ``hp``, from its family's ``.lum``."""
    return _elaborate(family_program(family_file(hp.arch)), hp, metadata, weight_types)


def _elaborate(
    program: Program, hp: HParams, metadata: dict[str, Any], weight_types: dict[str, TensorType]
) -> Graph:
    given = dataclasses.asdict(hp)
    graph = Elaborator(program, hp.arch, metadata, weight_types, given).run()
    yarn = any(n.op == "rope" and "ext_factor" in n.attrs for n in graph.nodes)
    if hp.rope_scaling == "yarn" and not yarn:  # the family's rope would scale linearly
        raise UnsupportedModel(
            f"rope scaling type yarn (factor {hp.rope_scale:g}) is not supported for "
            f"architecture {show(hp.arch)} yet (its family file has no YaRN rope)"
        )
    return graph


def check_file(path: Path, model: Path | None = None) -> str:
    """``dynalm check``: parse and check a ``.lum`` file; with ``model``, also elaborate it
    against that GGUF file's metadata and tensor types and verify the graph. Returns a
    summary line; a fault raises a one-line error naming ``file:line:col``."""
    from dynalm.ir.passes import verify

    program = load_file(path, GIVEN)
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
        hp = read_hparams(gguf.metadata, {n: t.shape for n, t in gguf.tensors.items()})
        graph = _elaborate(program, hp, gguf.metadata, tensor_types(gguf))
    verify(graph)
    return f"{summary}; {model}: a graph of {len(graph.nodes)} nodes"
