"""The `dynalm` CLI end to end, as a user runs it (a real subprocess each time).

Good input: the answer streams to stdout, nothing else does. Bad input: one line on
stderr naming the problem, a non-zero exit, no traceback (unless --verbose).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import jsonschema
import numpy as np
import pytest

DYNALM = [sys.executable, "-m", "dynalm.cli"]


def dynalm(
    *args: str, stdin: str | None = None, home: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {})}
    if home is not None:
        env["DYNALM_HOME"] = str(home)
    return subprocess.run(
        [*DYNALM, *args], input=stdin, capture_output=True, text=True, env=env, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert result.stdout == ""


def write_gguf(path: Path, arch: str, tensor_type: gguf.GGMLQuantizationType | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    data = np.zeros((4, 32), np.float32)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", data)
    else:  # raw bytes of the right size for a type we do not support
        size, nbytes = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((4, 256 // size * nbytes), np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GREEDY = ["--temperature", "0", "--max-tokens", "12"]


def test_run_streams_only_the_answer(smollm2_gguf: Path):
    result = dynalm("run", str(smollm2_gguf), "What is the capital of France?", *GREEDY)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "capital of France?" not in result.stdout  # never the prompt


def test_run_reads_stdin_and_verbose_reports_speed(smollm2_gguf: Path):
    result = dynalm(
        "run", str(smollm2_gguf), "-", *GREEDY, "--verbose", stdin="What is the capital of France?"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr and "tokens/s" not in result.stdout
    assert "weight repack" in result.stderr and "first token after" in result.stderr
    # --backend auto (the default) found no usable GPU here and says why
    assert "backend auto: using the CPU (cuda: " in result.stderr


def test_gpu_fails_with_the_reason_instead_of_falling_back(smollm2_gguf: Path):
    result = dynalm("run", str(smollm2_gguf), "Hi", *GREEDY, "--gpu")
    assert_one_line_error(result, "--gpu: no usable GPU (cuda: ", "use --cpu")


def test_run_imports_nothing_it_does_not_use(smollm2_gguf: Path):
    """Start-up time: `run` never pays for the server, the downloader or transformers."""
    cmd = [sys.executable, "-X", "importtime", *DYNALM[1:], "run", str(smollm2_gguf), "hi"]
    result = subprocess.run([*cmd, *GREEDY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in result.stderr.splitlines()}
    heavy_modules = ("fastapi", "uvicorn", "transformers", "torch", "httpx", "huggingface_hub")
    for heavy in (*heavy_modules, "llguidance"):
        assert heavy not in imported, heavy


def test_run_json_schema(smollm2_gguf: Path, tmp_path: Path):
    schema = {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
        "required": ["colours"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = dynalm("run", str(smollm2_gguf), "List three colours", "--json-schema", str(path))
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    path.write_text('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    result = dynalm("run", str(smollm2_gguf), "hi", "--json-schema", str(path))
    assert_one_line_error(result, "--json-schema", "/nowhere")
    path.write_text("[1, 2")
    result = dynalm("run", str(smollm2_gguf), "hi", "--json-schema", str(path))
    assert_one_line_error(result, "--json-schema", "cannot read a JSON schema")


def test_same_seed_same_output(smollm2_gguf: Path):
    args = (
        "run",
        str(smollm2_gguf),
        "Tell me a story.",
        "--max-tokens",
        "16",
        "--seed",
        "7",
        "--temperature",
        "1.0",
    )
    first, second = dynalm(*args), dynalm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_interactive_chat_on_a_terminal(smollm2_gguf: Path):
    """On a terminal, no prompt starts a multi-turn chat that /bye ends."""
    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        [*DYNALM, "run", str(smollm2_gguf), *GREEDY],
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(terminal)
    os.write(controller, b"What is the capital of France?\nAnd of Italy?\n/bye\n")
    out, err = proc.communicate(timeout=300)
    os.close(controller)
    assert proc.returncode == 0, err
    answers = [a for a in out.replace(">>> ", "").split("\n\n") if a.strip()]
    assert len(answers) == 2 and "Paris" in answers[0], out


def test_missing_file(tmp_path: Path):
    assert_one_line_error(dynalm("run", str(tmp_path / "nope.gguf"), "hi"), "nope.gguf")


def test_not_a_gguf(tmp_path: Path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am a text file\n")
    assert_one_line_error(dynalm("run", str(path), "hi"), "not a GGUF")


def test_truncated_gguf(tmp_path: Path, smollm2_gguf: Path):
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        path.write_bytes(f.read(5_000_000))
    assert_one_line_error(dynalm("run", str(path), "hi"), "truncated")


def test_unsupported_tensor_type(tmp_path: Path):
    path = write_gguf(tmp_path / "iq.gguf", "llama", gguf.GGMLQuantizationType.IQ2_XXS)
    assert_one_line_error(
        dynalm("run", str(path), "hi"), "tensor 'token_embd.weight' has type IQ2_XXS"
    )


def test_unknown_architecture(tmp_path: Path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba")
    assert_one_line_error(dynalm("run", str(path), "hi"), "unknown architecture 'mamba'")


def test_unknown_catalog_name(tmp_path: Path):
    assert_one_line_error(dynalm("run", "nosuchmodel:7b", "hi", home=tmp_path), "nosuchmodel")


def test_prompt_longer_than_ctx(smollm2_gguf: Path):
    result = dynalm("run", str(smollm2_gguf), "word " * 200, "--ctx", "64")
    assert_one_line_error(result, "context")


def test_gpu_says_why(smollm2_gguf: Path):
    assert_one_line_error(dynalm("run", str(smollm2_gguf), "hi", "--gpu"), "GPU")


def test_weight_pages_flag_variable_and_default(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
):
    """Where `dynalm run` puts the weights (--verbose says): mapped by default (a one-off
    answer does not repay copying them), on huge pages with --weight-pages huge or
    $DYNALM_WEIGHT_PAGES=huge (where the kernel has them), the flag over the variable; a
    bad value of either is a one-line error naming it."""
    from dynalm.core.memory import transparent_huge_pages

    monkeypatch.delenv("DYNALM_WEIGHT_PAGES", raising=False)
    huge = "on 2 MiB huge pages" if transparent_huge_pages() else "mapped"

    def placed(*flags: str, env: dict | None = None) -> str:
        result = dynalm("run", str(smollm2_gguf), "hi", "--max-tokens", "1", "-v", *flags, env=env)
        assert result.returncode == 0, result.stderr
        return re.search(r"weights (on 2 MiB huge pages|mapped)\)", result.stderr).group(1)

    assert placed() == "mapped"
    assert placed("--weight-pages", "huge") == huge
    assert placed(env={"DYNALM_WEIGHT_PAGES": "huge"}) == huge
    assert placed("--weight-pages", "mapped", env={"DYNALM_WEIGHT_PAGES": "huge"}) == "mapped"
    bad = dynalm("run", str(smollm2_gguf), "hi", "--weight-pages", "big")
    assert_one_line_error(bad, "--weight-pages")
    bad = dynalm("run", str(smollm2_gguf), "hi", env={"DYNALM_WEIGHT_PAGES": "big"})
    assert_one_line_error(bad, "DYNALM_WEIGHT_PAGES", "big")


def test_serve_weight_pages_huge_alone_mapped_with_replicas(monkeypatch: pytest.MonkeyPatch):
    """`serve` puts the weights on huge pages, but with --replicas (processes of their own,
    each of which would hold a copy there) maps them, which the replicas then share; the
    flag and the variable over either default. (The server and the cluster stubbed: what is
    checked is the setting they would start with.)"""
    from contextlib import contextmanager

    from typer.testing import CliRunner

    from dynalm import cli
    from dynalm.core import weight_pages
    from dynalm.runtime.serve import server

    seen = []
    placed = lambda *a, **k: seen.append(os.environ[weight_pages.VARIABLE])  # noqa: E731
    monkeypatch.setattr(server, "serve", placed)
    monkeypatch.setattr(cli, "_cluster", contextmanager(lambda *a: (yield None)))
    cases = {
        (): "huge",
        ("--replicas", "2"): "mapped",
        ("--replicas", "2", "--weight-pages", "huge"): "huge",
        ("--weight-pages", "mapped"): "mapped",
    }
    for args in cases:
        monkeypatch.setenv(weight_pages.VARIABLE, "unset below; restored after the test")
        monkeypatch.delenv(weight_pages.VARIABLE)
        result = CliRunner().invoke(cli.app, ["serve", *args])
        assert result.exit_code == 0, result.output
    monkeypatch.setenv(weight_pages.VARIABLE, "huge")
    assert CliRunner().invoke(cli.app, ["serve", "--replicas", "2"]).exit_code == 0
    assert seen == [*cases.values(), "huge"]


def test_verbose_error_shows_traceback(tmp_path: Path):
    result = dynalm("run", str(tmp_path / "nope.gguf"), "hi", "--verbose")
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.parametrize("flag", [["--graph"], []])
def test_show(smollm2_gguf: Path, flag: list[str]):
    result = dynalm("show", str(smollm2_gguf), *flag)
    assert result.returncode == 0, result.stderr
    if flag:
        assert "matmul %" in result.stdout and "tensor<q4_1, [576, 576]>" in result.stdout
    else:
        for needle in ("llama", "q4_1", "8192", "272", "im_start"):
            assert needle in result.stdout


def test_show_system():
    result = dynalm("show", "--system")
    assert result.returncode == 0 and "cores" in result.stdout
    assert "matmul kernel by batch size T" in result.stdout
    assert "T 1-3: gemv" in result.stdout  # auto: T < 4 takes the GEMV
    assert "T 1-2: gemv; T >=3: tile 3x4" in result.stdout  # exact: tiles of 3 rows
    result = dynalm("show", "--system", env={"DYNALM_ISA": "generic"})
    assert "kernel backend      generic" in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "{m}", "hi", "--kv-cache-dtype", "bogus"], "'bogus' is not one of"),
        (["serve", "{m}", "--kv-cache-dtype", "bogus"], "'bogus' is not one of"),
        (["serve", "{m}", "--port", "70000"], "--port"),
        (["serve", "{m}", "--shutdown-grace", "-1"], "--shutdown-grace"),
        (["run", "{m}", "hi", "--threads", "-3"], "--threads"),
        (["run", "{m}", "hi", "--max-tokens", "many"], "--max-tokens"),
        (["run", "{m}", "hi", "--ctx", "1"], "--ctx"),
        (["run"], "Missing argument 'model'"),
        (["pull", "x", "--no-such-flag"], "No such option"),
    ],
)
def test_usage_errors_are_one_line(smollm2_gguf: Path, args: list[str], needle: str):
    result = dynalm(*(a.format(m=smollm2_gguf) for a in args))
    assert result.returncode == 2
    assert_one_line_error(result, needle)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--threads", "1000"], ["--threads 1000", "CPUs"]),
        (["--ctx", "1000000"], ["--ctx 1000000", "8192 tokens", "context_length"]),
        (["--temperature", "inf"], ["--temperature", "a number in [0, 100]", "'inf'"]),
        (["--seed", "-1"], ["--seed", "[0, 18446744073709551615]"]),
        (["--speculative", "ngram", "--num-draft-tokens", "0"], ["--num-draft-tokens", "[1, 16]"]),
        (["--speculative", "ngram", "--num-draft-tokens", "17"], ["--num-draft-tokens", "'17'"]),
        (["--speculative", "medusa"], ["--speculative 'medusa'", "ngram, layer-skip"]),
    ],
)
def test_flags_beyond_the_machine_or_model(smollm2_gguf: Path, flags: list[str], needles):
    t0 = time.monotonic()
    result = dynalm("run", str(smollm2_gguf), "hi", *flags)
    assert_one_line_error(result, *needles)
    assert time.monotonic() - t0 < 60  # refused, not attempted


def test_serve_refuses_bad_sizes_before_loading(smollm2_gguf: Path):
    for size in ("lots", "10", "9" * 400):
        needle = "--max-body-size': must be a size in [1KiB, 1GiB]"
        assert_one_line_error(dynalm("serve", str(smollm2_gguf), "--max-body-size", size), needle)


def test_prompt_that_is_not_utf8(smollm2_gguf: Path):
    cmd = [*DYNALM, "run", str(smollm2_gguf)]
    for args, stdin, needle in [([b"caf\xe9"], None, "the prompt"), (["-"], b"\xff\xfe", "stdin")]:
        raw = subprocess.run([*cmd, *args], input=stdin, capture_output=True, timeout=300)
        result = subprocess.CompletedProcess(
            raw.args, raw.returncode, raw.stdout.decode(), raw.stderr.decode()
        )
        assert_one_line_error(result, needle, "UTF-8")


LLAMA_LUM = Path(__file__).parents[2] / "src/dynalm/models/arch/llama.lum"


def test_check_a_family_file_alone_and_against_a_model(smollm2_gguf: Path) -> None:
    alone = dynalm("check", str(LLAMA_LUM))
    assert alone.returncode == 0 and "ok (family llama, mistral, qwen2" in alone.stdout
    both = dynalm("check", str(LLAMA_LUM), "--gguf", str(smollm2_gguf))
    assert both.returncode == 0 and "a graph of 484 nodes" in both.stdout


@pytest.mark.parametrize(
    ("old", "new", "column", "what"),
    [
        ("let h = norm(x,", "let h = norm(x,,", 20, "expected"),
        ("silu(matmul", "swish(matmul", 16, "unknown function or op 'swish'"),
        ('w"blk.{i}.ffn_up.weight"', 'w"blk.{i}.ffn_upp.weight"', 24,
         "the model has no tensor 'blk.0.ffn_upp.weight'"),
        ('gguf("dynalm.rope.neox", default = arch == "qwen2")', 'gguf("{arch}.rope.neox")',
         25, "the model's metadata has no llama.rope.neox and gguf() has no default"),
        ('gate.weight": [d_ff, d_model]', 'gate.weight": [d_model, d_ff]', 31,
         "tensor 'blk.0.ffn_gate.weight' has shape [1536, 576], expected [576, 1536]"),
        ("return matmul(gate * up,", "return matmul(gate * h,", 19,
         "operands of different shapes [T, 1536], [T, 576]"),
    ],
)  # fmt: skip
def test_check_reports_one_line_at_file_line_col(
    smollm2_gguf: Path, tmp_path: Path, old: str, new: str, column: int, what: str
) -> None:
    text = LLAMA_LUM.read_text()
    assert old in text
    line = text[: text.index(old)].count("\n") + 1  # the edited line, wherever llama.lum has it
    bad = tmp_path / "bad.lum"
    bad.write_text(text.replace(old, new, 1))
    result = dynalm("check", str(bad), "--gguf", str(smollm2_gguf))
    assert_one_line_error(result, f"{bad}:{line}:{column}: ", what)
    verbose = dynalm("check", str(bad), "--gguf", str(smollm2_gguf), "--verbose")
    assert "Traceback" in verbose.stderr and verbose.returncode == 1


def test_show_graph_text_reads_back(smollm2_gguf: Path, tmp_path: Path) -> None:
    printed = dynalm("show", str(smollm2_gguf), "--graph")
    assert printed.returncode == 0 and printed.stdout.startswith("graph @llama(")
    path = tmp_path / "g.dynair"
    path.write_text(printed.stdout)
    again = dynalm("show", "--graph-file", str(path))
    assert again.returncode == 0 and again.stdout == printed.stdout
    path.write_text(printed.stdout.replace("= swiglu", "= swiglo", 1))
    assert_one_line_error(dynalm("show", "--graph-file", str(path)), f"{path}:", "unknown op")


def test_serve_checks_kv_cache_memory_against_the_memory_plan(smollm2_gguf: Path):
    # within the flag's range (at most 1TiB), beyond this machine: the plan refuses it
    # before the pool is allocated
    result = dynalm("serve", str(smollm2_gguf), "--kv-cache-memory", "1TiB", "--port", "0")
    assert_one_line_error(result, "not enough memory", "KV 1024.0 GiB")


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_a_nan_activation_is_refused_in_auto_as_in_exact(
    mode: str, smollm2_gguf: Path, tmp_path: Path
) -> None:
    """One value of an F32 norm weight set to NaN: its layer's activations hold a NaN,
    which auto's int8 quantiser used to drop (the answer came out as fluent-looking
    nonsense); now the logits are not finite in auto as in exact, and the run says so."""
    path = tmp_path / "nan-norm.gguf"
    path.write_bytes(smollm2_gguf.read_bytes())
    info = next(
        t for t in gguf.GGUFReader(smollm2_gguf).tensors if t.name == "blk.3.attn_norm.weight"
    )
    assert info.tensor_type == gguf.GGMLQuantizationType.F32
    data = np.memmap(path, np.float32, "r+", offset=info.data_offset, shape=(info.n_elements,))
    data[5] = np.nan
    data.flush()
    del data
    result = dynalm("run", str(path), "hi", "--mode", mode, *GREEDY)
    assert_one_line_error(result, "logits that are not finite")


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_nan_block_scales_are_refused_naming_the_tensor(
    mode: str, smollm2_gguf: Path, tmp_path: Path
) -> None:
    """Issue 31: one tensor's block scales set to NaN, and the model answered fluently in
    auto/exact (the JIT kernels swallow NaN) while safe mode said "logits not finite"; the
    weight is now refused as it is prepared, naming the tensor."""
    path = tmp_path / "nan-scales.gguf"
    path.write_bytes(smollm2_gguf.read_bytes())
    name = "blk.3.ffn_down.weight"
    info = next(t for t in gguf.GGUFReader(smollm2_gguf).tensors if t.name == name)
    assert info.tensor_type == gguf.GGMLQuantizationType.Q4_1  # d at byte 0 of 20
    data = np.memmap(path, np.uint8, "r+", offset=info.data_offset, shape=(info.n_bytes,))
    data.reshape(-1, 20)[5:9, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    data.flush()
    del data
    result = dynalm("run", str(path), "hi", "--mode", mode, *GREEDY)
    assert_one_line_error(result, f"tensor {name}", "q4_1 block 5 of row 0", "non-finite scale")
