"""A Hugging Face model directory (what ``save_pretrained`` writes) presented as a GGUF file.

``config.json`` gives the architecture and hyper-parameters, written here under the GGUF
metadata keys llama.cpp's converter would write (so ``read_hparams`` and the families'
``.lum`` files read them as for a GGUF); the ``*.safetensors`` files (one, or the shards
of ``model.safetensors.index.json``) give the tensors, renamed to GGUF names with gguf-py's
own HF -> GGUF map. The tokenizer and chat template come from ``tokenizer.json``,
``tokenizer_config.json`` (and ``chat_template.jinja``, ``generation_config.json``).

Tensors in F32, F16 and BF16 are memory-mapped views, run by the same kernels as a GGUF's.
Llama's q/k rows are kept in HF's layout (rope pairs ``(i, i + d/2)``, "NeoX" order)
instead of being permuted into llama.cpp's adjacent pairs: the graph's rope is told so
(``dynalm.rope.neox``), which is the same arithmetic without a copy. GPTQ and AWQ layers
are repacked at load into Q4_0 / Q5_0 blocks (``gptq_awq``); an act-order layer also gets
an ``input_perm`` index tensor, which the graph applies to its input (``gather_cols``).
A mixture of experts' per-expert matrices (``experts.{e}.gate_proj``, ...) read as the
converter's stacked ``[expert, rows, cols]`` tensors, each expert still a view of its own
tensor, mapped only when a route first selects it. gpt-oss's stacked experts (dense, or the
released MXFP4 blocks and scales) are made one expert at a time in the converter's layout
(`hf_gpt_oss`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from dynalm.core.quant import QUANT_FORMATS
from dynalm.errors import ModelFormatError, ModelNotFound, UnsupportedModel, show
from dynalm.files import read_source
from dynalm.models import gptq_awq, hf_gpt_oss
from dynalm.models.gguf_file import TensorInfo
from dynalm.models.safetensors_file import SafeTensor, SafeTensorsFile

INDEX_FILE = "model.safetensors.index.json"
NEOX_KEY = "dynalm.rope.neox"  # rope over HF's (i, i + d/2) pairs (see the module doc)
_T = GGMLQuantizationType

# config.json model_type -> (GGUF architecture, gguf-py's MODEL_ARCH)
ARCHITECTURES: dict[str, tuple[str, gguf.MODEL_ARCH]] = {
    "llama": ("llama", gguf.MODEL_ARCH.LLAMA),
    "mistral": ("llama", gguf.MODEL_ARCH.LLAMA),  # llama.cpp converts Mistral as llama
    "qwen2": ("qwen2", gguf.MODEL_ARCH.QWEN2),
    "qwen3": ("qwen3", gguf.MODEL_ARCH.QWEN3),
    "olmo2": ("olmo2", gguf.MODEL_ARCH.OLMO2),
    "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE),
    "olmoe": ("olmoe", gguf.MODEL_ARCH.OLMOE),
    "mixtral": ("llama", gguf.MODEL_ARCH.LLAMA),  # llama.cpp converts Mixtral as llama
    "gpt_oss": ("gpt-oss", gguf.MODEL_ARCH.GPT_OSS),
    "bert": ("bert", gguf.MODEL_ARCH.BERT),  # an encoder: see _sentence_transformers
}
# the families whose graphs read the YaRN keys (others refuse a YaRN config)
_YARN_GRAPHS = {"gpt-oss"}
# gpt-oss's stacked experts (`hf_gpt_oss`): (the layer's experts, the tensor)
_GPT_OSS_EXPERTS = re.compile(
    r"^(.+\.mlp\.experts)\.((?:gate_up|down)_proj(?:_bias|_blocks|_scales)?)$"
)
# the row halves of gpt-oss's gate_up_proj: even rows the gate, odd the up (all: down_proj)
_HALVES = {"gate": slice(0, None, 2), "up": slice(1, None, 2), "down": slice(None)}
# one expert's matrix of a mixture of experts: (layer's experts, expert id, projection);
# Mixtral's w1, w2, w3 are gate, down and up
_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)\.weight$")
_MIXTRAL = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FLOAT_TYPES = {"F32": _T.F32, "F16": _T.F16, "BF16": _T.BF16}
# recomputed from rope_theta (as llama.cpp); BERT's position ids buffer and its pooler (a
# classifier's, unused for sentence embeddings: llama.cpp's converter leaves them out too)
_IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    "embeddings.position_ids",
    "pooler.dense.weight",
    "pooler.dense.bias",
)
# sentence-transformers' modules.json: what each module is to the graph (an encoder's
# pooling, its L2 normalisation); other modules (Dense, ...) are refused by name
_ST = "sentence_transformers.models."
# 1_Pooling/config.json's modes -> llama.cpp's pooling_type (mean 1, CLS 2, last 3)
_POOLING_MODES = {
    "pooling_mode_mean_tokens": 1,
    "pooling_mode_cls_token": 2,
    "pooling_mode_lasttoken": 3,
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
NORMALIZE_KEY = "dynalm.embed.normalize"  # an encoder's output is L2-normalised (bert.lum)
MAX_LENGTH_KEY = "dynalm.embed.max_length"  # sentence_bert_config.json's max_seq_length
# config.json, tokenizer_config.json, an index: a few KB to a few MB (an index of many shards)
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path, required: bool = True) -> Any:
    """A JSON file's value (None when absent and not ``required``); errors name the file.
    Only a regular file of at most ``MAX_JSON_BYTES`` is read (a FIFO is refused, not
    waited on)."""
    try:
        return json.loads(read_source(path, MAX_JSON_BYTES, ModelFormatError))
    except FileNotFoundError:
        if required:
            raise ModelNotFound(f"{path}: no such file") from None
        return None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFormatError(f"{path}: not a valid JSON file ({show(str(e), 120)})") from None


@dataclass(frozen=True)
class _Source:
    """Where a GGUF-named tensor comes from: one SafeTensors tensor (``tensor``), the parts
    of a GPTQ/AWQ layer (``layer``: its HF name prefix), or a layer's ``input_perm``."""

    shard: SafeTensorsFile | None = None
    tensor: SafeTensor | None = None
    layer: str | None = None
    perm_of: str | None = None
    experts: tuple[tuple[SafeTensorsFile, SafeTensor], ...] = ()  # one per expert, in order
    # gpt-oss: expert e's bytes made from ``stacks`` (HF tensors ``[E, ...]``) by ``expert``
    stacks: tuple[tuple[SafeTensorsFile, SafeTensor], ...] = ()
    expert: Callable[[int], np.ndarray] | None = None
    made: Callable[[], np.ndarray] | None = None  # a small tensor made on each read


