"""HTTP fuzzing: schemathesis (its CLI, in a process of its own) generates requests from the
live server's /openapi.json, valid and invalid ones, with a fixed seed and a bounded number
per operation, and checks every answer: no 5xx and no hang, invalid data refused, and status
codes, content types, headers (405: Allow) and bodies as the document says. Its check that
every schema-valid request succeeds is left out: the document cannot say which prompts fit
the context or which token ids the vocabulary has. Its hook (`fuzz_hooks`) adds one: a 200
under an output constraint matches it (`constrained`).

The structured-output fuzzer goes where random documents rarely do: JSON schemas (sound
and hostile: huge bounds and repeats, $ref loops, contradictions, deep nesting), regexes,
choices, ``structured_outputs`` and tools with every ``tool_choice``, streamed and not, with
log-probs, on both generation endpoints; a fixed seed and a random one (printed;
``DYNALM_FUZZ_SEED`` replays it, ``DYNALM_FUZZ_CASES`` sets the count), bounded in time.
Each answer is a 400 or a 200 that keeps its constraint's promise."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from constrained import streamed_choices, violation
from serving import LiveServer, live_server

from dynalm.models.loader import LoadedModel
from workload import assert_no_leak


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    # a small context keeps each generated answer short
    with live_server(smollm2, ctx=64, max_queue=32) as s:
        yield s


def test_schemathesis_finds_nothing(server: LiveServer, tmp_path: Path) -> None:
    # its hook adds the check that a constrained 200 matches its constraint
    here = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"]
        + ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]
        + ["--max-examples", "15", "--seed", "1", "--generation-database", "none"]
        + ["--request-timeout", "30", "--no-color"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # where it keeps its cache
        env=env,
    )
    summary = run.stdout[run.stdout.rfind("SUMMARY") :]
    print(summary)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    assert " passed" in summary and "failure" not in summary
    # still healthy: it answers, and no request holds a KV page
    assert server.http().get("/health").status_code == 200
    server.wait_idle()
    assert server.engine.stats.kv_usage == 0
    assert_no_leak(server.engine)


# ---------------------------------------------------------------- structured output and tools

FIXED_SEED = 25
CASES = 48  # per run (DYNALM_FUZZ_CASES), at most BUDGET_S seconds
BUDGET_S = 150


def _text(rng: random.Random) -> str:
    return rng.choice(["a", "ok", "", "é", "日本", "🙂", "\\", '"', "x" * rng.randint(1, 40)])


def _schema(rng: random.Random, depth: int = 0) -> Any:
    """A JSON schema: mostly sound, sometimes hostile (huge bounds or repeats, $ref loops,
    contradictions, deep nesting, keys that are not keywords)."""
    leaves: list[Any] = [
        {"type": "integer", "minimum": rng.randint(-5, 5), "maximum": rng.randint(5, 99)},
        {"type": "integer", "minimum": 9, "maximum": 1},
        {"type": "integer", "maximum": rng.choice([2**63, -(2**70), 10**300])},
        {"type": "number", "exclusiveMinimum": rng.choice([0, 0.5, 1e308])},
        {"type": "string", "maxLength": rng.randint(0, 12)},
        {"type": "string", "minLength": rng.choice([1, 3, 10**9])},
        {"type": "string", "pattern": rng.choice(["^[a-c]{1,4}$", "^(a{1000}){1000}$", "^x+$"])},
        {"type": "string", "format": rng.choice(["date", "email", "uuid", "no-such-format"])},
        {"enum": [_text(rng) for _ in range(rng.randint(1, 4))]},
        {"const": rng.choice([1, "c", None, True, [1], {"k": 2}])},
        {"type": "boolean"},
        {"type": "null"},
        {"type": rng.choice(["string", "integer"]), "not": {}},
        {"$ref": "#"},
        {"$ref": "#/$defs/loop"},
        {"$ref": "#/nowhere"},
        {"type": ["string", "null"]},
        {"frobnicate": 1},
        True,
        False,
        {},
    ]
    if depth >= 3 or rng.random() < 0.4:
        return rng.choice(leaves)
    kind = rng.randrange(5)
    if kind == 0:
        names = rng.sample(["a", "b", "c", "d", "é", ""], rng.randint(0, 3))
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {n: _schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7],
        }
        if rng.random() < 0.5:
            schema["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
        return schema
    if kind == 1:
        low = rng.randint(0, 3)
        return {
            "type": "array",
            "items": _schema(rng, depth + 1),
            "minItems": low,
            "maxItems": rng.choice([low, low + 2, 10**6]),
        }
    if kind == 2:
        word = rng.choice(["anyOf", "oneOf", "allOf"])
        return {word: [_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == 3:
        return {
            "$defs": {"loop": {"$ref": "#/$defs/loop"}, "x": _schema(rng, depth + 1)},
            "$ref": "#/$defs/x",
        }
    return json.loads('{"items": ' * 120 + "{}" + "}" * 120)  # over the nesting limit


def _regex(rng: random.Random) -> str:
    atoms = ["a", "[0-9]", "[a-c]", "(yes|no)", r"\d", "é", "日", "x?", "\\.", " "]
    out = "".join(
        rng.choice(atoms) + rng.choice(["", "", "+", "*", "{2}", "{1,3}", "{100000}"])
        for _ in range(rng.randint(1, 4))
    )
    return rng.choice([out, out, "(a{1000}){1000}", "[a-", "a{2,1}", "(?=a)a"])


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    parameters = (
        _schema(rng)
        if rng.random() < 0.5
        else {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        }
    )
    return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}


def structured_case(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One request: a path and its body with one constraint or a set of tools."""
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 24),
        "temperature": rng.choice([0, 0.7, 1.5]),
        "seed": rng.randint(0, 2**64 - 1),
        "n": rng.choice([1, 1, 2]),
        "stream": rng.random() < 0.4,
    }
    kind = rng.randrange(8)
    if kind == 0:
        body["response_format"] = {"type": "json_object"}
    elif kind == 1:
        spec = {"name": "x", "schema": _schema(rng), "strict": rng.random() < 0.5}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif kind == 2:
        schema = _schema(rng)
        body["guided_json"] = json.dumps(schema) if rng.random() < 0.3 else schema
    elif kind == 3:
        body["guided_regex"] = _regex(rng)
    elif kind == 4:
        n = rng.choice([1, 2, 5, 1001])
        body["guided_choice"] = [_text(rng) + str(i) for i in range(n)]
    elif kind == 5:
        key = rng.choice(["json", "regex", "choice", "json_object"])
        value = {"json": {"type": "object"}, "regex": _regex(rng), "choice": ["red", "blue"]}
        body["structured_outputs"] = {key: value.get(key, True)}
    else:
        body["tools"] = [_tool(rng, i) for i in range(rng.randint(1, 3))]
        names = [t["function"]["name"] for t in body["tools"]]
        body["tool_choice"] = rng.choice(
            ["auto", "required", "none", {"type": "function", "function": {"name": names[0]}}]
        )
        body["parallel_tool_calls"] = rng.random() < 0.7
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.choice([0, 5, 20])
    if "tools" in body or rng.random() < 0.6:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "JSON please", "?"])}]
        return "/v1/chat/completions", body
    body.pop("top_logprobs", None)
    body["logprobs"] = rng.choice([None, 0, 5])
    body["prompt"] = rng.choice(["Answer:", "{", "The answer is"])
    body["echo"] = rng.random() < 0.2
    return "/v1/completions", {k: v for k, v in body.items() if v is not None}


