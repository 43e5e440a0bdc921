"""Every numeric flag of the CLI (issue 25): found by reading the commands' signatures, each
must go through ``dynalm.flags`` and refuse, before anything is loaded or allocated, Unicode
digits (``²``, ``³``, Arabic-Indic), thousands of digits, NaN and each side of its range —
with one ``error:`` line naming the flag and its range."""

from __future__ import annotations

import inspect
import types
import typing

import pytest
from typer.models import OptionInfo
from typer.testing import CliRunner

from dynalm import cli
from dynalm.errors import InvalidRequest
from dynalm.flags import (
    MAX_DURATION_S,
    Duration,
    Float,
    Int,
    Size,
    parse_duration,
    parse_float,
    parse_int,
    parse_size,
    size_text,
)

ARGUMENTS = {"perplexity": ["m", "text.txt"]}  # besides a MODEL


def numeric_flags() -> list[tuple[str, str, Int | Float | Size]]:
    """(command, --flag, parser) of every int or float option of every command."""
    found = []
    for command in cli.app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        hints = typing.get_type_hints(command.callback, include_extras=True)
        for param in inspect.signature(command.callback).parameters.values():
            hint = hints[param.name]
            if typing.get_origin(hint) is not typing.Annotated:
                continue
            base, info = typing.get_args(hint)[:2]
            if typing.get_origin(base) in (typing.Union, types.UnionType):
                base = next(a for a in typing.get_args(base) if a is not type(None))
            if base not in (int, float) or not isinstance(info, OptionInfo):
                continue
            assert isinstance(info.parser, (Int, Float, Size, Duration)), (
                f"{name} {param.name}: a numeric flag must be parsed by dynalm.flags"
            )
            decls = [d for d in info.param_decls if d.startswith("--")]
            flag = decls[0] if decls else "--" + param.name.replace("_", "-")
            found.append((name, flag, info.parser))
    return found


FLAGS = numeric_flags()


def test_the_table_covers_the_flags_the_issue_names():
    named = {(c, f) for c, f, _ in FLAGS}
    for flag in ("--max-body-size", "--kv-cache-memory", "--max-num-seqs", "--max-queue"):
        assert ("serve", flag) in named
    assert ("bench", "--repetitions") in named and ("run", "--seed") in named
    assert len(FLAGS) >= 25


def _bad_values(parser: Int | Float | Size) -> list[str]:
    bad = ["²", "³", "٣", "१२", "9" * 5000, "1e999", "nan", "-inf", "0x10", "", " "]
    if isinstance(parser, Duration):
        return [*bad, "5 minutes", "1d", "10m-", "--1", "1e400"]
    if isinstance(parser, Size):
        return [*bad, "9" * 400, "9" * 400 + "MiB", str(parser.lo - 1), str(parser.hi + 1)]
    if isinstance(parser, Int):
        return [*bad, "1.5", "10^18", str(parser.lo - 1), str(parser.hi + 1)]
    return [*bad, str(parser.lo - 1), str(parser.hi * 2 + 1)]


def _range(parser: Int | Float | Size) -> str:
    if isinstance(parser, Duration):
        return f"over {MAX_DURATION_S} s: forever"
    if isinstance(parser, Size):
        return f"[{size_text(parser.lo)}, {size_text(parser.hi)}]"
    if isinstance(parser, Int):
        return f"[{parser.lo}, {parser.hi}]"
    return f"[{parser.lo:g}, {parser.hi:g}]"


CASES = [(c, f, p, v) for c, f, p in FLAGS for v in _bad_values(p)]


