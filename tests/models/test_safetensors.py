"""Hugging Face directories (``save_pretrained``: config.json + SafeTensors + tokenizer.json)
load and run on the same graph and kernels as GGUF files.

* Fidelity: tiny random-weight models of each family DynaLM reads from SafeTensors match
  transformers on every position (fp32, and llama in BF16 / qwen2 in F16 against the
  reference rounded the same way), in ``safe`` and ``exact``; the same weights as GPTQ
  (symmetric and asymmetric, with and without act-order) and AWQ checkpoints packed by
  `hf_quant` match the dequantised reference within the same bound.
* Bad input: each a one-line error naming the file and the tensor; mutated headers
  never crash the reader.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import time
from pathlib import Path

import hf_fuzz
import numpy as np
import pytest
import torch
from atheris_run import fuzz
from gguf import GGMLQuantizationType
from gguf_fuzz import FuzzWorker
from hf_quant import write_quantized
from test_cli import GREEDY, assert_one_line_error, dynalm
from test_families import IDS, _all_positions, _max_diff, reference_logits
from test_gguf_fuzz import FIXED_SEED, problem
from tiny_models import SPECS, reference_model, write_hf_dir

from dynalm.errors import DynaError, ModelFormatError, ModelNotFound, UnsupportedModel
from dynalm.models import chat_template, hf_dir, tokenizer
from dynalm.models.hf_dir import HFDirectory
from dynalm.models.hparams import MAX_VOCAB
from dynalm.models.loader import load_model
from dynalm.models.safetensors_file import SafeTensorsFile

TOL = 1.0  # of test_families' bound: two fp32 forward passes of one network
FAMILIES = ("llama", "qwen2", "qwen3", "olmo2")
MODES = ("safe", "exact")


def _check(path: Path, reference, modes=MODES) -> None:
    want = reference_logits(reference, IDS)
    model = load_model(path)
    try:
        for mode in modes:
            got = _all_positions(model, mode)
            diff = _max_diff(got, want)
            assert diff <= TOL, f"{path.name} ({mode}): max |diff| {diff:.3g} of the bound"
            assert (got.argmax(1) == want.argmax(1)).all(), f"{path.name} ({mode}): top-1"
    finally:
        model.gguf.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_directory_matches_transformers(family: str, tmp_path: Path) -> None:
    reference = reference_model(SPECS[family])
    path = write_hf_dir(reference, tmp_path / family)
    model = load_model(path)
    try:
        assert model.hparams.arch == family
        assert {t.ggml_type for t in model.gguf.tensors.values()} == {GGMLQuantizationType.F32}
        assert ("output.weight" in model.gguf.tensors) == (not SPECS[family].tied)
        assert model.tokenizer.decode(model.tokenizer.encode("héllo!")) == "héllo!"
        assert model.stop_token_ids >= {256, 258}  # <|endoftext|> (eos), <|im_end|> (template)
    finally:
        model.gguf.close()
    _check(path, reference)


@pytest.mark.parametrize(("family", "dtype"), [("llama", torch.bfloat16), ("qwen2", torch.float16)])
def test_half_precision_directory_runs_on_its_own_kernels(family, dtype, tmp_path: Path) -> None:
    """BF16 and F16 weights stay BF16 / F16 (no conversion at load)."""
    reference = reference_model(SPECS[family])
    with torch.no_grad():  # the reference: the same rounded weights, computed in fp32
        for param in reference.parameters():
            param.copy_(param.to(dtype).to(torch.float32))
    path = write_hf_dir(copy.deepcopy(reference).to(dtype), tmp_path / family)
    with HFDirectory(path) as d:
        assert (
            d.tensors["blk.0.attn_q.weight"].ggml_type
            == GGMLQuantizationType["BF16" if dtype == torch.bfloat16 else "F16"]
        )
    _check(path, reference)


QUANTISED = [
    ("llama", "gptq", 32, True, False),
    ("llama", "gptq", 64, False, False),
    ("llama", "gptq", 32, False, True),  # act-order
    ("qwen2", "gptq", -1, True, True),  # one group per row: act-order changes nothing
    ("qwen2", "gptq", 32, True, True),
    ("llama", "awq", 64, False, False),
    ("qwen2", "awq", 32, False, False),
]


@pytest.mark.parametrize(("family", "method", "group", "sym", "act_order"), QUANTISED)
def test_quantised_directory_matches_dequantised_reference(
    family: str, method: str, group: int, sym: bool, act_order: bool, tmp_path: Path
) -> None:
    reference = reference_model(SPECS[family])
    path = write_hf_dir(reference, tmp_path / family)
    write_quantized(reference, path, method, group, sym, act_order)
    with HFDirectory(path) as d:
        want = GGMLQuantizationType.Q4_0 if sym else GGMLQuantizationType.Q5_0
        assert d.tensors["blk.0.ffn_down.weight"].ggml_type == want
        perms = [n for n in d.tensors if n.endswith(".input_perm")]
        assert bool(perms) == (act_order and group != -1)
    unrounded = reference_logits(reference_model(SPECS[family]), IDS)
    assert _max_diff(unrounded, reference_logits(reference, IDS)) > 100 * TOL  # it matters
    _check(path, reference, modes=("exact",))


def test_an_act_order_g_idx_is_honoured_whatever_desc_act_says(tmp_path: Path) -> None:
    """Found by reading, for the directory fuzzer: with ``desc_act`` false but an act-order
    ``g_idx``, the repack sorted the columns by group while the graph did not gather its
    input (no ``input_perm``): a silently wrong model. The tensors decide, not the flag."""
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path / "llama")
    write_quantized(reference, path, "gptq", 32, act_order=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (path / "config.json").write_text(json.dumps(config))
    with HFDirectory(path) as d:
        assert "blk.0.ffn_down.input_perm" in d.tensors
    _check(path, reference, modes=("exact",))


def test_q4_1_would_lose_the_zero_points(tmp_path: Path) -> None:
    """Why asymmetric layers become Q5_0: Q4_1's fp16 offset ``-scale * zero`` is not the
    checkpoint's (the module doc of ``gptq_awq``), while Q5_0 holds every weight exactly."""
    from hf_quant import quantize

    from dynalm.core.quant import dequantize
    from dynalm.models.gptq_awq import Unpacked, repack

    w = np.random.default_rng(0).normal(0, 0.5, (256, 256)).astype(np.float32)
    qt = quantize(w, 32, False, False, np.random.default_rng(1))
    u = Unpacked(qt["q"].astype(np.uint8), qt["zeros"], qt["scales"], qt["g_idx"])
    q5 = repack(u, GGMLQuantizationType.Q5_0, "w")
    assert np.array_equal(dequantize(q5, GGMLQuantizationType.Q5_0, 256), qt["dequantized"])
    scales = qt["scales"].astype(np.float32)[qt["g_idx"]].T
    offset = -scales * qt["zeros"][qt["g_idx"]].T
    q41 = scales * qt["q"] + offset.astype(np.float16).astype(np.float32)
    assert np.abs(q41 - qt["dequantized"]).max() > 0  # rounded away in Q4_1


