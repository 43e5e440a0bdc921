"""Hostile model files: corrupt GGUFs are refused with one clear error, never a crash.

* ``test_fuzz_tiny_model``: 600 of ~1,500 mutations of a tiny valid model (`gguf_fuzz`),
  drawn with a fixed seed and a random one (printed; ``DYNALM_FUZZ_SEED`` replays it,
  ``DYNALM_FUZZ_CASES=all`` runs all of them), each run as ``dynalm run`` would in a child
  process under a memory limit and a timeout. Each must end as its label says (refused,
  accepted, or either), and a refusal must be one short line naming the file.
* Named regressions: the defect files of issue 11, mostly 4-byte edits of the header of the
  real test model (its tensor data a sparse hole: they are refused before any is read).
* A few of them through the real CLI (also under ``python -O``, which drops asserts).
* ``test_atheris_header_parser``: coverage-guided fuzzing of the header parser, bounded.
"""

from __future__ import annotations

import math
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from atheris_run import fuzz
from gguf import GGMLQuantizationType as T
from gguf_edit import Layout, V, value
from gguf_fuzz import ACCEPT, REFUSE, Case, FuzzWorker, cases, write_tiny_model
from test_cli import DYNALM, assert_one_line_error

from dynalm.models.hparams import MAX_VOCAB

FIXED_SEED = 11
MAX_MESSAGE = 600  # characters of a refusal (values in it are cut at 200)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")


@pytest.fixture(scope="module")
def worker(tiny: Path) -> FuzzWorker:
    w = FuzzWorker(tiny)
    yield w
    w.close()


@pytest.fixture(scope="module")
def smollm2_layout(smollm2_gguf: Path) -> Layout:
    return Layout.read(smollm2_gguf)


def problem(case: Case, result: dict, path: Path) -> str | None:
    """What is wrong with how ``result`` (a `FuzzWorker` answer) handled ``case``, if any."""
    status, message = result["status"], result["message"]
    if status not in ("ok", "refused"):
        return f"{status} ({result['phase']}): {message[-2000:]}"
    if case.expect == REFUSE and status == "ok":
        return "accepted, but the file is invalid"
    if case.expect == ACCEPT and status == "refused":
        return f"refused a valid file: {message}"
    if status == "refused":
        if "\n" in message or len(message) > MAX_MESSAGE:
            return f"an error of {len(message)} characters or several lines: {message[:300]!r}"
        if result["phase"] == "load" and str(path) not in message:
            return f"the error does not name the file: {message}"
    return None


def run_cases(worker: FuzzWorker, chosen: list[Case], path: Path) -> list[str]:
    failures = []
    for case in chosen:
        path.write_bytes(case.data())
        result = worker.check(path)
        if (wrong := problem(case, result, path)) is not None:
            failures.append(f"{case.name}: {wrong}")
    return failures


