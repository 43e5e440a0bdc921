"""Corrupt GGUF files, each labelled with what DynaLM must do with it.

`write_tiny_model` writes a small valid llama model (2 layers, Q8_0 and F32 tensors, a
sentencepiece vocabulary, a ChatML template). `cases` derives mutated files from it: every
header field, metadata value and tensor-info field set to 0, 1, -1, huge, the wrong type,
NaN or inf; truncations at the start and middle of every region; overlapping, misaligned
and out-of-file offsets; invalid UTF-8 and duplicated names and keys; random byte flips.
Each `Case` says whether a correct loader must refuse the file, accept it, or may do
either (a flipped byte in a name nothing reads). `FuzzWorker` runs files through
``gguf_fuzz_worker.py``: as ``dynalm run`` would, each in a child process under limits.
"""

from __future__ import annotations

import json
import math
import random
import select
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf_edit import Layout, V, value

WORKER = Path(__file__).with_name("gguf_fuzz_worker.py")

# The tiny model: llama, 2 layers, width 64, 4 heads of 16 (2 kv heads), ffn 128.
DIMS = {
    "llama.block_count": 2,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.key_length": 16,
    "llama.attention.value_length": 16,
}
HEAD_DIM = 16
PER_LAYER = (
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.feed_forward_length",
)
REQUIRED = {  # keys without a default
    "general.architecture",
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
}
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁h", "hi", "▁hi", "▁a", "▁the"]
TOKENS = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + PIECES
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny fuzz llama")
    w.add_context_length(256)
    for key, n in DIMS.items():
        w.add_uint32(key, n)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores(
        [0.0] * len(SPECIAL) + [-1000.0] * 256 + [-float(i) for i in range(len(PIECES))]
    )
    kinds = [2, 3, 3, 3, 3] + [6] * 256 + [1] * len(PIECES)  # unknown, control, byte, normal
    w.add_token_types(kinds)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def add(name: str, *shape: int) -> None:
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, x + 1.0)

    n_vocab, d, ff = len(TOKENS), 64, 128
    add("token_embd.weight", n_vocab, d)
    for i in range(2):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", d)
        add(p + "attn_q.weight", 4 * HEAD_DIM, d)
        add(p + "attn_k.weight", 2 * HEAD_DIM, d)
        add(p + "attn_v.weight", 2 * HEAD_DIM, d)
        add(p + "attn_output.weight", d, 4 * HEAD_DIM)
        add(p + "ffn_norm.weight", d)
        add(p + "ffn_gate.weight", ff, d)
        add(p + "ffn_up.weight", ff, d)
        add(p + "ffn_down.weight", d, ff)
    add("output_norm.weight", d)
    add("output.weight", n_vocab, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


REFUSE, ACCEPT, EITHER = "refuse", "accept", "either"


@dataclass(frozen=True)
class Case:
    name: str  # what was changed
    expect: str  # REFUSE | ACCEPT | EITHER
    data: Callable[[], Any]  # the file's bytes (hf_fuzz: the files of a directory)


_INTS = {V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64}
_NAN, _INF = float("nan"), float("inf")
# Values every metadata key is set to: (type, value). ARRAY values: (ARRAY, (sub, items)).
VALUES: list[tuple[V, object]] = [
    (V.UINT32, 0),
    (V.UINT32, 1),
    (V.INT32, -1),
    (V.UINT32, 2**32 - 1),
    (V.INT64, 2**63 - 1),
    (V.UINT64, 2**64 - 1),
    (V.INT64, -(2**63)),
    (V.FLOAT32, 1.5),
    (V.FLOAT32, -1.0),
    (V.FLOAT64, 0.0),
    (V.FLOAT32, _NAN),
    (V.FLOAT32, _INF),
    (V.FLOAT64, -_INF),
    (V.BOOL, True),
    (V.STRING, "x"),
    (V.STRING, b"\xff\xfe"),
    (V.STRING, "k" * 100_000),
    (V.ARRAY, (V.UINT32, [4, 4])),
    (V.ARRAY, (V.STRING, ["a"])),
    (V.ARRAY, (V.ARRAY, [])),
]


def _number(vtype: V, v: object) -> float | None:
    if vtype in _INTS or vtype in (V.FLOAT32, V.FLOAT64):
        return float(v)  # type: ignore[arg-type]
    return None


def expect_value(key: str, vtype: V, v: object) -> str:
    """What a loader must do with ``key`` set to ``v`` of ``vtype`` in the tiny model."""
    integer = v if vtype in _INTS else None
    number = _number(vtype, v)
    if key in DIMS:
        per_layer = vtype == V.ARRAY and key in PER_LAYER and v[0] in _INTS  # type: ignore[index]
        if per_layer and v[1] == [DIMS[key]] * DIMS["llama.block_count"]:  # type: ignore[index]
            return ACCEPT
        return ACCEPT if integer == DIMS[key] else REFUSE
    if key == "llama.rope.dimension_count":
        ok = integer is not None and 2 <= integer <= HEAD_DIM and integer % 2 == 0
        return ACCEPT if ok else REFUSE
    if key == "llama.context_length":
        return ACCEPT if integer is not None and 1 <= integer < 2**63 else REFUSE
    if key in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
        hi = 1.0 if "epsilon" in key else _INF
        ok = number is not None and math.isfinite(number) and 0 < number <= hi
        return ACCEPT if ok else REFUSE
    if key.endswith("_token_id"):
        return ACCEPT if integer is not None and 0 <= integer < len(TOKENS) else REFUSE
    if key in ("general.architecture", "tokenizer.ggml.model"):
        return ACCEPT if v == "llama" else REFUSE
    if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        return REFUSE  # every value above has the wrong type or length
    if key == "tokenizer.chat_template":
        return REFUSE if vtype != V.STRING or isinstance(v, bytes) else EITHER
    return EITHER  # general.name and keys nothing reads


def _encoded(vtype: V, v: object) -> bytes:
    if vtype == V.ARRAY:
        sub, items = v  # type: ignore[misc]
        return value(V.ARRAY, items, sub)
    return value(vtype, v)


def _metadata_cases(base: Layout) -> Iterator[Case]:
    for key_bytes, _ in base.kv:
        key = key_bytes.decode()
        for vtype, v in VALUES:
            label = f"{key} = {v!r:.40} ({vtype.name})"
            edited = base.set_value(key, _encoded(vtype, v))
            yield Case(label, expect_value(key, vtype, v), edited.encode)
        expect = REFUSE if key in REQUIRED else EITHER
        yield Case(f"{key} removed", expect, base.without(key).encode)
        dup = base.copy()
        dup.kv.append(dup.kv[dup.key_index(key)])
        yield Case(f"{key} twice", REFUSE, dup.encode)
    for sub, items, what in [
        (V.STRING, TOKENS[:-1], "one token short"),
        (V.STRING, [*TOKENS[:-1], b"\xff"], "a token of invalid UTF-8"),
        (V.UINT32, list(range(len(TOKENS))), "of integers"),
        (V.STRING, [], "empty"),
    ]:
        edited = base.set_value("tokenizer.ggml.tokens", value(V.ARRAY, items, sub))
        yield Case(f"tokenizer.ggml.tokens {what}", REFUSE, edited.encode)
    for key, sub in (("tokenizer.ggml.scores", V.FLOAT32), ("tokenizer.ggml.token_type", V.INT32)):
        edited = base.set_value(key, value(V.ARRAY, [1] * (len(TOKENS) + 1), sub))
        yield Case(f"{key} one entry too many", REFUSE, edited.encode)
    merges = [("▁ h", EITHER), ("h i", EITHER), ("nospace", REFUSE), ("x zz", REFUSE)]
    for merge, expect in merges + [(b"\xff h", REFUSE)]:
        edited = base.set_value("tokenizer.ggml.merges", value(V.ARRAY, [merge], V.STRING))
        yield Case(f"tokenizer.ggml.merges = [{merge!r}]", expect, edited.encode)
    for align, expect in ((32, ACCEPT), (16, EITHER), (0, REFUSE), (48, REFUSE), (2**40, REFUSE)):
        edited = base.set_value("general.alignment", value(V.UINT64, align))
        yield Case(f"general.alignment = {align}", expect, edited.encode)
    for key, expect in ((b"bad\xff key", REFUSE), (b"k" * 70_000, REFUSE), (b"", EITHER)):
        edited = base.copy()
        edited.kv.append((key, value(V.UINT32, 1)))
        yield Case(f"key {key!r:.20}", expect, edited.encode)


def _info_edit(base: Layout, index: int, **fields: object) -> Callable[[], bytes]:
    """The file with tensor info ``index`` changed (``fields``), or removed (no fields)."""

    def data() -> bytes:
        edited = base.copy()
        if not fields:
            del edited.infos[index]
        for field, new in fields.items():
            setattr(edited.infos[index], field, new)
        return edited.encode()

    return data


def _info_cases(base: Layout) -> Iterator[Case]:
    names = [i.name for i in base.infos]
    for index, info in enumerate(base.infos):
        name = info.name.decode()
        optional = name == "output.weight"  # without it the head is tied to the embeddings
        changes: list[tuple[str, str, dict]] = []
        for n_dims in (0, 3, 5, 2**32 - 1):
            changes.append((f"n_dims {n_dims}", REFUSE, {"n_dims": n_dims}))
        for axis, size in enumerate(info.ne):
            for new in sorted({0, 1, size - 1, size + 1, 2 * size, 2**32, 2**63, 2**64 - 1}):
                ne = [new if a == axis else n for a, n in enumerate(info.ne)]
                changes.append((f"ne[{axis}] {new}", REFUSE, {"ne": ne}) if new != size else ())
        for qtype in (T.F16, T.Q4_0, T.BF16, T.IQ2_XXS, 4, 100, 2**32 - 1):
            known = qtype in (T.F16, T.BF16) or (qtype == T.Q4_0 and info.ne[0] % 32 == 0)
            changes.append((f"type {qtype}", EITHER if known else REFUSE, {"type": int(qtype)}))
        other = random.Random(index).choice([i.offset for i in base.infos if i is not info])
        for offset, expect in [
            (other, REFUSE),  # on another tensor
            (info.offset + 1, REFUSE),  # misaligned
            (info.offset + 32, EITHER),  # into the padding or the next tensor
            (len(base.data), REFUSE),  # past the end
            (2**63, REFUSE),
            (2**64 - 32, REFUSE),
        ]:
            changes.append((f"offset {offset}", expect, {"offset": offset}))
        renames = [(names[index - 1], REFUSE), (b"\xff\xfe.weight", REFUSE), (b"x" * 100, REFUSE)]
        renames.append((b"unused.weight", EITHER if optional else REFUSE))
        if info.name.startswith(b"blk.0."):
            renames.append((info.name.replace(b"blk.0.", b"blk.9."), REFUSE))
        for new_name, expect in renames:
            changes.append((f"named {new_name!r:.30}", expect, {"name": new_name}))
        changes.append(("removed", EITHER if optional else REFUSE, {}))
        for label, expect, fields in filter(None, changes):
            yield Case(f"{name}: {label}", expect, _info_edit(base, index, **fields))


def _header_cases(base: Layout) -> Iterator[Case]:
    for version in (0, 1, 2, 4, 2**32 - 1):
        expect = ACCEPT if version == 2 else REFUSE
        yield Case(f"version {version}", expect, base.copy(version=version).encode)
    for which, real in (("tensor", len(base.infos)), ("kv", len(base.kv))):
        for stored in (0, real - 1, real + 1, 2**63, 2**64 - 1):
            counts = (stored, None) if which == "tensor" else (None, stored)
            # one tensor fewer: the last (output.weight) is missed, the data read from a
            # shifted start: garbage weights, but a valid file with a tied head
            expect = EITHER if (which, stored) == ("tensor", real - 1) else REFUSE
            yield Case(f"{which} count {stored}", expect, base.copy(counts=counts).encode)


def _byte_cases(base: Layout, rng: random.Random) -> Iterator[Case]:
    data = base.encode()
    data_start, data_end = next(r[1:] for r in base.regions if r[0] == "tensor data")
    for what, start, end in base.regions:  # the middle of the data is inside a tensor
        for at in sorted({start, (start + end) // 2}):
            yield Case(f"cut at {at} (in {what})", REFUSE, lambda at=at: data[:at])
    for i in range(40):
        positions = [rng.randrange(data_start) for _ in range(rng.randint(1, 8))]
        flipped = bytearray(data)
        for p in positions:
            flipped[p] = rng.randrange(256)
        yield Case(f"header bytes {positions} flipped #{i}", EITHER, lambda f=bytes(flipped): f)
    for _ in range(5):
        at = rng.randrange(data_start, data_end - 8)
        nan = data[:at] + struct.pack("<f", _NAN) * 2 + data[at + 8 :]
        yield Case(f"tensor data at {at} NaN", EITHER, lambda d=nan: d)


def cases(base_path: Path, rng: random.Random) -> list[Case]:
    """Every mutation of the tiny model at ``base_path`` (byte flips drawn from ``rng``)."""
    base = Layout.read(base_path)
    out = [Case("the model itself", ACCEPT, base.encode)]
    for gen in (_header_cases(base), _metadata_cases(base), _info_cases(base)):
        out += list(gen)
    return out + list(_byte_cases(base, rng))


class FuzzWorker:
    """A ``gguf_fuzz_worker.py`` process: ``check(path)`` runs a file as ``dynalm run``."""

    def __init__(self, warm_up: Path, memory_mib: int = 1024, timeout: int = 20) -> None:
        cmd = [sys.executable, str(WORKER), "--warm-up", str(warm_up)]
        cmd += ["--memory", str(memory_mib), "--timeout", str(timeout)]
        self._timeout = timeout + 30
        pipe = subprocess.PIPE
        self._proc = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, text=True)
        self._answer()

    def _answer(self) -> dict:
        ready, _, _ = select.select([self._proc.stdout], [], [], self._timeout + 60)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._proc.kill()
            raise RuntimeError(f"the fuzz worker stopped answering (exit {self._proc.poll()})")
        return json.loads(line)

    def check(self, path: Path) -> dict:
        self._proc.stdin.write(json.dumps({"path": str(path)}) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # (on a loaded host) never hide the test's result
            self._proc.kill()
            self._proc.wait()