# -- bad input ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_dir(reference_model(SPECS["llama"]), tmp_path_factory.mktemp("hf") / "llama")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        dst.joinpath(f.name).write_bytes(f.read_bytes())
    return dst


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _refused(path: Path, error: type[DynaError], *needles: str) -> None:
    with pytest.raises(error) as e:
        load_model(path)
    message = str(e.value)
    assert "\n" not in message and len(message) < 600, message
    for needle in needles:
        assert needle in message, message


def test_truncated_file_names_file_and_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    f = d / "model.safetensors"
    header, body = _header(f)
    last = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1] if kv[0][0] != "_" else 0)
    _write(f, header, body[:-100])
    _refused(d, ModelFormatError, str(f), "truncated", last[0])


def test_header_lying_about_offsets(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    f = d / "model.safetensors"
    header, body = _header(f)
    name = "model.layers.1.input_layernorm.weight"
    header[name]["data_offsets"][1] -= 4  # a float less than its shape holds
    _write(f, header, body)
    _refused(d, ModelFormatError, str(f), name, "needs 256 bytes", "hold 252")


def test_overlapping_tensors(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    f = d / "model.safetensors"
    header, body = _header(f)
    header["model.norm.weight"]["data_offsets"] = header["model.layers.0.input_layernorm.weight"][
        "data_offsets"
    ]
    _write(f, header, body)
    _refused(d, ModelFormatError, str(f), "overlap", "model.norm.weight")


def test_missing_shard_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    header, _ = _header(d / "model.safetensors")
    names = [n for n in header if n != "__metadata__"]
    index = {"weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(d, ModelNotFound, str(d / "model-00002-of-00002.safetensors"), "model.norm.weight")


def test_sharded_directory_loads(tmp_path: Path) -> None:
    reference = reference_model(SPECS["qwen2"])
    path = write_hf_dir(reference, tmp_path / "qwen2", max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    assert (path / "model.safetensors.index.json").is_file()
    _check(path, reference, modes=("exact",))


def test_unknown_architecture(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    config["model_type"], config["architectures"] = "mamba", ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    _refused(d, UnsupportedModel, str(d / "config.json"), "mamba", "MambaForCausalLM")


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("model_type", ["llama"], UnsupportedModel),
        ("model_type", {"llama": 1}, UnsupportedModel),
        ("rope_scaling", "linear", ModelFormatError),
        ("rope_scaling", ["linear", 2.0], ModelFormatError),
        ("rope_scaling", 4, ModelFormatError),
    ],
    ids=[
        "model_type list",
        "model_type dict",
        "rope_scaling str",
        "rope_scaling list",
        "rope_scaling int",
    ],
)
def test_config_key_of_the_wrong_json_type_is_named(
    key: str, value: object, error: type[DynaError], tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 25: a list or dict ``model_type`` was an unhashable-type TypeError, a string,
    list or int ``rope_scaling`` an AttributeError; each is one line naming file and key."""
    d = _copy(tiny_dir, tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    _refused(d, error, str(d / "config.json"))
    if key == "rope_scaling":
        _refused(d, error, "rope_scaling", "not an object")


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("config.json", "not a regular file"),
        ("tokenizer.json", "not a regular file"),
        ("chat_template.jinja", "not a regular file"),
        ("model.safetensors.index.json", "not a regular file"),
        ("tokenizer_config.json", "not a regular file"),
        ("generation_config.json", "not a regular file"),
        ("model.safetensors", "truncated: 0 bytes"),  # (mapped, never read as a stream)
    ],
)
def test_a_fifo_in_place_of_a_directory_file_is_refused_not_waited_on(
    name: str, needle: str, tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 25: a FIFO named config.json, tokenizer.json or chat_template.jinja hung the
    loader (opened and read with no writer); files are opened only as regular files (the
    index and the other JSON files too, issue 25 part 2)."""
    d = _copy(tiny_dir, tmp_path / "d")
    d.joinpath(name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    _refused(d, DynaError, str(d / name), needle)


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("config.json", hf_dir.MAX_JSON_BYTES),
        ("model.safetensors.index.json", hf_dir.MAX_JSON_BYTES),
        ("chat_template.jinja", chat_template.MAX_TEMPLATE_BYTES),
    ],
)
def test_a_directory_file_past_its_bound_is_refused_by_its_size(
    name: str, bound: int, tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 25 part 2: config, index and template are read only up to a stated size, the
    size checked before any parser runs (the file here is sparse: one byte past the bound
    costs no disk, and a reader that read it would hold it all)."""
    d = _copy(tiny_dir, tmp_path / "d")
    with open(d / name, "wb") as f:
        f.truncate(bound + 1)
    _refused(d, DynaError, str(d / name), f"{bound + 1} bytes, more than the {bound} allowed")


def test_an_oversized_tokenizer_json_is_refused_by_its_size(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25: a 30M-entry vocabulary made the tokenizer library abort the process; a
    tokenizer.json past the bound is refused before any parser reads it (the bound is
    lowered here to the test file's size less one byte, rather than writing 128 MiB)."""
    d = _copy(tiny_dir, tmp_path / "d")
    size = (d / "tokenizer.json").stat().st_size
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_JSON_BYTES", size - 1)
    _refused(d, ModelFormatError, str(d / "tokenizer.json"), f"{size} bytes, more than")


def test_a_tokenizer_json_larger_than_the_embedding_is_refused_before_it_is_built(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 25: a 30M-entry tokenizer.json (under the byte bound) made the tokenizer
    library abort the process; its tables are counted against the embedding's rows first."""
    d = _copy(tiny_dir, tmp_path / "d")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["model"]["vocab"] |= {f"x{i}": 1000 + i for i in range(100_000)}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    _refused(
        d,
        ModelFormatError,
        f"{d / 'tokenizer.json'}: model.vocab has {len(spec['model']['vocab'])} entries, "
        "more than 300 (the embedding's 300 rows)",
    )


def test_a_tokenizer_json_of_22m_values_is_refused_before_it_is_parsed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 25: tokenizer.json was parsed whole (up to its 128 MiB bound) before its tables
    were counted: 22M merges under the byte bound make json.loads build ~1.4 GB. Its values
    are counted first (by their separators) against what a tokenizer of the embedding's rows
    holds: refused in a child allowed 1 GiB, in seconds, naming the file and the bound."""
    d = _copy(tiny_dir, tmp_path / "d")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["model"]["merges"] = ["@MERGES@"]
    head, tail = json.dumps(spec).encode().split(b'"@MERGES@"')
    n = (tokenizer.MAX_TOKENIZER_JSON_BYTES - len(head) - len(tail)) // 6
    data = head + b'"a b",' * (n - 1) + b'"a b"' + tail
    (d / "tokenizer.json").write_bytes(data)
    found = sum(data.count(c) for c in (b",", b":", b"[")) + 1  # n + the tiny one's
    bound = 18 * 300 + 3 * MAX_VOCAB + 65536
    worker = FuzzWorker(tiny_dir, memory_mib=1024)
    try:
        t0 = time.monotonic()
        result = worker.check(d)
    finally:
        worker.close()
    assert result["status"] == "refused", result
    assert result["message"] == (
        f"{d / 'tokenizer.json'}: up to {found} JSON values (by its separators), more than "
        f"a tokenizer of the embedding's 300 rows holds ({bound}: 18 a row, 3 for each of up "
        f"to {MAX_VOCAB} merges, 65536 besides)"
    )
    assert time.monotonic() - t0 < 10


def test_an_embedding_of_30m_rows_is_refused_before_any_table_is_built(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Issue 31: a vocabulary padded to 30M rows allocated 10 GB before the memory plan ran;
    the embedding's row count is bounded first (the 7.7 GB of rows are a sparse hole)."""
    d = _copy(tiny_dir, tmp_path / "d")
    f = d / "model.safetensors"
    header, body = _header(f)
    rows = 30_000_000
    end = len(body) + rows * 64 * 4
    header["model.embed_tokens.weight"] = {
        "dtype": "F32", "shape": [rows, 64], "data_offsets": [len(body), end]
    }  # fmt: skip
    _write(f, header, body)
    with open(f, "r+b") as out:
        out.truncate(f.stat().st_size + end - len(body))
    _refused(
        d,
        ModelFormatError,
        str(d),
        "token_embd.weight has 30000000 rows: a vocabulary of more than 2097152 tokens is refused",
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"bits": 3}, "bits = 3"),
        ({"bits": 8}, "bits = 8"),
        ({"checkpoint_format": "marlin"}, "'marlin'"),
        ({"group_size": 48}, "group_size = 48"),
    ],
)
def test_unsupported_gptq_is_refused(change: dict, needle: str, tmp_path: Path) -> None:
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path / "llama")
    write_quantized(reference, path, "gptq", 32)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= change
    (path / "config.json").write_text(json.dumps(config))
    _refused(path, UnsupportedModel, str(path / "config.json"), needle, ".qweight")


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path_factory.mktemp("gptq") / "llama")
    write_quantized(reference, path, "gptq", 32, act_order=True)
    return path


