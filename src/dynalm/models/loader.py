"""Loading a model into a runnable model: weights, hyper-parameters, tokenizer, chat
template and the DynaIR graph of its forward pass. A model is a GGUF file, or a Hugging
Face directory of SafeTensors (``hf_dir.HFDirectory``, which reads like a GGUF file)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynalm.core.memory import trim_heap
from dynalm.errors import DynaError, ModelFormatError
from dynalm.ir.graph import Graph
from dynalm.ir.passes import gather_permuted_inputs, optimize
from dynalm.models.arch import build_graph, family_file, tensor_types
from dynalm.models.chat_template import ChatTemplate
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hf_dir import HFDirectory, read_json
from dynalm.models.hparams import HParams, read_hparams
from dynalm.models.tokenizer import Tokenizer

# Vocabulary-sized metadata that only the tokenizer reads.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


# A file changed this recently when opened may change again unseen (see GGUFWeights.source).
RACY_SECONDS = 2.0


class GGUFWeights:
    """The executor's view of a model file's tensors (memory-mapped, never copied; a
    GPTQ/AWQ layer of an ``HFDirectory`` is repacked when read)."""

    def __init__(self, gguf: GGUFFile | HFDirectory):
        self.gguf = gguf

    def raw(self, name: str) -> np.ndarray:
        return self.gguf.raw(name)

    def tensor_type(self, name: str) -> int:
        return self.gguf.tensors[name].ggml_type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.gguf.tensors[name].shape

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.gguf.read_rows(name, ids)

    def source(self, names: tuple[str, ...]) -> tuple[str, str] | None:
        """Where the rows of ``names`` (stacked) lie: the file's real path and their byte
        ranges; and the file's identity when it was opened (device, inode, size, mtime and
        ctime in ns: any change through the file system changes one). The repack cache's
        key (``kernel.repack_cache``). ``None`` (not cached) for a file changed less than
        ``RACY_SECONDS`` before it was opened: a write within the same timestamp tick
        (file systems keep coarse clocks) would leave its identity as it is."""
        st, infos = self.gguf.stat, [self.gguf.tensors[n] for n in names]
        if self.gguf.opened_at - st.st_ctime < RACY_SECONDS:
            return None
        if isinstance(self.gguf, HFDirectory):  # its shards are files of their own
            return self.gguf.source(names)
        where = (
            os.path.realpath(self.gguf.path)
            + "@"
            + ",".join(f"{t.offset}+{t.nbytes}" for t in infos)
        )
        return where, f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """The executor holds its own copy of ``name`` (or of its ``rows``) now: drop the
        mapped pages from RSS."""
        self.gguf.release_pages(name, rows)


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile | HFDirectory  # the model file (a SafeTensors directory reads as one)
    hparams: HParams
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    graph: Graph
    weights: GGUFWeights

    @property
    def name(self) -> str:
        return str(self.gguf.metadata.get("general.name") or self.path.stem)

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.gguf.tensors.values())

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.tokenizer.eog_ids | self.chat_template.stop_token_ids


def model_graph(gguf: GGUFFile | HFDirectory, hp: HParams) -> Graph:
    """The forward pass of a model file as its family builds it (before any fusing pass;
    act-order inputs gathered)."""
    types = tensor_types(gguf)
    graph = gather_permuted_inputs(build_graph(hp, gguf.metadata, types), types)
    _check_kv_geometry(graph, hp)
    return graph


def _check_kv_geometry(graph: Graph, hp: HParams) -> None:
    """The KV cache is sized from the checked hyper-parameters; a family's attention that
    disagreed with them would make the kernels write outside its pages."""
    for node in graph.nodes:
        if node.op != "attention":
            continue
        a = node.attrs
        if (a["n_kv_heads"], a["head_dim"]) != (hp.n_kv_heads, hp.head_dim) or not (
            0 <= a["layer"] < hp.n_layers
        ):
            raise ModelFormatError(
                f"layer {a['layer']}'s attention ({a['n_kv_heads']} kv heads of {a['head_dim']})"
                f" does not fit the KV cache of {hp.n_layers} layers, {hp.n_kv_heads} kv heads "
                f"of {hp.head_dim}"
            )


def _hf_tokenizer(d: HFDirectory, n_vocab: int) -> tuple[Tokenizer, ChatTemplate]:
    """A model directory's tokenizer and chat template (see ``Tokenizer.from_hf_files``)."""
    config = read_json(d.path / "tokenizer_config.json", required=False) or {}
    generation = read_json(d.path / "generation_config.json", required=False) or {}
    if not isinstance(config, dict) or not isinstance(generation, dict):
        raise ModelFormatError(f"{d.path}: tokenizer_config / generation_config not objects")
    eos = generation.get("eos_token_id", [])
    eos = [eos] if type(eos) is int else eos if isinstance(eos, list) else []
    tokenizer = Tokenizer.from_hf_files(
        d.path / "tokenizer.json", config, n_vocab, [i for i in eos if type(i) is int]
    )
    return tokenizer, ChatTemplate.from_hf_directory(d.path, config, d.arch, tokenizer)


def load_model(path: str | os.PathLike, pooling: int | None = None) -> LoadedModel:
    """Read and check a GGUF file or a SafeTensors model directory. Everything it says is
    checked here (metadata types and ranges, hyper-parameters against the tensor shapes,
    the tokenizer), before any kernel or buffer is sized from it; an error names the file
    and what in it is wrong. ``pooling`` (llama.cpp's numbers: 1 mean, 2 first, 3 last
    token) stands for the file's ``{arch}.pooling_type``: a decoder loaded so is an
    embedding model (``--pooling``)."""
    gguf = HFDirectory(path) if Path(path).is_dir() else GGUFFile(path)
    try:
        meta = gguf.metadata
        family_file(gguf.architecture)  # refuse unknown architectures before anything else
        if pooling is not None:
            meta[f"{gguf.architecture}.pooling_type"] = pooling
        hp = read_hparams(meta, {name: t.shape for name, t in gguf.tensors.items()})
        graph = optimize(model_graph(gguf, hp))  # fused ops for the executor
        if isinstance(gguf, HFDirectory):
            tokenizer, template = _hf_tokenizer(gguf, hp.n_vocab)
        else:
            tokenizer = Tokenizer.from_gguf_metadata(meta)
            template = ChatTemplate.from_gguf_metadata(meta, tokenizer)
        for key in _TOKENIZER_ARRAYS:  # the tokenizer holds them now (20 MB at 262k tokens)
            meta.pop(key, None)
        trim_heap()  # and the temporaries of its build
    except DynaError as e:
        gguf.close()
        if str(gguf.path) in str(e):
            raise
        raise type(e)(f"{gguf.path}: {e}") from e
    except BaseException:
        gguf.close()
        raise
    return LoadedModel(Path(path), gguf, hp, tokenizer, template, graph, GGUFWeights(gguf))