@pytest.fixture(scope="module")
def roomy(smollm2: LoadedModel) -> Iterator[LiveServer]:
    # room for the tools' fallback prompt; few seats, so requests also wait their turn
    with live_server(smollm2, ctx=768, max_num_seqs=4, max_queue=32) as s:
        yield s


def _seeds() -> list[int]:
    if (seed := os.environ.get("DYNALM_FUZZ_SEED")) is not None:
        return [int(seed)]
    return [FIXED_SEED, int(os.environ["DYNALM_TEST_RUN_SEED"])]  # drawn by tests/conftest.py


@pytest.mark.parametrize("seed", _seeds())
def test_fuzz_structured_outputs_keep_their_promise(
    roomy: LiveServer, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each case: a 400 in OpenAI's error JSON, or a 200 whose every choice ended "stop" or
    "tool_calls" matches its constraint (`constrained.violation`); no 5xx, no error logged,
    and no page held afterwards. Replay a failing seed with DYNALM_FUZZ_SEED."""
    print(f"structured fuzz seed {seed} (DYNALM_FUZZ_SEED={seed} replays it)")
    rng = random.Random(seed)
    count = int(os.environ.get("DYNALM_FUZZ_CASES", CASES))
    deadline = time.monotonic() + BUDGET_S
    statuses: dict[int, int] = {}
    client = roomy.http()
    with caplog.at_level(logging.ERROR):
        for i in range(count):
            if time.monotonic() > deadline:
                break
            path, body = structured_case(rng)
            r = client.post(path, json=body)
            where = f"case {i} (seed {seed}): POST {path} {json.dumps(body)[:1500]}"
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), f"{where}\n-> {r.status_code} {r.text[:500]}"
            if r.status_code == 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, where
                continue
            if body.get("stream"):
                lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert lines[-1] == "[DONE]", where
                sent = [json.loads(ln) for ln in lines[:-1]]
                if errors := [e["error"] for e in sent if "error" in e]:  # a grammar gave up
                    assert errors[0]["type"] == "invalid_request_error", f"{where}\n{errors}"
                    continue
                choices = streamed_choices(sent)
            else:
                choices = r.json()["choices"]
            assert len(choices) == body["n"], where
            for choice in choices:
                problem = violation(body, choice)
                assert problem is None, f"{where}\n-> {problem}"
    print(f"{sum(statuses.values())} cases: {statuses}")
    assert sum(statuses.values()) >= min(count, 10)
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert roomy.http().get("/health").status_code == 200
    roomy.wait_idle()
    assert roomy.engine.stats.kv_usage == 0