DOWN = "model.layers.0.mlp.down_proj"  # qweight I32 [16, 64]: 64 x 128 in groups of 32
LAYER = "a 64 x 128 weight in groups of 32 (qweight [16, 64])"


def _at(a: np.ndarray, i: int, v: int) -> np.ndarray:
    a = a.copy()
    a[i] = v
    return a


@pytest.mark.parametrize(
    ("part", "edit", "needle"),
    [
        ("g_idx", lambda a: np.array(0, np.int32), "g_idx is I32 [], expected [128] for " + LAYER),
        ("g_idx", lambda a: a[None], "g_idx is I32 [1, 128], expected [128] for " + LAYER),
        ("g_idx", lambda a: a[:-1], "g_idx is I32 [127], expected [128]"),
        ("g_idx", lambda a: a.astype(np.float32), "g_idx is F32 [128], expected I32/I64/"),
        ("g_idx", lambda a: _at(a, 5, 4), "g_idx[5] = 4, expected a group in 0..3"),
        ("g_idx", lambda a: _at(a, 7, -1), "g_idx[7] = -1, expected a group in 0..3"),
        (
            "qweight",
            lambda a: a[:2],
            "qweight is I32 [2, 64] ([in / 8, out]): 64 x 16, expected a multiple of 32 "
            "input columns and of 8 output rows",
        ),
        ("qweight", lambda a: a[:, :60], "qweight is I32 [16, 60] ([in / 8, out]): 60 x 128"),
        ("qweight", lambda a: a[0], "qweight is I32 [64], expected [in / 8, out]"),
        ("qweight", lambda a: a[:0], "qweight is I32 [0, 64], expected [in / 8, out]"),
        ("qweight", lambda a: a.view(np.float32), "qweight is F32 [16, 64], expected I32"),
        ("qweight", lambda a: a[:8], "qzeros is I32 [4, 8], expected [2, 8] for a 64 x 64"),
        ("qzeros", lambda a: a[0], "qzeros is I32 [8], expected [4, 8] for " + LAYER),
        ("qzeros", lambda a: a[:1], "qzeros is I32 [1, 8], expected [4, 8] for " + LAYER),
        ("scales", lambda a: a[:, :32], "scales is F16 [4, 32], expected [4, 64] for " + LAYER),
        ("scales", lambda a: a.astype(np.int32), "scales is I32 [4, 64], expected F16/BF16/F32"),
    ],
    ids=[
        "g_idx scalar",
        "g_idx 2-D",
        "g_idx short",
        "g_idx float",
        "g_idx past the groups",
        "g_idx negative",
        "qweight narrower than its group",
        "qweight 60 outputs",
        "qweight 1-D",
        "qweight empty",
        "qweight float",
        "qweight half the inputs of scales",
        "qzeros 1-D",
        "qzeros one group",
        "scales half the outputs",
        "scales integer",
    ],
)
def test_gptq_part_of_a_wrong_shape_is_named(
    part: str, edit, needle: str, gptq_dir: Path, tmp_path: Path
) -> None:
    """Issue 25: a scalar g_idx and a qweight narrower than its group were IndexError /
    ValueError from numpy; every part's dtype and shape is checked against the others when
    the directory is opened, naming the file, the tensor, what it is and what it should be."""
    _refused_part(gptq_dir, part, edit, needle, tmp_path)


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path_factory.mktemp("awq") / "llama")
    write_quantized(reference, path, "awq", 32)
    return path