class _Experts:
    """A layer's stacked experts ``[E, N, row bytes]`` as `HFDirectory.raw` gives them:
    ``stack[e]`` is expert e's alone (``expert(e)``: a view of its own tensor in the file,
    or gpt-oss's made from its slice of the stack), so an expert never routed to is never
    read; ``np.asarray(stack)`` stacks them all (a copy)."""

    def __init__(self, shape: tuple[int, int, int], expert: Callable[[int], np.ndarray]):
        self.shape, self._expert = shape, expert
        self.dtype, self.ndim = np.dtype(np.uint8), 3

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: object) -> np.ndarray:
        if isinstance(e, (int, np.integer)):
            if not -len(self) <= e < len(self):
                raise IndexError(f"expert {e} of {len(self)}")
            return self._expert(int(e) % len(self))
        return np.asarray(self)[e]

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        stacked = np.stack([self[e] for e in range(len(self))])
        return stacked if dtype is None else stacked.astype(dtype)


def _identity(shard: SafeTensorsFile) -> str:
    """A shard's identity as the file system reports it when opened (any change to it
    changes one of them: see ``kernel.repack_cache``)."""
    st = shard.stat
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


@functools.cache
def _made_version() -> str:
    """A hash of the code that makes experts' bytes from a directory's stacks (this module
    and ``hf_gpt_oss``): a cached repack of them is stale when it changes."""
    code = b"".join(Path(f).read_bytes() for f in (__file__, hf_gpt_oss.__file__))
    return hashlib.sha256(code).hexdigest()[:16]


