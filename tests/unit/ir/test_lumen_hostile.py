"""Hostile Lumen programs (issue 25): each is one ``file:line:col`` error — never a
RecursionError, an OverflowError, a hang or a program accepted with a nonsense value."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dynalm.errors import DynaError
from dynalm.ir.graph import TensorType
from dynalm.ir.lumen import Elaborator, LumenError, load_file, load_program
from dynalm.ir.lumen.elaborate import MAX_EVAL_DEPTH, MAX_ITERATIONS, MAX_STEPS
from dynalm.ir.lumen.tree import MAX_NESTING, cache_dir

D, V = 8, 20
WEIGHTS = {"embd": TensorType("q8_0", (V, D)), "norm": TensorType("f32", (D,))}
HEAD = "family toy\ninput tokens: tensor<i32, [T]>\n"


def forward(body: str = "") -> str:
    return f'forward {{\n{body}\n    output out = embed(tokens, w"embd")\n}}\n'


def lumen_error(text: str) -> str:
    """The one-line error of elaborating ``HEAD + text`` (as ``toy.lum``)."""
    with pytest.raises(LumenError) as e:
        program = load_program(HEAD + text, "toy.lum")
        Elaborator(program, "toy", {}, WEIGHTS).run()
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_a_plain_program_still_elaborates():
    program = load_program(HEAD + forward("let a = 1 + 2 * 3"), "toy.lum")
    assert [n.op for n in Elaborator(program, "toy", {}, WEIGHTS).run().nodes] == ["embed"]


# -- deep nesting: refused at a stated depth, located, whatever the shape ----------------
def _nested(kind: str, n: int) -> str:
    return {
        "neg": "param p: int = " + "-" * n + "1\n" + forward(),
        "not": "param p: bool = " + "not " * n + "true\n" + forward(),
        "sum": "param p: int = " + " + ".join(["1"] * n) + "\n" + forward(),
        "ifexpr": "param p: int = " + "if true then " * n + "1" + " else 2" * n + "\n" + forward(),
        "ifblock": forward("if true {" * n + "}" * n),
        "else_if": forward("if false { } else " * n + "{ }"),
        "call_args": "param p: float = " + "sqrt(" * n + "1" + ")" * n + "\n" + forward(),
        "loops": forward("for i in 0 .. 1 {" * n + "}" * n),
    }[kind]


@pytest.mark.parametrize(
    ("kind", "n", "where"),
    [
        ("neg", 5000, "toy.lum:3:"),
        ("not", 5000, "toy.lum:3:"),
        ("sum", 20000, "toy.lum:3:16"),
        ("ifexpr", 3000, "toy.lum:3:"),
        ("ifblock", 3000, "toy.lum:4:"),
        ("else_if", 3000, "toy.lum:4:"),
        ("call_args", 3000, "toy.lum:3:"),
        ("loops", 3000, "toy.lum:4:"),
    ],
)
def test_deep_nesting_is_a_located_error_not_a_recursion_error(kind: str, n: int, where: str):
    message = lumen_error(_nested(kind, n))
    assert message.startswith(where), message
    assert f"nested deeper than {MAX_NESTING} levels" in message


@pytest.mark.parametrize("kind", ["neg", "not", "sum", "ifexpr", "ifblock", "call_args"])
def test_nesting_up_to_the_stated_depth_still_elaborates(kind: str):
    # a sum or an if nests two rules a level (binop + operand, if_ + block)
    n = MAX_NESTING // 2 - 2 if kind in ("sum", "ifexpr", "ifblock") else MAX_NESTING - 4
    program = load_program(HEAD + _nested(kind, n), "toy.lum")
    Elaborator(program, "toy", {}, WEIGHTS).run()


def test_a_deeply_nested_file_does_not_poison_the_parse_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("DYNALM_CACHE", str(tmp_path))
    path = tmp_path / "deep.lum"
    path.write_text(HEAD + _nested("neg", 5000))
    for _ in range(2):  # the second run meets the same error, not a poisoned cache
        with pytest.raises(LumenError, match=r"deep.lum:3:\d+: nested deeper than"):
            load_file(path)
    assert not cache_dir().exists() or not any(cache_dir().iterdir())  # nothing was cached


@pytest.mark.parametrize(
    "entry",
    [
        b"[not json",
        b"[" * 100_000 + b"]" * 100_000,  # json.loads: RecursionError
        json.dumps(["start", [1, 1, 0, 0], [["x"] * 3]]).encode(),
        json.dumps({"t": 1, "v": "x", "p": [1, 1]}).encode(),
        json.dumps(["start", [1, 1, 0], []]).encode(),
        b"\xff\xfe\x00",
    ],
    ids=["truncated", "deep-array", "bad-child", "token-root", "short-meta", "binary"],
)
def test_a_corrupt_cache_entry_is_ignored_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: bytes
):
    monkeypatch.setenv("DYNALM_CACHE", str(tmp_path))
    path = tmp_path / "good.lum"
    path.write_text(HEAD + forward("let a = 1"))
    load_file(path)
    (cached,) = cache_dir().iterdir()
    cached.write_bytes(entry)
    assert load_file(path).forward is not None
    assert json.loads(cached.read_text())[0] == "start"  # rewritten


# -- the elaboration budget ---------------------------------------------------------------
def test_a_loop_of_a_billion_iterations_is_refused_before_it_runs():
    t0 = time.monotonic()
    message = lumen_error(forward("    for i in 0 .. 1000000000 { let a = i }"))
    assert message.startswith("toy.lum:4:5: a loop of 1000000000 iterations")
    assert f"at most {MAX_ITERATIONS} loop iterations" in message
    assert time.monotonic() - t0 < 5


def test_nested_loops_of_ten_thousand_exhaust_the_iteration_budget():
    message = lumen_error(forward("    for i in 0 .. 10000 { for j in 0 .. 10000 { let a = j } }"))
    assert message.startswith("toy.lum:4:27: a loop of 10000 iterations"), message


def test_a_loop_bound_that_is_a_huge_integer_is_refused():
    message = lumen_error(forward("    for i in 0 .. " + "9" * 40 + " { let a = i }"))
    assert message == "toy.lum:4:19: an integer beyond the int64 range (40 digits)"
    message = lumen_error(forward("    for i in 0 .. 9223372036854775807 * 2 { let a = i }"))
    assert message.startswith("toy.lum:4:19: an integer beyond the int64 range (about 2**63)")


FIB = "fn fib(n: int) -> int {\n if n < 2 { return n }\n return fib(n - 1) + fib(n - 2)\n}\n"


def test_an_exponential_recursion_runs_out_of_budget():
    message = lumen_error(FIB + forward("    let a = fib(60)"))
    assert message.startswith("toy.lum:"), message
    assert f"elaboration ran past its budget ({MAX_STEPS} steps" in message


def test_a_recursive_call_inside_a_param_runs_out_of_budget():
    message = lumen_error(FIB + "param p: int = fib(60)\n" + forward())
    assert f"ran past its budget ({MAX_STEPS} steps" in message
    deep = "fn f(n: int) -> int { return f(n + 1) }\nparam p: int = f(0)\n" + forward()
    assert "calls nested deeper than 64" in lumen_error(deep)


def test_evaluation_nesting_across_calls_is_bounded():
    # each function nests a little; together they would exhaust Python's stack
    body = "(" * 60 + "-" * 90 + "n" + ")" * 60
    text = f"fn f(n: int) -> int {{ if n > 0 {{ return f(n - 1) + {body} }}\n return 0 }}\n"
    message = lumen_error(text + forward("    let a = f(60)"))
    assert f"evaluation nested deeper than {MAX_EVAL_DEPTH} levels" in message


# -- numbers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("param", "where", "what"),
    [
        ("p: int = " + "9" * 5000, "3:16", "an integer beyond the int64 range (5000 digits)"),
        ("p: float = sqrt(" + "9" * 400 + ")", "3:23", "beyond the int64 range (400 digits)"),
        ("p: float = 9223372036854775807 * 4 / 3", "3:18", "beyond the int64 range"),
        ("p: float = 9223372036854775807 * 2 + 0.5", "3:18", "beyond the int64 range"),
        ("p: float = " + "9" * 5000 + ".0", "3:18", "a float that is not finite (inf)"),
        ("p: float = 1e308 * 10.0", "3:18", "a float that is not finite (inf)"),
        ('p: str = "{q}"', "4:", "an integer beyond the int64 range"),
        ("p: int = -9223372036854775807 - 2", "3:16", "beyond the int64 range"),
    ],
    ids=[
        "literal",
        "sqrt",
        "true-division",
        "float-mix",
        "float-literal",
        "float-overflow",
        "string-format",
        "negative",
    ],
)
def test_huge_numbers_are_located_errors(param: str, where: str, what: str):
    text = f"param {param}\n" + forward()
    if "{q}" in param:
        text = "param q: int = 4611686018427387904 * 2\n" + f"param {param}\n" + forward()
        where = "3:16"
    message = lumen_error(text)
    assert message.startswith(f"toy.lum:{where}"), message
    assert what in message


def test_a_huge_metadata_integer_is_refused_at_the_gguf_call():
    program = load_program(HEAD + 'param p: int = gguf("toy.big")\n' + forward(), "toy.lum")
    with pytest.raises(LumenError, match=r"^toy.lum:3:16: an integer beyond the int64 range"):
        Elaborator(program, "toy", {"toy.big": 2**64 - 1}, WEIGHTS).run()


# -- values that were accepted silently -----------------------------------------------------
ATTENTION = (
    '    let x = embed(tokens, w"embd")\n'
    "    let a = attention(x, x, x, layer = {layer}, n_heads = 2, n_kv_heads = 2, "
    "head_dim = 4, scale = 0.5)"
)


def test_a_negative_layer_attribute_is_refused():
    message = lumen_error(forward(ATTENTION.format(layer="-1")))
    assert message.startswith("toy.lum:5:13: attention(")
    assert "attention's attribute layer must be in [0, 2147483647], found -1" in message


@pytest.mark.parametrize("eps", ["1e308 * 10.0 - 1e308 * 10.0", "-1.0", "0.0 - 1e-5"])
def test_a_nan_or_negative_eps_is_refused(eps: str):
    message = lumen_error(
        forward(f'    let y = rms_norm(embed(tokens, w"embd"), w"norm", eps = {eps})')
    )
    assert message.startswith("toy.lum:4:"), message
    assert (
        "not finite" in message
        or "rms_norm's attribute eps must be finite and at least 0" in message
    )


def test_a_nan_attribute_is_refused_by_the_op_table():
    from dynalm.ir.builder import GraphBuilder
    from dynalm.ir.graph import GraphError

    b = GraphBuilder("t", WEIGHTS)
    x = b.op("embed", b.input("tokens", "i32", ("T",)), weights=(b.weight("embd"),))
    with pytest.raises(GraphError, match="eps must be finite and at least 0, found nan"):
        b.op("rms_norm", x, weights=(b.weight("norm"),), eps=float("nan"))


@pytest.mark.parametrize(
    ("dim", "found"), [("-5", "-5"), ("0", "0"), ("99999999999", "99999999999")]
)
def test_an_input_with_a_negative_or_absurd_dimension_is_refused(dim: str, found: str):
    message = lumen_error(f"input x: tensor<f32, [T, {dim}]>\n" + forward())
    assert message == (f"toy.lum:3:10: input x has a dimension {found}, not in [1, 2147483647]")


@pytest.mark.parametrize("name", ["blk..weight", "../embd", ".embd", "embd.", "a/b", "a b"])
@pytest.mark.parametrize("form", ['w"{}"', 'w?"{}"', 'has("{}")'])
def test_a_weight_name_that_is_not_a_tensor_name_is_refused(name: str, form: str):
    message = lumen_error(forward("    let a = " + form.format(name)))
    assert message.startswith("toy.lum:4:13: "), message
    assert f"{name!r} is not a tensor name" in message


# -- files ----------------------------------------------------------------------------------
def test_a_lum_file_that_is_binary_or_not_a_regular_file_is_refused(tmp_path: Path):
    binary = tmp_path / "bin.lum"
    binary.write_bytes(b"family toy\n\xff\xfe")
    with pytest.raises(DynaError, match=r"bin.lum: not UTF-8 text \(byte 0xff at offset 11\)"):
        load_file(binary)
    fifo = tmp_path / "fifo.lum"
    os.mkfifo(fifo)
    with pytest.raises(DynaError, match=r"fifo.lum: not a regular file"):
        load_file(fifo)  # without blocking on the open


def test_a_lum_file_past_its_bound_is_refused_by_its_size(tmp_path: Path):
    """Issue 25 part 2: a .lum file is read only up to MAX_FILE_BYTES, checked before the
    parser runs (a sparse file one byte past it: nothing is written or read)."""
    from dynalm.ir.lumen.program import MAX_FILE_BYTES

    big = tmp_path / "big.lum"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(DynaError, match=rf"big.lum: {MAX_FILE_BYTES + 1} bytes, more than the"):
        load_file(big)


def test_show_graph_file_on_a_binary_file_is_a_clear_error(tmp_path: Path):
    from typer.testing import CliRunner

    from dynalm.cli import app

    path = tmp_path / "graph.ir"
    path.write_bytes(bytes(range(256)) * 4)
    result = CliRunner().invoke(app, ["show", "--graph-file", str(path)])
    assert result.exit_code == 1
    assert f"error: {path}: not UTF-8 text (byte 0x80 at offset 128)" in result.output


def test_a_vector_weight_reads_as_a_matrix_only_with_outer_ones():
    """ggml's implicit outer dimensions (builder.check_weight_shape): "norm" [8] declared
    [?, 8] or [1, 8] is a [1, 8] weight (a squeezed one-label classifier); declared [2, 8]
    it is refused, and a missing inner dimension is never supplied."""
    from dynalm.ir.builder import GraphBuilder

    b = GraphBuilder("t", WEIGHTS)
    assert b.weight("norm", None, D).type == TensorType("f32", (1, D))
    assert b.weight("norm", 1, D).type == TensorType("f32", (1, D))
    assert b.weight("norm", 1, 1, D).type == TensorType("f32", (1, 1, D))
    for shape, expected in (((2, D), f"[2, {D}]"), ((D, None), f"[{D}, ?]")):
        with pytest.raises(DynaError) as e:
            b.weight("norm", *shape)
        assert str(e.value) == f"tensor 'norm' has shape [{D}], expected {expected}"
    program = load_program(
        HEAD + forward(f'let h = matmul(embed(tokens, w"embd"), w"norm": [2, {D}])'), "toy.lum"
    )
    with pytest.raises(DynaError) as e:
        Elaborator(program, "toy", {}, WEIGHTS).run()
    assert str(e.value) == f"toy.lum:4:40: tensor 'norm' has shape [{D}], expected [2, {D}]"