AWQ_LAYER = "a 64 x 128 weight in groups of 32 (qweight [128, 8])"  # [in, out / 8]


@pytest.mark.parametrize(
    ("part", "edit", "needle"),
    [
        ("qweight", lambda a: a[0], "qweight is I32 [8], expected [in, out / 8]"),
        (
            "qweight",
            lambda a: a[:16],
            "qweight is I32 [16, 8] ([in, out / 8]): 64 x 16, expected a multiple of 32 "
            "input columns and of 8 output rows",
        ),
        ("qweight", lambda a: a[:64], "qzeros is I32 [4, 8], expected [2, 8] for a 64 x 64"),
        ("qzeros", lambda a: a[0], "qzeros is I32 [8], expected [4, 8] for " + AWQ_LAYER),
        ("scales", lambda a: a[:, :32], "scales is F16 [4, 32], expected [4, 64] for " + AWQ_LAYER),
    ],
    ids=[
        "qweight 1-D",
        "qweight narrower than its group",
        "qweight half the inputs of scales",
        "qzeros 1-D",
        "scales half the outputs",
    ],
)
def test_awq_part_of_a_wrong_shape_is_named(
    part: str, edit, needle: str, awq_dir: Path, tmp_path: Path
) -> None:
    """Issue 25 names GPTQ/AWQ: AWQ's transposed layout ([in, out / 8]) goes through the
    same checks, each bad part one line naming the file, the tensor and the shape wanted."""
    _refused_part(awq_dir, part, edit, needle, tmp_path)


