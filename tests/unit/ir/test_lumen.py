"""The Lumen language: every kind of bad program is one ``file:line:col`` error naming what
was expected and what was found, before any weight is read; good programs elaborate to the
graph their ops describe."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dynalm.errors import DynaError, ModelFormatError
from dynalm.ir.graph import TensorType
from dynalm.ir.lumen import Elaborator, LumenError, load_file, load_program
from dynalm.ir.lumen.syntax import GRAMMAR, TABLES, _build, _grammar_hash, _parser
from dynalm.ir.passes import verify
from dynalm.models.arch import ARCH_DIR, GIVEN, family_files

D, F, V = 8, 16, 20
WEIGHTS = {
    "embd": TensorType("q8_0", (V, D)),
    "norm": TensorType("f32", (D,)),
    "up": TensorType("q4_0", (F, D)),
    "down": TensorType("q4_0", (D, F)),
}
META = {"toy.width": D, "toy.layers": np.array([2, 2, 2], np.int32), "toy.name": "t"}

HEADER = """family toy
param d: int = gguf("{arch}.width")
param n: int = gguf("{arch}.layers")
input tokens: tensor<i32, [T]>
"""
GOOD = (
    HEADER
    + """
fn ffn(x: tensor<f32, [T, d]>, up: tensor<Q, [F, d]>) -> tensor<f32, [T, d]> {
    return matmul(silu(matmul(x, up)), w"down": [d, F])
}
forward {
    let x = embed(tokens, w"embd")
    for i in 0 .. n {
        let x = x + ffn(rms_norm(x, w"norm", eps = 1e-5), w"up")
    }
    output out = x * 0.5
}
"""
)


def elaborate(text: str, meta: dict | None = None, weights: dict | None = None):
    program = load_program(text, "toy.lum")
    return Elaborator(program, "toy", META if meta is None else meta, weights or WEIGHTS).run()


def test_a_good_program_builds_its_graph():
    graph = elaborate(GOOD)
    verify(graph)
    ops = [n.op for n in graph.nodes]
    assert ops == ["embed"] + ["rms_norm", "matmul", "silu", "matmul", "add"] * 2 + ["scale"]
    assert graph.outputs["out"].type == TensorType("f32", ("T", D))
    assert graph.nodes[2].weights[0].type.dtype == "q4_0"  # Q bound from the file


def error(text: str, meta: dict | None = None, weights: dict | None = None) -> str:
    with pytest.raises(DynaError) as e:
        elaborate(text, meta, weights)
    message = str(e.value)
    assert "\n" not in message
    return message


def replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        (replace("let x = embed", "let x = = embed"), "toy.lum:10:13", "found '='"),
        (replace("silu(", "swish("), "toy.lum:7:19", "unknown function or op 'swish'"),
        (replace("matmul(x, up)", "matmul(x)"), "toy.lum:7:24", "matmul takes 2 to 3"),
        (replace("eps = 1e-5", "eps = 1e-5, axis = 1"), "toy.lum:12:25", "no argument axis="),
        (replace(", eps = 1e-5", ""), "toy.lum:12:25", "rms_norm needs the attribute eps"),
        (replace("output out = x * 0.5", "output out = y"), "toy.lum:14:18", "unknown name 'y'"),
        (replace("return matmul", "let r = matmul"), "toy.lum:6:4", "does not end with a return"),
        (replace("output out", "return x\n    output out"), "toy.lum:14:5", "return outside"),
        (GOOD.replace("family toy\n", ""), "toy.lum:1:1", "names no family"),
        (HEADER + "fn gguf() -> int { return 1 }\nforward { }", "toy.lum:5:4", "already defined"),
    ],
)
def test_static_errors_name_line_and_column(text: str, where: str, what: str):
    message = error(text)
    assert message.startswith(where + ": "), message
    assert what in message, message


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        # a shape mismatch: the op table's rule, with the expression and both shapes
        (replace('w"down": [d, F]', 'w"up"'), "toy.lum:7:12", "[16, 8]^T: the weight must be"),
        # an element-wise mismatch between two tensors
        (
            replace(
                "let x = x + ffn", 'let x = silu(embed(tokens, w"embd")) + matmul(x, w"up") + ffn'
            ),
            "toy.lum:12:17",
            "operands of different shapes [T, 8], [T, 16]",
        ),
        # a dtype rule: an activation where i32 ids belong
        (
            replace("embed(tokens,", "embed(x0,").replace(
                "forward {", 'forward {\n    let x0 = embed(tokens, w"embd")'
            ),
            "toy.lum:11:13",
            "ids is i32, found tensor<f32",
        ),
        # a function argument of the wrong type: the expression and both types
        (
            replace('w"up")', 'w"down")'),
            "toy.lum:12:21",
            'argument up of ffn: expected tensor<Q, [F, d]>, found weight "down"',
        ),
        # a weight where a value belongs, and a value where a weight belongs
        (
            replace("silu(matmul(x, up))", "silu(up)"),
            "toy.lum:7:19",
            "operand x of silu is a tensor value, found weight",
        ),
        (replace('w"embd")', "tokens)"), "toy.lum:10:13", "table of embed is a weight"),
        # a declared return type the body does not give
        (
            replace("-> tensor<f32, [T, d]> {", "-> tensor<f32, [T, F]> {"),
            "toy.lum:12:21",
            "ffn returns tensor<f32, [T, 8]>, declared tensor<f32, [T, F]>",
        ),
        # a let with a type ascription
        (
            replace("let x = embed", "let x: tensor<f32, [T, 7]> = embed"),
            "toy.lum:10:34",
            "expected tensor<f32, [T, 7]>, found tensor<f32, [T, 8]>",
        ),
        # scalar rules
        (replace("for i in 0 .. n", "for i in 0 .. 2.5"), "toy.lum:11:19", "expected int"),
        (
            replace("output out = x * 0.5", 'output out = x * "a"'),
            "toy.lum:14:18",
            "cannot apply '*' to tensor<f32, [T, 8]> and str",
        ),
        (
            HEADER.replace('gguf("{arch}.layers")', 'gguf("{arch}.name")') + GOOD[len(HEADER) :],
            "toy.lum:3:1",
            "expected int, found str ('t')",
        ),
        (replace("eps = 1e-5", "eps = true"), "toy.lum:12:25", "attribute eps is float"),
    ],
)
def test_type_errors_name_the_expression_and_both_types(text: str, where: str, what: str):
    message = error(text)
    assert message.startswith(where + ": "), message
    assert what in message, message


def test_model_file_faults_are_model_format_errors_at_the_reference():
    no_key = error(GOOD, meta={"toy.width": D})
    assert no_key.startswith("toy.lum:3:16: ") and "no toy.layers and gguf() has no default" in (
        no_key
    )
    missing = {k: v for k, v in WEIGHTS.items() if k != "down"}
    with pytest.raises(ModelFormatError, match=r"^toy.lum:7:40: the model has no tensor 'down'"):
        elaborate(GOOD, weights=missing)
    wrong = {**WEIGHTS, "down": TensorType("q4_0", (D, F + 1))}
    with pytest.raises(ModelFormatError, match=r"toy.lum:7:40: tensor 'down' has shape \[8, 17\]"):
        elaborate(GOOD, weights=wrong)
    varying = {**META, "toy.layers": np.array([2, 3], np.int32)}
    assert "toy.layers varies per layer" in error(GOOD, meta=varying)


def test_defaults_conditionals_and_optional_weights():
    text = (
        HEADER
        + """
