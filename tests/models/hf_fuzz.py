"""Corrupt Hugging Face model directories, each labelled with what DynaLM must do with it.

The structure-aware twin of `gguf_fuzz` for SafeTensors directories (the byte-level side,
one SafeTensors header under libFuzzer, is ``safetensors_atheris.py``): `cases` derives
mutated directories from a small valid one (`tiny_models.write_hf_dir`, llama, F32) and
from its GPTQ checkpoint (`hf_quant`, act-order): every config.json key set to each JSON
type and to 0, -1, huge, NaN, inf, or removed; head counts that do not divide the width;
every header field of a sample of tensors (dtype, shape, data_offsets) set to wrong,
overlapping, out-of-range and huge values; the header's length and truncations; each GPTQ
part's dtype and shape, and the quantization_config's keys. A case is a `gguf_fuzz.Case`
whose data is the files to replace (``None``: remove); `apply` writes it into a copy of
its base directory, which `gguf_fuzz.FuzzWorker` runs as ``dynalm run`` would, in a
child process under a memory limit and a timeout.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from gguf_fuzz import ACCEPT, EITHER, REFUSE, Case
from safetensors.numpy import load_file, save_file

ST = "model.safetensors"
Files = dict[str, bytes | None]  # file name -> new bytes (None: removed)

# config.json values every key is set to (label, value); floats as Python's json writes
# them (NaN and Infinity are accepted by json.loads).
VALUES: list[tuple[str, object]] = [
    ("0", 0),
    ("1", 1),
    ("-1", -1),
    ("2**31", 2**31),
    ("2**64", 2**64),
    ("1.5", 1.5),
    ("-1.0", -1.0),
    ("1e308", 1e308),
    ("NaN", float("nan")),
    ("Infinity", float("inf")),
    ("true", True),
    ("null", None),
    ("'x'", "x"),
    ("100k chars", "k" * 100_000),
    ("[]", []),
    ("[4]", [4]),
    ("{}", {}),
]
# Keys whose tensors fix their value (the tiny llama's): any other value is refused.
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "head_dim": 16,
}


def _config_expect(key: str, v: object) -> str:
    integer = v if type(v) is int else None
    if key == "head_dim" and v is None:
        return ACCEPT  # as absent: the width over the heads, 16
    if key in DIMS:
        return ACCEPT if integer == DIMS[key] else REFUSE
    if key == "model_type":
        return REFUSE  # no value above is "llama"
    if key == "max_position_embeddings":
        return EITHER if integer is not None and 1 <= integer < 2**63 else REFUSE
    if key == "rms_norm_eps":
        ok = type(v) in (int, float) and v == v and 0 < v <= 1  # type: ignore[operator]
        return ACCEPT if ok else REFUSE
    return EITHER  # keys nothing reads, or read with a default


def _config_cases(config: dict) -> Iterator[Case]:
    def edited(change: Callable[[dict], object]) -> Callable[[], Files]:
        def files() -> Files:
            c = json.loads(json.dumps(config))
            change(c)
            return {"config.json": json.dumps(c).encode()}

        return files

    for key in config:
        for label, v in VALUES:
            yield Case(
                f"config {key} = {label}",
                _config_expect(key, v),
                edited(lambda c, k=key, v=v: c.__setitem__(k, v)),
            )
        required = key in ("model_type", "hidden_size", "num_hidden_layers")
        yield Case(
            f"config {key} removed",
            REFUSE if required else EITHER,
            edited(lambda c, k=key: c.pop(k)),
        )
    # rope_scaling is absent from the tiny config: each JSON type too (issue 25: a string,
    # list or int was an AttributeError); an object may be read, a false value is taken as
    # absent (as transformers does), the rest is refused
    for label, v in VALUES:
        yield Case(
            f"config rope_scaling = {label}",
            EITHER if not v else REFUSE,
            edited(lambda c, v=v: c.__setitem__("rope_scaling", v)),
        )
    for heads, kv in ((3, 3), (5, 1), (4, 3), (7, 7), (64, 64), (128, 2)):
        change = {"num_attention_heads": heads, "num_key_value_heads": kv}
        yield Case(
            f"config heads {heads} / kv {kv}, no head_dim",
            REFUSE,
            edited(lambda c, ch=change: (c.update(ch), c.pop("head_dim"))),
        )
    for label, rope in [
        ("rope_scaling linear 2", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
        ("rope_scaling linear -1", {"rope_scaling": {"type": "linear", "factor": -1.0}}),
        ("rope_scaling linear nan", {"rope_scaling": {"type": "linear", "factor": float("nan")}}),
        ("rope_scaling linear 'x'", {"rope_scaling": {"type": "linear", "factor": "x"}}),
        ("rope_scaling yarn", {"rope_scaling": {"type": "yarn", "factor": 4.0}}),
        ("rope_scaling type []", {"rope_scaling": {"type": []}}),
        ("rope_theta 0", {"rope_parameters": {"rope_theta": 0}}),
        ("rope_theta -1", {"rope_parameters": {"rope_theta": -1.0}}),
        ("rope_theta 'x'", {"rope_parameters": {"rope_theta": "x"}}),
        ("rope_theta 1e400", {"rope_parameters": {"rope_theta": float("inf")}}),
        ("partial_rotary_factor 0.5", {"partial_rotary_factor": 0.5}),
        ("partial_rotary_factor []", {"partial_rotary_factor": []}),
    ]:
        expect = EITHER if label == "rope_scaling linear 2" else REFUSE
        yield Case(f"config {label}", expect, edited(lambda c, r=rope: c.update(r)))
    for label, raw in [
        ("empty", b""),
        ("[]", b"[]"),
        ("null", b"null"),
        ("not JSON", b"{'model_type': 'llama'}"),
        ("invalid UTF-8", b'{"model_type": "\xff"}'),
        ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000),
        ("a 5000-digit number", b'{"hidden_size": ' + b"9" * 5000 + b"}"),
        ("removed", None),
    ]:
        yield Case(f"config.json {label}", REFUSE, lambda raw=raw: {"config.json": raw})


def _header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _file(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


# Tensors whose header entries are mutated: one of each kind (the tied-able head is last).
SAMPLED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.2.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def _header_cases(data: bytes) -> Iterator[Case]:
    header, body = _header(data)

    def edited(change: Callable[[dict], object]) -> Callable[[], Files]:
        def files() -> Files:
            h = json.loads(json.dumps(header))
            change(h)
            return {ST: _file(h, body)}

        return files

    others = [n for n in header if n != "__metadata__"]
    for name in SAMPLED:
        entry = header[name]
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        changes: list[tuple[str, str, str, object]] = []
        for dtype in ("F16", "BF16", "F64", "I32", "U8", "F8_E4M3", "BOOL", "X", 5, None):
            changes.append((f"dtype {dtype}", REFUSE, "dtype", dtype))
        for new in (
            [],
            [0],
            [0, *shape[1:]],
            [shape[0] + 1, *shape[1:]],
            shape[::-1],
            [1, *shape],
            [2**40, *shape[1:]],
            [2**62, 2**62],
            [-1, *shape[1:]],
            [str(d) for d in shape],
            [1.5],
        ):
            if new != shape:
                changes.append((f"shape {new}", REFUSE, "shape", new))
        other = header[next(o for o in others if o != name)]["data_offsets"]
        for offsets in (
            other,
            [begin + 4, end + 4],
            [end, begin],
            [begin, begin],
            [len(body), len(body) + end - begin],
            [0, 2**64],
            [begin, 2**63],
            [-4, end - begin - 4],
            [begin],
            None,
        ):
            changes.append((f"data_offsets {offsets}", REFUSE, "data_offsets", offsets))
        for label, expect, key, v in changes:
            yield Case(
                f"{name}: {label}",
                expect,
                edited(lambda h, n=name, k=key, v=v: h[n].__setitem__(k, v)),
            )
        yield Case(
            f"{name}: removed",
            EITHER if name == "lm_head.weight" else REFUSE,  # without it: tied to the embedding
            edited(lambda h, n=name: h.pop(n)),
        )
        yield Case(
            f"{name}: renamed",
            REFUSE,
            edited(lambda h, n=name: h.__setitem__(n.replace("weight", "wieght"), h.pop(n))),
        )
        yield Case(
            f"{name}: extra field",
            REFUSE,
            edited(lambda h, n=name: h[n].__setitem__("extra", 1)),
        )
    for label, meta, expect in [
        ("__metadata__ of numbers", {"format": 1}, REFUSE),
        ("__metadata__ []", [], REFUSE),
        ("__metadata__ empty", {}, EITHER),
    ]:
        yield Case(label, expect, edited(lambda h, m=meta: h.__setitem__("__metadata__", m)))
    n = struct.unpack_from("<Q", data)[0]
    for length in (0, 2, n - 1, n + 1, len(data), 2**63, 2**64 - 1):
        yield Case(
            f"header length {length}",
            REFUSE,
            lambda length=length: {ST: struct.pack("<Q", length) + data[8:]},
        )
    for at in (0, 7, 8, 8 + n // 2, 8 + n, 8 + n + len(body) // 2, len(data) - 1):
        yield Case(f"{ST} cut at {at}", REFUSE, lambda at=at: {ST: data[:at]})
    yield Case(f"{ST} removed", REFUSE, lambda: {ST: None})


DOWN = "model.layers.0.mlp.down_proj"
# Edits that leave a valid layer: other nibbles and scales, a g_idx (optional) in another
# valid order or integer type, fp32 scales.
_VALID_PARTS = {(p, v) for p in ("qweight", "qzeros", "scales") for v in ("all -1", "all 2**30")}
_VALID_PARTS |= {("scales", "as float32")}
_VALID_PARTS |= {("g_idx", v) for v in ("1-D", "transposed", "as int64", "removed")}


def _gptq_cases(path: Path) -> Iterator[Case]:
    tensors = load_file(str(path / ST))
    config = json.loads((path / "config.json").read_text())

    def with_part(part: str, edit: Callable[[np.ndarray], np.ndarray | None]) -> Callable:
        def files() -> Files:
            out = dict(tensors)
            new = edit(tensors[f"{DOWN}.{part}"])
            if new is None:
                del out[f"{DOWN}.{part}"]
            else:
                out[f"{DOWN}.{part}"] = np.array(new, order="C")
            tmp = path.parent / "gptq-case.safetensors"
            save_file(out, str(tmp))
            return {ST: tmp.read_bytes()}

        return files

    edits: list[tuple[str, Callable[[np.ndarray], np.ndarray | None]]] = [
        ("scalar", lambda a: np.array(a.reshape(-1)[0])),
        ("1-D", lambda a: a.reshape(-1)),
        ("3-D", lambda a: a[None]),
        ("first row", lambda a: a[:1]),
        ("half the rows", lambda a: a[: max(1, len(a) // 2)]),
        ("one row more", lambda a: np.concatenate([a, a[:1]])),
        ("transposed", lambda a: a.T if a.ndim == 2 else a[::-1]),
        ("empty", lambda a: a[:0]),
        ("as float32", lambda a: a.astype(np.float32)),
        ("as int64", lambda a: a.astype(np.int64)),
        ("as uint8", lambda a: a.astype(np.uint8)),
        ("all -1", lambda a: np.full_like(a, -1)),
        ("all 2**30", lambda a: np.full_like(a, 2**30) if a.dtype.kind in "iu" else a * 1e4),
        ("removed", lambda a: None),
    ]
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        for label, edit in edits:
            expect = REFUSE if (part, label) not in _VALID_PARTS else EITHER
            yield Case(f"GPTQ {DOWN}.{part} {label}", expect, with_part(part, edit))
    yield Case(
        f"GPTQ {DOWN}.scales NaN",
        REFUSE,
        with_part("scales", lambda a: np.full_like(a, np.nan)),
    )

    def with_quant(key: str, v: object) -> Callable[[], Files]:
        def files() -> Files:
            c = json.loads(json.dumps(config))
            if v is _REMOVED:
                c["quantization_config"].pop(key)
            else:
                c["quantization_config"][key] = v
            return {"config.json": json.dumps(c).encode()}

        return files

    for key in config["quantization_config"]:
        for label, v in [*VALUES, ("removed", _REMOVED)]:
            same = v == config["quantization_config"][key] and type(v) is type(
                config["quantization_config"][key]
            )
            yield Case(
                f"GPTQ quantization_config {key} = {label}",
                ACCEPT if same else EITHER,
                with_quant(key, v),
            )
    for label, qc in [("[]", []), ("'gptq'", "gptq"), ("null", None)]:
        yield Case(
            f"GPTQ quantization_config {label}",
            EITHER if qc is None else REFUSE,
            lambda qc=qc: {
                "config.json": json.dumps(config | {"quantization_config": qc}).encode()
            },
        )


_REMOVED = object()


def cases(tiny: Path, gptq: Path) -> list[tuple[Path, Case]]:
    """Every mutation of the F32 directory ``tiny`` and the GPTQ directory ``gptq``, each with
    the directory it edits."""
    config = json.loads((tiny / "config.json").read_text())
    out = [
        (tiny, Case("the F32 directory", ACCEPT, dict)),
        (gptq, Case("the GPTQ one", ACCEPT, dict)),
    ]
    out += [(tiny, c) for c in _config_cases(config)]
    out += [(tiny, c) for c in _header_cases((tiny / ST).read_bytes())]
    out += [(gptq, c) for c in _gptq_cases(gptq)]
    return out


def apply(base: Path, case: Case, to: Path) -> Path:
    """``base`` with ``case``'s files replaced, as the directory ``to`` (made afresh)."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(base, to)
    for name, data in case.data().items():
        if data is None:
            (to / name).unlink()
        else:
            (to / name).write_bytes(data)
    return to