def _refused_part(base: Path, part: str, edit, needle: str, tmp_path: Path) -> None:
    """A copy of ``base`` with ``DOWN``'s ``part`` replaced by ``edit(part)`` is refused
    naming the file, the tensor and ``needle``."""
    from safetensors.numpy import load_file, save_file

    d = _copy(base, tmp_path / "d")
    tensors = load_file(str(d / "model.safetensors"))
    tensors[f"{DOWN}.{part}"] = np.array(edit(tensors[f"{DOWN}.{part}"]), order="C")
    save_file(tensors, str(d / "model.safetensors"))
    _refused(d, ModelFormatError, f"{d / 'model.safetensors'}: {DOWN}.", needle)


def test_unsupported_dtype_names_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "d")
    f = d / "model.safetensors"
    header, body = _header(f)
    entry = header["model.norm.weight"]
    entry["dtype"], entry["shape"] = "I32", entry["shape"]
    _write(f, header, body)
    _refused(d, UnsupportedModel, str(f), "model.norm.weight", "I32")


def test_mutated_headers_never_crash(tiny_dir: Path, tmp_path: Path) -> None:
    """1,500 random mutations of the header (bytes flipped, inserted, deleted; JSON values
    swapped for others): each is read or refused with a DynaError, never anything else."""
    header, body = _header(tiny_dir / "model.safetensors")
    raw = json.dumps(header).encode()
    values = [0, -1, 2**64, 1.5, "F16", "X", None, [], {}, [0], [1, 0], [2**63, 2**63]]
    rng = random.Random(17)
    f = tmp_path / "model.safetensors"
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(1500):
        kind = rng.randrange(3)
        if kind == 0:  # a JSON value replaced
            h = json.loads(raw)
            name = rng.choice(list(h))
            if name != "__metadata__":
                key = rng.choice(["dtype", "shape", "data_offsets"])
                h[name][key] = rng.choice(values)
            data = json.dumps(h).encode()
            data = struct.pack("<Q", len(data)) + data + body
        else:
            data = bytearray(struct.pack("<Q", len(raw)) + raw + body[:512])
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(0, 8 + len(raw))
                if kind == 1:
                    data[at] = rng.randrange(256)
                else:
                    del data[at : at + rng.randint(1, 8)]
            data = bytes(data)
        f.write_bytes(data)
        try:
            st = SafeTensorsFile(f)
            for name in st.tensors:
                if st.tensors[name].dtype not in ("F8_E4M3", "F8_E5M2"):
                    st.array(name)
            outcomes["ok"] += 1
        except DynaError as e:
            assert "\n" not in str(e) and str(f) in str(e), str(e)
            outcomes["refused"] += 1
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes


def test_fuzz_hf_directory(tiny_dir: Path, gptq_dir: Path, tmp_path: Path) -> None:
    """Issue 25 (5): 300 of ~880 mutated directories (`hf_fuzz`: config.json keys with every
    JSON type and bad sizes, header dtypes/shapes/offsets, GPTQ parts and
    quantization_config), two thirds drawn with a fixed seed and the rest with a random one
    (printed; ``DYNALM_FUZZ_SEED`` replays it, ``DYNALM_FUZZ_CASES=all`` runs all), each
    run as ``dynalm run`` would in a child under 1 GiB and 20 s: each must end as labelled
    (refused, accepted, or either), a refusal one short line naming the directory."""
    everything = hf_fuzz.cases(tiny_dir, gptq_dir)
    seed = int(os.environ.get("DYNALM_FUZZ_SEED") or random.randrange(2**32))
    print(f"directory fuzz: fixed seed {FIXED_SEED}, random seed {seed}")
    count = os.environ.get("DYNALM_FUZZ_CASES", "300")
    if count == "all":
        chosen = everything
    else:
        n = int(count)
        fixed = random.Random(FIXED_SEED).sample(everything, 2 * n // 3)
        rest = [c for c in everything if c not in fixed]
        chosen = fixed + random.Random(seed).sample(rest, n - len(fixed))
    worker = FuzzWorker(tiny_dir)
    failures, t0 = [], time.monotonic()
    try:
        for base, case in chosen:
            path = hf_fuzz.apply(base, case, tmp_path / "case")
            if (wrong := problem(case, worker.check(path), path)) is not None:
                failures.append(f"{case.name}: {wrong}")
    finally:
        worker.close()
    print(f"{len(chosen)} of {len(everything)} cases in {time.monotonic() - t0:.1f} s")
    assert not failures, f"seed {seed}: {len(failures)} of {len(chosen)} cases:\n" + "\n".join(
        failures
    )


def test_atheris_header_parser(tiny_dir: Path, tmp_path: Path) -> None:
    """libFuzzer mutates the tiny model's SafeTensors header 20,000 times; any exception
    that is not a DynaError fails."""
    data = (tiny_dir / "model.safetensors").read_bytes()
    n = struct.unpack_from("<Q", data)[0]
    fuzz("safetensors_atheris.py", data[: 8 + n + 512], tmp_path)


# -- the CLI ---------------------------------------------------------------------------


def test_cli_show_and_run_a_directory(tmp_path: Path) -> None:
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path / "llama")
    write_quantized(reference, path, "gptq", 32, act_order=True)
    shown = dynalm("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "architecture        llama" in shown.stdout
    assert "q5_0 x" in shown.stdout and "f32 x" in shown.stdout
    assert "gptq 4-bit g32 asym act-order" in shown.stdout
    ran = dynalm("run", str(path), "hi", *GREEDY)
    assert ran.returncode == 0, ran.stderr
    missing = dynalm("run", str(tmp_path / "nothing-here/"), "hi")
    assert_one_line_error(missing, "nothing-here")