def test_fuzz_tiny_model(tiny: Path, worker: FuzzWorker, tmp_path: Path) -> None:
    seed = int(os.environ.get("DYNALM_FUZZ_SEED") or random.randrange(2**32))
    print(f"GGUF fuzz: fixed seed {FIXED_SEED}, random seed {seed} (DYNALM_FUZZ_SEED={seed})")
    fixed, drawn = cases(tiny, random.Random(FIXED_SEED)), cases(tiny, random.Random(seed))
    count = os.environ.get("DYNALM_FUZZ_CASES", "600")
    if count == "all":
        chosen = fixed + [c for c in drawn if "flipped" in c.name or "NaN" in c.name]
    else:
        n = int(count)
        chosen = random.Random(FIXED_SEED).sample(fixed, 2 * n // 3)
        chosen += random.Random(seed).sample(drawn, n - len(chosen))
    t0 = time.monotonic()
    failures = run_cases(worker, chosen, tmp_path / "case.gguf")
    print(f"{len(chosen)} cases in {time.monotonic() - t0:.1f} s")
    assert not failures, f"seed {seed}: {len(failures)} of {len(chosen)} cases:\n" + "\n".join(
        failures
    )


L = "llama."


def _set(key: str, vtype: V, v: object, sub: V | None = None):
    return lambda layout: layout.set_value(key, value(vtype, v, sub))


def _info(name: str, **fields: object):
    return lambda layout: layout.set_info(name, **fields)


def _linear_scaling(factor: float):
    def edit(layout: Layout) -> Layout:
        layout = layout.set_value(L + "rope.scaling.type", value(V.STRING, "linear"))
        return layout.set_value(L + "rope.scaling.factor", value(V.FLOAT32, factor))

    return edit


def _offset_of(name: str, plus: int = 0):
    def edit(layout: Layout) -> Layout:
        other = next(i for i in layout.infos if i.name == name.encode())
        return layout.set_info("blk.0.attn_k.weight", offset=other.offset + plus)

    return edit


# Issue 11's defect files, as edits of SmolLM2's header, and what the error must say.
SMOLLM2_DEFECTS = {
    # memory safety: the rope kernel wrote past each row
    "rope_dim_131072": (_set(L + "rope.dimension_count", V.UINT32, 131072), "= 131072"),
    "rope_dim_128": (_set(L + "rope.dimension_count", V.UINT32, 128), "= 128"),
    "rope_dim_0xFFFFFFFF": (_set(L + "rope.dimension_count", V.UINT32, 2**32 - 1), "4294967295"),
    # tracebacks
    "head_count_0": (_set(L + "attention.head_count", V.UINT32, 0), "head_count = 0"),
    "head_count_kv_0": (_set(L + "attention.head_count_kv", V.UINT32, 0), "head_count_kv = 0"),
    "block_count_0": (_set(L + "block_count", V.UINT32, 0), "block_count = 0"),
    "embedding_length_0": (_set(L + "embedding_length", V.UINT32, 0), "embedding_length = 0"),
    "key_length_0": (_set(L + "attention.key_length", V.UINT32, 0), "key_length = 0"),
    "context_length_inf": (_set(L + "context_length", V.FLOAT32, math.inf), "= inf"),
    "embedding_length_array": (
        _set(L + "embedding_length", V.ARRAY, [576], V.UINT32),
        "embedding_length = [576]",
    ),
    "no_tokens": (lambda layout: layout.without("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    "merge_invalid_utf8": (
        _set("tokenizer.ggml.merges", V.ARRAY, [b"\xff a"], V.STRING),
        "merges[0]",
    ),
    "unknown_token_id_1e9": (
        _set("tokenizer.ggml.unknown_token_id", V.UINT32, 10**9),
        "unknown_token_id = 1000000000",
    ),
    "token_embd_rows_49151": (_info("token_embd.weight", ne=[576, 49151]), "49151 rows"),
    "token_embd_width_544": (_info("token_embd.weight", ne=[544, 49152]), "embedding_length"),
    "norm_width_575": (_info("blk.3.attn_norm.weight", ne=[575]), "blk.3.attn_norm.weight"),
    # accepted corrupt files
    "block_count_1": (_set(L + "block_count", V.UINT32, 1), "block_count = 1"),
    "block_count_29": (_set(L + "block_count", V.UINT32, 29), "block_count = 29"),
    "block_count_-1": (_set(L + "block_count", V.INT32, -1), "block_count = -1"),
    "freq_base_0": (_set(L + "rope.freq_base", V.FLOAT32, 0.0), "freq_base = 0.0"),
    "freq_base_-1": (_set(L + "rope.freq_base", V.FLOAT32, -1.0), "freq_base = -1.0"),
    "freq_base_nan": (_set(L + "rope.freq_base", V.FLOAT32, math.nan), "freq_base = nan"),
    "freq_base_inf": (_set(L + "rope.freq_base", V.FLOAT32, math.inf), "freq_base = inf"),
    "rms_eps_inf": (_set(L + "attention.layer_norm_rms_epsilon", V.FLOAT32, math.inf), "= inf"),
    "rms_eps_nan": (_set(L + "attention.layer_norm_rms_epsilon", V.FLOAT32, math.nan), "= nan"),
    "rms_eps_0": (_set(L + "attention.layer_norm_rms_epsilon", V.FLOAT32, 0.0), "= 0.0"),
    "same_offset": (_offset_of("blk.0.attn_q.weight"), "overlap"),
    "overlapping": (_offset_of("blk.0.attn_q.weight", plus=64), "overlap"),
    "rope_scaling_factor_-1": (_linear_scaling(-1.0), "scaling.factor = -1.0"),
}


@pytest.mark.parametrize("defect", SMOLLM2_DEFECTS)
def test_smollm2_defect_is_refused(
    defect: str, smollm2_layout: Layout, worker: FuzzWorker, tmp_path: Path
) -> None:
    edit, needle = SMOLLM2_DEFECTS[defect]
    path = edit(smollm2_layout).write(tmp_path / f"{defect}.gguf", sparse_data=True)
    result = worker.check(path)
    case = Case(defect, REFUSE, bytes)
    assert problem(case, result, path) is None, problem(case, result, path)
    assert needle in result["message"], result["message"]


def test_corrupt_key_length_fails_fast_and_short(
    smollm2_layout: Layout, worker: FuzzWorker, tmp_path: Path
) -> None:
    """A key length of 37 MB (inside the file) once made a 37 MB error line after 23 s."""
    path = smollm2_layout.write(tmp_path / "key_length.gguf", sparse_data=True)
    start, _ = smollm2_layout.region("key b'general.name'")
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(struct.pack("<Q", 37_000_000))
    result = worker.check(path)
    assert result["status"] == "refused" and result["seconds"] < 5, result
    assert "37000000 bytes long" in result["message"] and len(result["message"]) < 300


def test_a_token_list_past_the_vocabulary_bound_is_refused_before_it_is_read(
    tiny: Path, worker: FuzzWorker, tmp_path: Path
) -> None:
    """Issue 31: a token list padded to 30M entries cost 10 GB before the memory plan ran;
    a string array longer than ``MAX_VOCAB`` is refused by its count (here 2,097,153 empty
    strings), in a child allowed 1 GiB and within a second."""
    n = MAX_VOCAB + 1
    tokens = struct.pack("<IIQ", V.ARRAY, V.STRING, n) + bytes(8 * n)  # n empty strings
    path = Layout.read(tiny).set_value("tokenizer.ggml.tokens", tokens).write(tmp_path / "t.gguf")
    result = worker.check(path)
    assert result["status"] == "refused" and result["seconds"] < 5, result
    assert result["message"] == (
        f"{path}: metadata 'tokenizer.ggml.tokens' holds 2097153 strings, more than 2097152 "
        "(the largest vocabulary read)"
    )


@pytest.mark.parametrize("mode", ["auto", "exact", "safe"])
def test_nan_scales_of_an_untied_embedding_are_refused_naming_it(
    mode: str, tiny: Path, tmp_path: Path
) -> None:
    """Issue 31: the quantised matmul weights' block scales are checked as they are
    repacked, but an untied token_embd.weight (only ever gathered) was not: NaN rows went
    into the JIT matmuls, which swallow them. The tiny model's embedding is Q8_0 (d at byte
    0 of 34) and untied (it has output.weight)."""
    layout = Layout.read(tiny)
    info = next(i for i in layout.infos if i.name == b"token_embd.weight")
    assert info.type == T.Q8_0 and any(i.name == b"output.weight" for i in layout.infos)
    data = bytearray(layout.data)
    block = info.offset + 34 * (3 * 2 + 1)  # row 3 (2 blocks of 32 a row), block 1
    data[block : block + 2] = np.array([np.inf], np.float16).tobytes()
    path = layout.copy(data=bytes(data)).write(tmp_path / "nan-embd.gguf")
    cmd = [sys.executable, *DYNALM[1:], "run", str(path), "hi", "--mode", mode]
    result = subprocess.run(cmd + ["--max-tokens", "2"], capture_output=True, text=True)
    assert_one_line_error(
        result,
        "tensor token_embd.weight: q8_0 block 1 of row 3 has a non-finite scale (inf; 1 such",
    )


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}",
            "took more than",
        ),
        ("{{ 'x' * 4000000000 }}", "a repetition of 4000000000 characters"),
    ],
)
def test_hostile_chat_template_is_refused(
    template: str, needle: str, tiny: Path, worker: FuzzWorker, tmp_path: Path
) -> None:
    edited = Layout.read(tiny).set_value("tokenizer.chat_template", value(V.STRING, template))
    result = worker.check(edited.write(tmp_path / "template.gguf"))
    assert result["status"] == "refused", result
    assert "tokenizer.chat_template" in result["message"] and needle in result["message"]


@pytest.mark.parametrize("defect", ["rope_dim_131072", "block_count_29", "norm_width_575"])
@pytest.mark.parametrize("optimize", [[], ["-O"]])
def test_defect_through_the_cli(
    defect: str, optimize: list[str], smollm2_layout: Layout, tmp_path: Path
) -> None:
    edit, needle = SMOLLM2_DEFECTS[defect]
    path = edit(smollm2_layout).write(tmp_path / f"{defect}.gguf", sparse_data=True)
    cmd = [sys.executable, *optimize, *DYNALM[1:], "run", str(path), "hi", "--max-tokens", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert_one_line_error(result, str(path), needle)


def test_atheris_header_parser(tiny: Path, tmp_path: Path) -> None:
    """libFuzzer mutates a tiny model's header 20,000 times; any exception that is not a
    DynaError fails (the crashing input is kept in ``tmp_path``)."""
    layout = Layout.read(tiny)
    fuzz("gguf_atheris.py", layout.encode()[: layout.region("tensor data")[0] + 512], tmp_path)