class HFDirectory:
    """An open model directory, with ``GGUFFile``'s reading interface: ``metadata`` (GGUF
    keys), ``tensors`` (GGUF names, ``TensorInfo``), ``raw``, ``read_rows``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.stat, self.opened_at = self.path.stat(), time.time()
        self.config_path = self.path / "config.json"
        self.config = read_json(self.config_path)
        if not isinstance(self.config, dict):
            raise ModelFormatError(f"{self.config_path}: {show(self.config)} is not an object")
        self.shards: dict[str, SafeTensorsFile] = {}
        try:
            self._hf = self._open_shards()
            self.arch, model_arch = self._architecture()
            example = next((n for n in self._hf if n.endswith(".qweight")), "no qweight")
            self.quant = None
            if not self._native_mxfp4():
                self.quant = gptq_awq.read_quant_config(self.config, str(self.config_path), example)
            self.metadata = self._metadata()
            self.tensors: dict[str, TensorInfo] = {}
            self._sources: dict[str, _Source] = {}
            self._map_tensors(model_arch)
        except BaseException:
            self.close()
            raise

    # -- files -------------------------------------------------------------------
    def _open_shards(self) -> dict[str, tuple[SafeTensorsFile, SafeTensor]]:
        """Every tensor of the checkpoint by HF name, with its file."""
        index = read_json(self.path / INDEX_FILE, required=False)
        if index is not None:
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise ModelFormatError(f"{self.path / INDEX_FILE}: no weight_map of file names")
            files = sorted(set(weight_map.values()))
            for f in files:
                if Path(f).name != f or not f.endswith(".safetensors"):
                    raise ModelFormatError(f"{self.path / INDEX_FILE}: bad shard name {show(f)}")
                if not (self.path / f).is_file():
                    holds = next(n for n, g in weight_map.items() if g == f)
                    raise ModelNotFound(
                        f"{self.path / f}: shard missing (it holds {show(holds)}, "
                        f"named in {INDEX_FILE})"
                    )
        else:
            weight_map = None
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise ModelNotFound(f"{self.path}: no *.safetensors files (and no {INDEX_FILE})")
        found: dict[str, tuple[SafeTensorsFile, SafeTensor]] = {}
        for f in files:
            shard = self.shards[f] = SafeTensorsFile(self.path / f)
            for name, t in shard.tensors.items():
                if name in found:
                    raise ModelFormatError(
                        f"{shard.path}: tensor {show(name)} is also in {found[name][0].path}"
                    )
                if weight_map is not None and weight_map.get(name) != f:
                    raise ModelFormatError(
                        f"{shard.path}: tensor {show(name)} is not in this file by {INDEX_FILE}"
                    )
                found[name] = (shard, t)
        for name, f in (weight_map or {}).items():
            if name not in found:
                raise ModelFormatError(f"{self.path / f}: has no tensor {show(name)}")
        return found

    def _architecture(self) -> tuple[str, gguf.MODEL_ARCH]:
        model_type = self.config.get("model_type")
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            names = self.config.get("architectures")
            raise UnsupportedModel(
                f"{self.config_path}: unknown architecture {show(model_type)} "
                f"({show(names)}; supported from SafeTensors: {', '.join(ARCHITECTURES)})"
            )
        return ARCHITECTURES[model_type]

    def _native_mxfp4(self) -> bool:
        """A released gpt-oss's ``quantization_config`` (quant_method mxfp4): its experts'
        blocks and scales are read as GGUF MXFP4 blocks (`hf_gpt_oss`), not dequantised."""
        qc = self.config.get("quantization_config")
        return self.arch == "gpt-oss" and isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"

    # -- hyper-parameters ------------------------------------------------------------
    def _metadata(self) -> dict[str, Any]:
        """config.json as the GGUF keys llama.cpp's converter writes."""
        c, arch = self.config, self.arch
        meta: dict[str, Any] = {
            "general.architecture": arch,
            "general.name": self.path.name,
        }
        keys = {
            "context_length": "max_position_embeddings",
            "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.layer_norm_rms_epsilon": "rms_norm_eps",
            "attention.layer_norm_epsilon": "layer_norm_eps",
        }
        for key, name in keys.items():
            if c.get(name) is not None:
                meta[f"{arch}.{key}"] = c[name]
        if c.get("head_dim") is not None:
            meta[f"{arch}.attention.key_length"] = c["head_dim"]
            meta[f"{arch}.attention.value_length"] = c["head_dim"]
        rope = c.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ModelFormatError(f"{self.config_path}: rope_parameters {show(rope)}")
        theta = c.get("rope_theta", rope.get("rope_theta"))
        if theta is not None:
            meta[f"{arch}.rope.freq_base"] = theta
        scaling = c.get("rope_scaling") or rope
        if not isinstance(scaling, dict):
            raise ModelFormatError(
                f"{self.config_path}: rope_scaling {show(scaling)} is not an object"
            )
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            meta[f"{arch}.rope.scaling.type"] = "linear"
            meta[f"{arch}.rope.scaling.factor"] = scaling.get("factor")
        elif kind == "yarn" and arch in _YARN_GRAPHS:
            meta.update(hf_gpt_oss.yarn(scaling, self.config_path, arch))
        elif kind != "default":
            raise UnsupportedModel(
                f"{self.config_path}: rope scaling {show(kind)} is not supported yet"
            )
        partial = c.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise UnsupportedModel(
                f"{self.config_path}: partial_rotary_factor = {show(partial)} is not supported"
            )
        if arch == "llama":
            meta[NEOX_KEY] = True
        meta.update(self._experts_metadata())
        if arch == "gpt-oss":
            meta.update(hf_gpt_oss.metadata(c, self.config_path, arch))
        if arch == "bert":
            kind = c.get("position_embedding_type", "absolute")
            if kind != "absolute":
                raise UnsupportedModel(
                    f"{self.config_path}: position_embedding_type {show(kind)} is not supported "
                    "(absolute only)"
                )
            meta.update(self._sentence_transformers())
        return meta

    def _experts_metadata(self) -> dict[str, Any]:
        """A mixture of experts' counts as the converter writes them (``TextModel.
        set_gguf_parameters``, ``Qwen2MoeModel``), and whether the chosen experts' weights
        are renormalised (``norm_topk_prob``, which the converter leaves out: llama.cpp's
        graphs fix it per family, as the families' .lum files do without the key)."""
        c, arch = self.config, self.arch
        count = c.get("num_local_experts", c.get("num_experts"))
        if count is None:
            return {}
        meta: dict[str, Any] = {f"{arch}.expert_count": count}
        if c.get("num_experts_per_tok") is not None:
            meta[f"{arch}.expert_used_count"] = c["num_experts_per_tok"]
        if c.get("moe_intermediate_size") is not None:
            meta[f"{arch}.expert_feed_forward_length"] = c["moe_intermediate_size"]
        if c.get("norm_topk_prob") is not None:
            meta[f"{arch}.expert_weights_norm"] = c["norm_topk_prob"]
        dense = c.get("mlp_only_layers") or []
        if c.get("decoder_sparse_step", 1) != 1 or dense:
            raise UnsupportedModel(
                f"{self.config_path}: dense layers among the experts (mlp_only_layers "
                f"{show(dense)}, decoder_sparse_step {show(c.get('decoder_sparse_step'))}) "
                "are not supported"
            )
        return meta

    def _sentence_transformers(self) -> dict[str, Any]:
        """An encoder's pooling, normalisation and maximum length as sentence-transformers
        reads them (``modules.json``, its Pooling module's ``config.json``,
        ``sentence_bert_config.json``), as GGUF keys; none without ``modules.json``."""
        meta: dict[str, Any] = {}
        st_config = read_json(self.path / "sentence_bert_config.json", required=False)
        if st_config is not None:
            where = self.path / "sentence_bert_config.json"
            length = st_config.get("max_seq_length") if isinstance(st_config, dict) else None
            limit = self.config.get("max_position_embeddings")
            if length is not None:
                if type(length) is not int or not 0 < length <= (limit or length):
                    raise ModelFormatError(
                        f"{where}: max_seq_length = {show(length)}, expected an integer in "
                        f"[1, {limit}] (max_position_embeddings)"
                    )
                meta[MAX_LENGTH_KEY] = length
        modules_path = self.path / "modules.json"
        modules = read_json(modules_path, required=False)
        if modules is None:
            return meta
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelFormatError(f"{modules_path}: {show(modules)} is not a list of objects")
        meta[NORMALIZE_KEY] = False  # only a Normalize module normalises
        for i, module in enumerate(modules):
            kind, sub = module.get("type"), module.get("path", "")
            if not isinstance(kind, str) or not isinstance(sub, str):
                raise ModelFormatError(f"{modules_path}: module {i} {show(module)}")
            if kind == _ST + "Transformer" and sub in ("", "."):
                continue
            if kind == _ST + "Normalize":
                meta[NORMALIZE_KEY] = True
            elif kind == _ST + "Pooling":
                if Path(sub).name != sub or sub in ("", ".", ".."):  # a folder of this one
                    raise ModelFormatError(f"{modules_path}: module {i}'s path {show(sub)}")
                meta[f"{self.arch}.pooling_type"] = self._pooling(self.path / sub / "config.json")
            else:
                raise UnsupportedModel(
                    f"{modules_path}: module {i} ({show(kind)}, path {show(sub)}) is not "
                    "supported (Transformer at the root, Pooling, Normalize)"
                )
        return meta

    def _pooling(self, path: Path) -> int:
        config = read_json(path)
        if not isinstance(config, dict):
            raise ModelFormatError(f"{path}: {show(config)} is not an object")
        width = config.get("word_embedding_dimension", self.config.get("hidden_size"))
        if width != self.config.get("hidden_size"):
            raise ModelFormatError(
                f"{path}: word_embedding_dimension = {show(width)} but hidden_size is "
                f"{show(self.config.get('hidden_size'))}"
            )
        chosen = [m for m in _POOLING_MODES if config.get(m, False) is not False]
        if len(chosen) != 1 or config[chosen[0]] is not True or _POOLING_MODES[chosen[0]] is None:
            raise UnsupportedModel(
                f"{path}: pooling {show({m: config[m] for m in chosen})} is not supported "
                "(exactly one of pooling_mode_mean_tokens, pooling_mode_cls_token, "
                "pooling_mode_lasttoken true)"
            )
        return _POOLING_MODES[chosen[0]]

    # -- tensors -----------------------------------------------------------------
    def _map_tensors(self, model_arch: gguf.MODEL_ARCH) -> None:
        n_layers = self.config.get("num_hidden_layers")
        if type(n_layers) is not int or not 0 < n_layers < 10_000:
            raise ModelFormatError(f"{self.config_path}: num_hidden_layers = {show(n_layers)}")
        names = gguf.get_tensor_name_map(model_arch, n_layers)
        layers: dict[str, dict[str, str]] = {}  # quantised layer -> part -> HF name
        experts: dict[str, dict[int, str]] = {}  # stacked name -> expert id -> HF name
        gpt_oss: dict[str, dict[str, str]] = {}  # a layer's experts -> tensor -> HF name
        for hf_name, (shard, t) in self._hf.items():
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.arch == "gpt-oss" and (m := _GPT_OSS_EXPERTS.match(hf_name)) is not None:
                gpt_oss.setdefault(m[1], {})[m[2]] = hf_name
                continue
            mapped = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's as Qwen-MoE's
            if self.arch == "gpt-oss" and mapped.endswith(".self_attn.sinks"):
                mapped += ".weight"  # as the converter names them
            if (m := _EXPERT.match(mapped)) is not None:
                stacked = f"{m[1]}.{_MIXTRAL.get(m[3], m[3])}.weight"
                experts.setdefault(stacked, {})[int(m[2])] = hf_name
                continue
            stem, _, part = hf_name.rpartition(".")
            if self.quant is not None and part in gptq_awq.PARTS:
                layers.setdefault(stem, {})[part] = hf_name
                continue
            name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UnsupportedModel(
                    f"{shard.path}: tensor {show(hf_name)} has no place in a {self.arch} model"
                )
            if t.dtype not in _FLOAT_TYPES:
                raise UnsupportedModel(
                    f"{shard.path}: tensor {show(hf_name)} has dtype {t.dtype} "
                    "(DynaLM runs F32, F16, BF16, and GPTQ/AWQ 4-bit layers)"
                )
            self._add(name, t.shape, _FLOAT_TYPES[t.dtype], _Source(shard, t))
        for stem, parts in layers.items():
            self._add_quantised(names, stem, parts)
        for stacked, by_id in experts.items():
            self._add_experts(names, stacked, by_id)
        for layer, parts in gpt_oss.items():
            self._add_gpt_oss_experts(names, layer, parts)

    def _add(self, name: str, shape: tuple[int, ...], ggml_type: int, src: _Source) -> None:
        if name in self.tensors:
            raise ModelFormatError(f"{self.path}: two tensors map to {name!r}")
        if not shape or 0 in shape:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has shape {list(shape)}")
        if ggml_type in QUANT_FORMATS:
            nbytes = math.prod(shape[:-1]) * QUANT_FORMATS[ggml_type].row_bytes(shape[-1])
        else:  # an index tensor (input_perm)
            nbytes = math.prod(shape) * 4
        offset = src.tensor.offset if src.tensor else 0
        self.tensors[name] = TensorInfo(name, tuple(shape), ggml_type, offset, nbytes)
        self._sources[name] = src

    def _add_experts(self, names: gguf.TensorNameMap, stacked: str, by_id: dict[int, str]) -> None:
        """One layer's experts of one projection, expert e's ``[N, K]`` matrix in HF tensor
        ``by_id[e]``, as the converter stacks them: one tensor ``[E, N, K]``."""
        parts = tuple(self._hf[by_id[e]] for e in sorted(by_id))
        shard, first = parts[0]
        if sorted(by_id) != list(range(len(by_id))):
            raise ModelFormatError(
                f"{shard.path}: the experts of {show(stacked)} are {sorted(by_id)}, "
                f"expected 0 to {len(by_id) - 1}"
            )
        for where, t in parts:
            if (t.dtype, t.shape) != (first.dtype, first.shape) or len(t.shape) != 2:
                raise ModelFormatError(
                    f"{where.path}: tensor {show(t.name)} is {t.dtype} {list(t.shape)}, "
                    f"expert 0's {first.dtype} {list(first.shape)}"
                )
        name = names.get_name(stacked, try_suffixes=(".weight",))
        if name is None:
            raise UnsupportedModel(
                f"{shard.path}: tensor {show(first.name)} has no place in a {self.arch} model"
            )
        if first.dtype not in _FLOAT_TYPES:
            raise UnsupportedModel(
                f"{shard.path}: tensor {show(first.name)} has dtype {first.dtype} "
                "(DynaLM runs experts in F32, F16, BF16)"
            )
        shape = (len(parts), *first.shape)
        self._add(name, shape, _FLOAT_TYPES[first.dtype], _Source(experts=parts))

    def _add_gpt_oss_experts(
        self, names: gguf.TensorNameMap, layer: str, parts: dict[str, str]
    ) -> None:
        """One gpt-oss layer's experts (``layer``: ``model.layers.N.mlp.experts``; ``parts``:
        its tensors by name, dense or MXFP4, `hf_gpt_oss`) as the converter's gate, up and
        down stacks ``[E, out, in]`` and their biases ``[E, out]``."""
        shard = self._hf[next(iter(parts.values()))][0]
        packed = any(p.endswith(("_blocks", "_scales")) for p in parts)
        want = hf_gpt_oss.expert_shapes(self.config, self.config_path, packed)
        layout = "MXFP4 blocks and scales" if packed else "save_pretrained's"
        extra = sorted(set(parts) - set(want))
        if extra:
            raise ModelFormatError(
                f"{shard.path}: tensor {show(f'{layer}.{extra[0]}')} does not belong with "
                f"{layout} experts ({', '.join(want)})"
            )
        found = {}
        for part, shape in want.items():
            if part not in parts:
                raise ModelFormatError(
                    f"{shard.path}: no tensor {show(f'{layer}.{part}')} ({layout} experts: "
                    f"{list(shape)} by {self.config_path.name})"
                )
            where, t = found[part] = self._hf[parts[part]]
            dtypes = ("U8",) if part.endswith(("_blocks", "_scales")) else tuple(_FLOAT_TYPES)
            if t.shape != shape or t.dtype not in dtypes:
                raise ModelFormatError(
                    f"{where.path}: tensor {show(t.name)} is {t.dtype} {list(t.shape)}, expected "
                    f"{'/'.join(dtypes)} {list(shape)} (by {self.config_path.name})"
                )
        stem = layer.rpartition(".")[0]  # model.layers.N.mlp: the converter's per-proj names
        for proj, half in _HALVES.items():
            source = "down_proj" if proj == "down" else "gate_up_proj"
            name = names.get_name(f"{stem}.experts.{proj}_proj.weight", try_suffixes=(".weight",))
            bias = names.get_name(f"{stem}.experts.{proj}_proj.bias", try_suffixes=(".bias",))
            assert name is not None and bias is not None, f"gpt-oss's map has no {stem} {proj}"
            b_shard, b = found[f"{source}_bias"]
            if proj == "down":
                self._add(bias, b.shape, _FLOAT_TYPES[b.dtype], _Source(b_shard, b))
            else:
                made = lambda b_shard=b_shard, b=b, half=half: np.ascontiguousarray(  # noqa: E731
                    b_shard.array(b.name)[:, half]
                ).view(np.uint8)
                shape = (b.shape[0], len(range(b.shape[1])[half]))
                self._add(bias, shape, _FLOAT_TYPES[b.dtype], _Source(made=made))
            if packed:
                stacks = (found[f"{source}_blocks"], found[f"{source}_scales"])
                (bs, blocks), (ss, scales) = stacks
                e, rows, groups, _ = blocks.shape
                shape = (e, len(range(rows)[half]), groups * hf_gpt_oss.BLOCK)

                def expert(i: int, bs=bs, blocks=blocks, ss=ss, scales=scales, half=half):
                    b, s = bs.array(blocks.name)[i][half], ss.array(scales.name)[i][half]
                    return hf_gpt_oss.mxfp4_rows(b, s)

                self._add(name, shape, _T.MXFP4, _Source(stacks=stacks, expert=expert))
            else:
                ws, w = found[source]
                e, n_in, n_out = w.shape  # each expert [in, out]: made [out, in]
                shape = (e, len(range(n_out)[half]), n_in)

                def expert(i: int, ws=ws, w=w, half=half):  # type: ignore[misc]
                    return np.ascontiguousarray(ws.array(w.name)[i][:, half].T).view(np.uint8)

                src = _Source(stacks=(found[source],), expert=expert)
                self._add(name, shape, _FLOAT_TYPES[w.dtype], src)

    def _add_quantised(self, names: gguf.TensorNameMap, stem: str, parts: dict[str, str]) -> None:
        assert self.quant is not None
        shard = self._hf[parts.get("qweight", next(iter(parts.values())))][0]
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise ModelFormatError(f"{shard.path}: {stem} has no {', '.join(missing)}")
        base = names.get_name(stem)
        if base is None:
            raise UnsupportedModel(
                f"{shard.path}: tensor {show(parts['qweight'])} has no place in a {self.arch} model"
            )
        found = {part: (self._hf[n][1].dtype, self._hf[n][1].shape) for part, n in parts.items()}
        group = self.quant.group_size
        try:
            n_out, n_in = gptq_awq.layer_shape(self.quant.method, stem, found, group)
            if "g_idx" in parts:  # read alone (one int per input column), not the weight
                shard, _ = self._hf[parts["g_idx"]]
                g_idx = gptq_awq.group_index(stem, shard.array(parts["g_idx"]), n_in, group)
        except ModelFormatError as e:
            raise ModelFormatError(f"{shard.path}: {e}") from None
        self._add(f"{base}.weight", (n_out, n_in), self.quant.ggml_type, _Source(layer=stem))
        # g_idx, not desc_act, says whether the groups are permuted: repack sorts the columns
        # by it, so the input must be gathered the same way whatever the config claims
        if "g_idx" in parts and gptq_awq.input_perm(g_idx) is not None:
            self._add(f"{base}.input_perm", (n_in,), _T.I32, _Source(perm_of=stem))

    def _unpacked(self, stem: str) -> gptq_awq.Unpacked:
        assert self.quant is not None
        arrays = {}
        for part in gptq_awq.PARTS:
            if f"{stem}.{part}" in self._hf:
                shard, _ = self._hf[f"{stem}.{part}"]
                arrays[part] = shard.array(f"{stem}.{part}")
        if arrays["scales"].dtype == np.uint16:  # BF16 words
            arrays["scales"] = (arrays["scales"].astype(np.uint32) << 16).view(np.float32)
        return gptq_awq.unpack(self.quant.method, stem, arrays, self.quant.group_size)

    # -- reading (GGUFFile's interface) --------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.arch

    def raw(self, name: str) -> np.ndarray:
        """uint8 ``[*shape[:-1], row bytes]``: a view of the file, a layer's stacked experts
        (`_Experts`: views, or gpt-oss's made per expert), or what is made on each call (the
        device keeps its own copy): gpt-oss's gate and up biases, the repacked blocks of a
        GPTQ/AWQ layer."""
        info, src = self.tensors[name], self._sources[name]
        if src.perm_of is not None:  # an index tensor: no row geometry
            perm = gptq_awq.input_perm(self._unpacked(src.perm_of).g_idx)
            return perm.view(np.uint8).reshape(-1)
        row_bytes = QUANT_FORMATS[info.ggml_type].row_bytes(info.shape[-1])
        if src.experts:
            parts, n = src.experts, info.shape[1]

            def expert(e: int) -> np.ndarray:
                shard, t = parts[e]
                return shard.bytes(t.name).reshape(n, row_bytes)

            return _Experts((len(parts), n, row_bytes), expert)  # type: ignore[return-value]
        if src.expert is not None:
            shape = (info.shape[0], info.shape[1], row_bytes)
            return _Experts(shape, src.expert)  # type: ignore[return-value]
        if src.made is not None:
            return src.made().reshape(*info.shape[:-1], row_bytes)
        if src.tensor is not None:
            assert src.shard is not None
            return src.shard.bytes(src.tensor.name).reshape(*info.shape[:-1], row_bytes)
        assert src.layer is not None and self.quant is not None
        blocks = gptq_awq.repack(self._unpacked(src.layer), self.quant.ggml_type, src.layer)
        for part in gptq_awq.PARTS:  # the packed parts are read: drop their pages from RSS
            if (hf := self._hf.get(f"{src.layer}.{part}")) is not None:
                hf[0].release_pages(hf[1].offset, hf[1].offset + hf[1].nbytes)
        return blocks

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.raw(name)[np.asarray(ids, np.int64).reshape(-1)]

    def source(self, names: tuple[str, ...]) -> tuple[str, str] | None:
        """The repack cache's key of ``names`` (see ``GGUFWeights.source``): the shard and
        byte ranges, and the shard's identity; a layer's experts (``GGUFWeights`` adds an
        expert's rows): the directory and the tensor's GGUF name, and the identities of
        the shards it reads, with this code's version where it makes their bytes (gpt-oss's
        MXFP4 stacks); None for repacked GPTQ/AWQ layers."""
        srcs = [self._sources[n] for n in names]
        if len(srcs) == 1 and (srcs[0].experts or srcs[0].stacks):
            read = {id(shard): shard for shard, _ in srcs[0].experts or srcs[0].stacks}
            identity = ";".join(sorted(map(_identity, read.values())))
            if srcs[0].stacks:
                identity += f";made by {_made_version()}"
            return f"{os.path.realpath(self.path)}#{names[0]}", identity
        if any(s.tensor is None for s in srcs) or len({id(s.shard) for s in srcs}) != 1:
            return None
        shard = srcs[0].shard
        assert shard is not None
        where = os.path.realpath(shard.path) + "@"
        where += ",".join(f"{s.tensor.offset}+{s.tensor.nbytes}" for s in srcs if s.tensor)
        return where, _identity(shard)

    def release_pages(self, name: str | None = None, rows: tuple[int, int] | None = None) -> None:
        """Drop mapped pages from RSS (all, or of a tensor or its rows), as GGUFFile does."""
        if name is None:
            for shard in self.shards.values():
                shard.release_pages()
            return
        info, src = self.tensors[name], self._sources[name]
        if src.experts:  # the rows of each expert's own tensor
            n = info.shape[1]
            lo, hi = rows or (0, info.shape[0] * n)
            for e in range(lo // n, -(-hi // n)):
                shard, t = src.experts[e]
                row_bytes = t.nbytes // n
                first, last = max(lo - e * n, 0), min(hi - e * n, n)
                shard.release_pages(t.offset + first * row_bytes, t.offset + last * row_bytes)
            return
        if src.stacks:  # gpt-oss: each touched expert's slice of the HF stacks (made copies)
            n, n_experts = info.shape[1], info.shape[0]
            lo, hi = rows or (0, n_experts * n)
            for e in range(lo // n, -(-hi // n)):
                for shard, t in src.stacks:
                    size = t.nbytes // n_experts
                    shard.release_pages(t.offset + e * size, t.offset + (e + 1) * size)
            return
        if src.shard is None:
            return
        start, end = info.offset, info.offset + info.nbytes
        if rows is not None:
            row_bytes = info.nbytes // math.prod(info.shape[:-1])
            start, end = info.offset + rows[0] * row_bytes, info.offset + rows[1] * row_bytes
        src.shard.release_pages(start, end)

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> HFDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