param factor: float = gguf("{arch}.factor", default = d / 2)
forward {
    let x = embed(tokens, w"embd")
    let x = if has("bias") then x else x * factor
    if w?"bias" == w?"bias2" and not (n < 2) { let x = matmul(x, w"up", w?"bias") }
    output out = x
}
"""
    )
    with pytest.raises(LumenError, match="cannot apply '==' to none"):
        elaborate(text)
    graph = elaborate(text.replace('w?"bias" == w?"bias2" and ', ""))
    assert [n.op for n in graph.nodes] == ["embed", "scale", "matmul"]
    assert graph.nodes[1].attrs["factor"] == D / 2
    assert len(graph.nodes[2].weights) == 1  # the optional bias is absent
    assert math.isclose(graph.nodes[1].attrs["factor"], 4.0)


def test_the_grammar_tables_are_current():
    """`python -m dynalm.ir.lumen.syntax` rewrites them after a grammar change."""
    assert f'"grammar": "{_grammar_hash()}"' in TABLES.read_text()
    text = (ARCH_DIR / "llama.lum").read_text()
    assert _parser().parse(text) == _build().parse(text)
    assert "WEIGHT" in GRAMMAR


def test_every_family_file_checks_and_loads_fast():
    assert {"llama", "mistral", "qwen2", "gemma3"} <= set(family_files())
    for path in set(family_files().values()):
        start = time.perf_counter()
        program = load_program(path.read_text(), str(path), given=GIVEN)
        assert program.forward is not None
        assert time.perf_counter() - start < 1.0  # parsing; the figure is in the README


def test_tensor_dims_bind_as_type_variables_across_arguments(tmp_path: Path):
    text = (
        HEADER
        + """
fn both(a: tensor<f32, [T, W]>, b: tensor<f32, [T, W]>) -> tensor<f32, [T, W]> {
    return a + b
}
forward {
    let x = embed(tokens, w"embd")
    output out = both(x, matmul(x, w"up"))
}
"""
    )
    assert "argument b of both: expected tensor<f32, [T, W]>, found tensor<f32, [T, 16]>" in (
        error(text)
    )


def test_parsed_trees_are_cached_so_model_load_needs_no_lark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("DYNALM_CACHE", str(tmp_path))
    path = ARCH_DIR / "llama.lum"
    parsed = load_program(path.read_text(), str(path), given=GIVEN)
    first = load_file(path, GIVEN)  # parses, then writes the cache
    (entry,) = (tmp_path / "lumen").iterdir()
    assert load_file(path, GIVEN).params == first.params == parsed.params  # read back from it
    entry.write_text("[not json")  # a damaged entry is parsed again and rewritten
    assert load_file(path, GIVEN).fns.keys() == parsed.fns.keys()
    assert json.loads(entry.read_text())
    child = (
        "import sys\nfrom dynalm.models.arch import family_file, family_program\n"
        "family_program(family_file('llama'))\nassert 'lark' not in sys.modules"
    )
    env = {**os.environ, "DYNALM_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", child], check=True, env=env)