@pytest.mark.parametrize(
    ("command", "flag", "parser", "value"),
    CASES,
    ids=[f"{c}{f}={v[:8]!a}" for c, f, _, v in CASES],
)
def test_a_bad_number_is_one_error_naming_the_flag_and_its_range(
    command: str, flag: str, parser: Int | Float | Size, value: str
):
    args = [command, *ARGUMENTS.get(command, ["m"]), f"{flag}={value}"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: Invalid value for ") and flag in line, line
    assert _range(parser) in line, line
    assert len(line) < 400


@pytest.mark.parametrize(("command", "flag", "parser"), FLAGS, ids=[f"{c}{f}" for c, f, _ in FLAGS])
def test_each_end_of_a_range_is_accepted(command: str, flag: str, parser: Int | Float | Size):
    ends = [parser.lo, parser.hi]
    texts = (
        [size_text(int(v)) for v in ends] if isinstance(parser, Size) else [str(v) for v in ends]
    )
    assert [parser(t) for t in texts] == ends


def test_sizes_take_units_exactly():
    assert parse_size("512MiB", "--x", 1, 2**40) == 512 << 20
    assert parse_size("1.5GB", "--x", 1, 2**40) == 1_500_000_000
    assert parse_size(" 8 kib ", "--x", 1, 2**40) == 8192
    assert parse_size("2TiB", "--x", 1, 2**41) == 2 << 40


def test_durations_take_ollamas_forms():
    """--keep-alive and a request's keep_alive: Go durations and seconds, as Ollama."""
    assert parse_duration("10m", "--x") == 600
    assert parse_duration("30s", "--x") == 30
    assert parse_duration("1h", "--x") == 3600
    assert parse_duration("1h30m", "--x") == 5400
    assert parse_duration("500ms", "--x") == 0.5
    assert parse_duration("300", "--x") == 300
    assert parse_duration("2.5", "--x") == 2.5
    assert parse_duration("0", "--x") == 0
    assert parse_duration("-1", "--x") == -1
    assert parse_duration("-5m", "--x") == -1  # any negative: forever
    assert parse_duration(str(MAX_DURATION_S + 1), "--x") == -1  # longer than any server runs
    assert parse_duration("999999h", "--x") == -1
    for bad in ("5 minutes", "1d", "m", "10m-", "nan", "1e999", "٣s"):
        with pytest.raises(InvalidRequest, match=r"^--x must be a duration such as 10m"):
            parse_duration(bad, "--x")


def test_a_number_inside_a_list_flag_goes_through_the_same_parser():
    with pytest.raises(InvalidRequest, match=r"^-p must be an integer in \[0, 9\]"):
        parse_int("٣", "-p", 0, 9)
    with pytest.raises(InvalidRequest, match=r"^--x must be a number in \[0, 1\]"):
        parse_float("1e999", "--x", 0, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-p", "²"], "error: each token count of -p must be an integer in [0, 1048576]"),
        (["-n", "³"], "error: each token count of -n must be an integer in [0, 1048576]"),
        (["-p", "9" * 5000], "error: each token count of -p must be an integer"),
        (["-p", "128,٣"], "error: each token count of -p must be an integer"),
    ],
    ids=["p-superscript", "n-superscript", "p-5000-digits", "p-arabic-indic"],
)
def test_bench_token_counts_refuse_unicode_and_huge_digits(args: list[str], message: str):
    result = CliRunner().invoke(cli.app, ["bench", "m", *args])
    assert result.exit_code == 1
    assert result.output.startswith(message), result.output


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-body-size", "9" * 400, "must be a size in [1KiB, 1GiB]"),
        ("--kv-cache-memory", "9" * 400, "must be a size in [1KiB, 1TiB]"),
        ("--max-num-seqs", "1000000000", "must be an integer in [1, 4096]"),
        ("--max-queue", "10^18", "must be an integer in [1, 1000000]"),
        ("--max-queue", "1000000000000000000", "must be an integer in [1, 1000000]"),
    ],
)
def test_serve_refuses_absurd_sizes_before_loading_anything(
    flag: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
):
    import dynalm.models.loader

    def no_load(*args: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(dynalm.models.loader, "load_model", no_load)
    result = CliRunner().invoke(cli.app, ["serve", "no-such-model", flag, value])
    assert result.exit_code == 2
    assert f"error: Invalid value for '{flag}': {message}" in result.output
