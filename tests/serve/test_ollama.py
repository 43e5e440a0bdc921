"""Ollama's API (``/api/*``) on a real server with the real model: the official ``ollama``
client end to end (chat and generate, streamed and not, options, format, tools, the model
endpoints), NDJSON framing line by line, and every bad input as a raw request answered with
Ollama's ``{"error": ...}`` and the right status; keep_alive and ``dynalm ps`` / ``stop``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from serving import MODEL, LiveServer, live_server

from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve import tools
from dynalm.runtime.serve.generation import Choice
from dynalm.runtime.serve.ollama import DEFAULTS, _OllamaChat
from dynalm.runtime.serve.protocol import keep_alive_seconds
from dynalm.store.catalog import ModelStore

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "store"))  # the fake Hub
from test_catalog import Hub, hub  # noqa: E402, F401 (the fixture)
from test_hub import GGUFS, ORG_REPO, publish  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "Say hello."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
COUNTERS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


def _store(root: Path, model: LoadedModel) -> ModelStore:
    """A store holding the test model as smollm2:135m (a link to its file)."""
    d = root / "models" / "smollm2" / "135m"
    d.mkdir(parents=True)
    (d / model.path.name).symlink_to(model.path)
    manifest = {
        "name": "smollm2",
        "tag": "135m",
        "filename": model.path.name,
        "sha256": "ab" * 32,
        "size": model.path.stat().st_size,
        "source": "test",
        "pulled_at": "2026-01-02T03:04:05+00:00",
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    return ModelStore(root, catalog={})


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    store = _store(tmp_path_factory.mktemp("home"), smollm2)
    with live_server(smollm2, ctx=2048, store=store) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def _post(server: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body, **kw)


def _ndjson(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer, each line checked to be one JSON object."""
    with server.http() as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        raw = "".join(r.iter_text())
    assert raw.endswith("\n")
    lines = raw.split("\n")[:-1]
    objects = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objects)
    return objects


def _check_final(obj: dict[str, Any], max_eval: int) -> None:
    assert obj["done"] is True and obj["done_reason"] in ("stop", "length")
    assert all(isinstance(obj[k], int) and obj[k] >= 0 for k in COUNTERS)
    assert obj["prompt_eval_count"] > 0 and 0 < obj["eval_count"] <= max_eval
    assert obj["total_duration"] >= obj["eval_duration"]
    datetime.fromisoformat(obj["created_at"].replace("Z", "+00:00"))  # RFC 3339


# ---------------------------------------------------------------- chat and generate


def test_chat_not_streamed(client: ollama.Client) -> None:
    r = client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    assert r.model == MODEL and r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason == "length" and r.eval_count == 8
    assert r.prompt_eval_count and r.total_duration and r.eval_duration
    _check_final(r.model_dump(), 8)


def test_chat_streamed_ndjson_lines_make_the_same_answer(
    server: LiveServer, client: ollama.Client
) -> None:
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    lines = _ndjson(server, "/api/chat", {"model": MODEL, "messages": ASK, "options": GREEDY})
    *parts, last = lines
    assert parts and all(o["done"] is False and o["model"] == MODEL for o in parts)
    assert all(o["message"]["role"] == "assistant" for o in lines)
    _check_final(last, 8)
    text = "".join(o["message"]["content"] for o in lines)
    assert text == whole.message.content
    # the client reads the same stream
    streamed = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in streamed) == text and streamed[-1].done


def test_generate_streamed_and_not(server: LiveServer, client: ollama.Client) -> None:
    whole = client.generate(model=MODEL, prompt="Name a color.", options=GREEDY, stream=False)
    assert whole.response and whole.done and whole.eval_count == 8
    lines = _ndjson(
        server, "/api/generate", {"model": MODEL, "prompt": "Name a color.", "options": GREEDY}
    )
    assert all(not o["done"] for o in lines[:-1]) and lines[-1]["response"] == ""
    _check_final(lines[-1], 8)
    assert "".join(o["response"] for o in lines) == whole.response
    # system goes through the template; raw skips it (so the prompt is far shorter)
    system = client.generate(model=MODEL, prompt="Hi", system="Be brief.", options=GREEDY)
    raw = client.generate(model=MODEL, prompt="Hi", raw=True, options=GREEDY)
    plain = client.generate(model=MODEL, prompt="Hi", options=GREEDY)
    assert raw.prompt_eval_count < plain.prompt_eval_count
    assert system.prompt_eval_count != plain.prompt_eval_count


def test_options_map_to_sampling(client: ollama.Client) -> None:
    def text(**options: Any) -> str:
        r = client.generate(model=MODEL, prompt="Tell me a story.", options=options)
        return r.response

    seeded = {"temperature": 1.5, "top_k": 50, "top_p": 0.95, "min_p": 0.01, "num_predict": 12}
    assert text(seed=7, **seeded) == text(seed=7, **seeded)
    assert len({text(seed=s, **seeded) for s in (1, 2, 3)}) > 1
    r = client.generate(model=MODEL, prompt="Count: 1, 2,", options={**GREEDY, "num_predict": 3})
    assert r.eval_count == 3 and r.done_reason == "length"
    free = text(temperature=0, num_predict=30)
    cut = free.split()[2]
    stopped = text(temperature=0, num_predict=30, stop=[cut], repeat_penalty=1.0)
    assert stopped == free[: free.index(cut)]
    # num_ctx within the loaded context limits prompt + answer to it
    r = client.generate(model=MODEL, prompt="Hi", options={"temperature": 0, "num_ctx": 40})
    assert r.prompt_eval_count + r.eval_count <= 40
    # Ollama's options this server has no use for are ignored
    ignored = {"num_gpu": 1, "mirostat": 2, "numa": True, "repeat_last_n": "x", **GREEDY}
    assert client.generate(model=MODEL, prompt="Hi", options=ignored).eval_count == 8


def test_defaults_are_ollamas(client: ollama.Client) -> None:
    shown = client.show(MODEL)
    assert DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
    for key, value in DEFAULTS.items():
        assert f"{key}" in (shown.parameters or "") and str(value) in (shown.parameters or "")


def test_format_json_and_schema(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    options = {"temperature": 0, "num_predict": 60}
    r = client.chat(model=MODEL, messages=ask, format="json", options=options)
    assert isinstance(json.loads(r.message.content), dict)
    r = client.chat(model=MODEL, messages=ask, format=PERSON, options=options)
    jsonschema.validate(json.loads(r.message.content), PERSON)
    g = client.generate(model=MODEL, prompt="A person:", format=PERSON, options=options)
    jsonschema.validate(json.loads(g.response), PERSON)


def test_tools_are_shown_and_history_calls_accepted(client: ollama.Client) -> None:
    plain = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    offered = client.chat(model=MODEL, messages=ASK, tools=[WEATHER], options=GREEDY)
    assert offered.prompt_eval_count > plain.prompt_eval_count + 20  # the tools in the prompt
    history = [
        {"role": "user", "content": "Weather in London?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "London"}}}],
        },
        {"role": "tool", "content": "rain, 12 C", "tool_name": "get_weather"},
        {"role": "user", "content": "And in Paris?"},
    ]
    r = client.chat(model=MODEL, messages=history, tools=[WEATHER], options=GREEDY)
    assert r.done and r.prompt_eval_count > offered.prompt_eval_count


def test_tool_calls_are_written_as_ollama_shapes_them(server: LiveServer) -> None:
    """The model's call text (SmolLM2 135M will not write one by itself) read back into
    message.tool_calls: function.name and arguments as an object, no id; streamed, the calls
    go out with the last line."""
    from dynalm.runtime.serve import protocol as p

    req = p.ChatCompletionRequest(model=MODEL, messages=ASK, tools=[WEATHER])  # type: ignore[arg-type]
    plan = tools.plan(req, server.service.model.chat_template.source)
    assert plan is not None
    fmt = _OllamaChat(MODEL, server.service, plan, False, time.monotonic(), 0.0)
    choice = Choice(
        0,
        text=['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
    )
    choice.finish_reason = "stop"
    want = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert fmt.whole(choice)["message"] == {"role": "assistant", "content": "", "tool_calls": want}
    fmt = _OllamaChat(MODEL, server.service, plan, False, time.monotonic(), 0.0)
    assert fmt.part(choice, choice.text[0], None) is None  # held back: a call may begin
    last = fmt.part(choice, "", "stop")
    assert last is not None and last["message"]["tool_calls"] == want
    parsed = ollama.ChatResponse(model=MODEL, message=fmt.whole(choice)["message"], done=True)
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Paris"}


# ---------------------------------------------------------------- the models


def test_list_show_ps_version(server: LiveServer, client: ollama.Client) -> None:
    [listed] = client.list().models
    assert listed.model == MODEL and listed.digest == "ab" * 32 and listed.size > 0
    assert listed.modified_at is not None and listed.details is not None
    d = listed.details
    assert (d.format, d.family, d.quantization_level) == ("gguf", "llama", "Q4_1")
    assert d.parameter_size.endswith("M")
    shown = client.show(MODEL)
    assert shown.template == server.service.model.chat_template.source
    assert shown.modelinfo is not None and shown.modelinfo["llama.block_count"] == 30
    assert "tokenizer.ggml.tokens" not in shown.modelinfo  # the vocabulary is left out
    assert shown.details.family == "llama" and "tools" in (shown.capabilities or [])
    [loaded] = client.ps().models
    assert loaded.model == MODEL and loaded.size == server.service.size_bytes > 0
    assert loaded.size_vram == 0 and loaded.details.family == "llama"
    assert httpx.get(f"{server.url}/api/version").json() == {"version": "0.1.0"}


def test_pull_streams_progress_and_delete_removes(
    server: LiveServer,
    client: ollama.Client,
    hub: Hub,  # noqa: F811
) -> None:
    publish(hub, ORG_REPO, GGUFS)
    name = "hf.co/acme/tiny-GGUF:q8_0"
    events = list(client.pull(name, stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    progress = [e for e in events if e.total]
    assert progress and progress[-1].completed == progress[-1].total == 5000
    assert all(e.completed <= e.total for e in progress)
    assert any(e.digest and e.digest.startswith("sha256:") for e in events)
    assert client.pull(name, stream=False).status == "success"  # one final object
    names = [m.model for m in client.list().models]
    assert "hf.co/acme/tiny-GGUF:q8_0" in names
    assert client.delete("hf.co/acme/tiny-GGUF:q8_0").status == "success"
    assert [m.model for m in client.list().models] == [MODEL]
    r = httpx.request(
        "DELETE", f"{server.url}/api/delete", json={"model": "hf.co/acme/tiny-GGUF:q8_0"}
    )
    assert r.status_code == 404 and r.json() == {
        "error": "model 'hf.co/acme/tiny-GGUF:q8_0' not found"
    }


def test_pull_errors(server: LiveServer) -> None:
    r = _post(server, "/api/pull", {"model": "nosuchmodel:1b", "stream": False})
    assert r.status_code == 404 and "nosuchmodel" in r.json()["error"]
    r = _post(server, "/api/pull", {"model": "/etc/passwd", "stream": False})
    assert r.status_code == 400 and "local path" in r.json()["error"]
    lines = _ndjson(server, "/api/pull", {"model": "nosuchmodel:1b"})
    assert lines[0] == {"status": "pulling manifest"} and "nosuchmodel" in lines[-1]["error"]


# ---------------------------------------------------------------- bad input


def _gen(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/api/generate", {"model": MODEL, "prompt": "x", **fields}


def _chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/api/chat", {"model": MODEL, "messages": ASK, **fields}


def _opt(**options: Any) -> tuple[str, dict[str, Any]]:
    return _gen(options=options)


IMAGE_MESSAGE = [{"role": "user", "content": "x", "images": ["aGk="]}]
BAD_INPUT = [
    (_gen(model="nope"), 404, "model 'nope' not found"),
    (_chat(model="nope"), 404, "model 'nope' not found"),
    (("/api/show", {"model": "nope"}), 404, "model 'nope' not found"),
    (("/api/show", {"model": "/etc/hostname"}), 404, "model '/etc/hostname' not found"),
    (_gen(images=["aGk="]), 400, "images: images are not supported"),
    (_chat(messages=IMAGE_MESSAGE), 400, "messages.0.images: images are not supported"),
    (_opt(temperature="hot"), 400, "options.temperature: Input should be a valid number"),
    (_opt(temperature=9), 400, "options.temperature: Input should be less than or equal to 2"),
    (_opt(top_p=0), 400, "options.top_p"),
    (_opt(top_k=-1), 400, "options.top_k"),
    (_opt(min_p=2), 400, "options.min_p"),
    (_opt(repeat_penalty=0), 400, "options.repeat_penalty"),
    (_opt(seed=1.5), 400, "options.seed"),
    (_opt(num_predict=0), 400, "options.num_predict: must be -1 (no limit)"),
    (_opt(num_ctx=4096), 400, "options.num_ctx is 4096, more than the 2048"),
    (_gen(prompt="x " * 50, options={"num_ctx": 10}), 400, "options.num_ctx=10"),
    (_opt(stop=[""]), 400, "options.stop.0"),
    (_gen(options="hot"), 400, "options:"),
    (_gen(template="{{ .Prompt }}"), 400, "template: a custom prompt template is not supported"),
    (_gen(suffix="y"), 400, "suffix: fill-in-the-middle (suffix) is not supported"),
    (_gen(context=[1, 2]), 400, "context: continuing from an earlier answer"),
    (_gen(think=True), 400, "think: thinking is not supported"),
    (_gen(format="yaml"), 400, 'format: must be "json" or a JSON schema'),
    (_gen(format={"type": "nonsense"}), 400, "format cannot be used: Invalid type"),
    (_gen(keep_alive="soon"), 400, "keep_alive: must be a duration such as 10m, 30s, 1h"),
    (_gen(prompt=5), 400, "prompt: Input should be a valid string"),
    (_gen(stream="yes"), 400, "stream: Input should be a valid boolean"),
    (("/api/generate", {"prompt": "x"}), 400, "model: Field required"),
    (_chat(messages="hi"), 400, "messages: Input should be a valid list"),
    (_chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    (_chat(tools=[{"type": "function"}]), 400, "tools.0.function: Field required"),
    (("/api/show", {}), 400, "model is required"),
]


@pytest.mark.parametrize(("request_", "status", "message"), BAD_INPUT)
def test_bad_input_is_ollamas_error(
    server: LiveServer, request_: tuple[str, dict[str, Any]], status: int, message: str
) -> None:
    r = _post(server, *request_)
    assert r.status_code == status, r.text
    error = r.json()
    assert list(error) == ["error"] and message in error["error"], error
    if status == 404:
        assert MODEL in error["error"]  # the names it has
    assert _still_serving(server)


def _still_serving(server: LiveServer) -> bool:
    r = _post(
        server,
        "/api/generate",
        {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}},
    )
    return r.status_code == 200 and r.json()["done"] is True


def test_malformed_json_and_unknown_paths(server: LiveServer) -> None:
    headers = {"Content-Type": "application/json"}
    with server.http() as http:
        r = http.post("/api/chat", content=b'{"model": ', headers=headers)
        assert r.status_code == 400 and r.json()["error"].startswith(
            "the request body is not valid JSON"
        )
        r = http.post("/api/generate", content=b'"\\ud800"', headers=headers)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]
        r = http.post("/api/nothing", json={})
        assert r.status_code == 404 and r.json() == {"error": "Not Found: POST /api/nothing"}
        r = http.get("/api/chat")
        assert r.status_code == 405 and list(r.json()) == ["error"]
        r = http.post("/v1/chat/completions", content=b"{", headers=headers)
        assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape stays


@pytest.mark.parametrize(
    ("path", "body"),
    [("/api/embed", {"input": "x"}), ("/api/embeddings", {"prompt": "x"})],
)
def test_a_generation_model_asked_to_embed_is_a_400(
    server: LiveServer, path: str, body: dict[str, str]
) -> None:
    """(An embedding model's vectors through these: tests/serve/test_embeddings.py.)"""
    r = _post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400
    assert r.json() == {
        "error": f"the model '{MODEL}' is a generation model (llama); this endpoint needs an "
        "embedding model"
    }


def test_api_key_guards_the_ollama_api(smollm2: LoadedModel) -> None:
    with live_server(smollm2, api_key="sekret", max_num_seqs=2) as s:
        gets = [("GET", p) for p in ("/api/tags", "/api/ps", "/api/version")]
        posts = [("POST", p) for p in ("/api/chat", "/api/generate", "/api/pull", "/api/show")]
        for method, path in [*gets, *posts, ("DELETE", "/api/delete")]:
            r = httpx.request(method, f"{s.url}{path}", json={"model": MODEL, "messages": ASK})
            assert r.status_code == 401 and "API key" in r.json()["error"]
        c = ollama.Client(host=s.url, headers={"Authorization": "Bearer sekret"})
        assert c.chat(model=MODEL, messages=ASK, options=GREEDY).done
        # dynalm ps sends $DYNALM_API_KEY
        refused = _cli(s.url, "ps")
        assert refused.returncode == 1 and "invalid or missing API key" in refused.stderr
        shown = _cli(s.url, "ps", key="sekret")
        assert shown.returncode == 0 and MODEL in shown.stdout


# ---------------------------------------------------------------- keep_alive, ps, stop


def test_keep_alive_parsing() -> None:
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds(10) == 10 and keep_alive_seconds("0") == 0
    assert keep_alive_seconds(-1) == -1 and keep_alive_seconds("-5m") == -1
    assert keep_alive_seconds("1.5s") == 1.5 and keep_alive_seconds(None) is None
    assert keep_alive_seconds(1e300) == -1 and keep_alive_seconds("9999999h") == -1  # for good
    for bad in ("soon", "5 m", "m", "", True, [1]):
        with pytest.raises(ValueError):
            keep_alive_seconds(bad)


def _cli(url: str, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DYNALM_HOST": url, "COLUMNS": "200"}
    env.pop("DYNALM_API_KEY", None)
    if key is not None:
        env["DYNALM_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "dynalm.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_load_keep_alive_expiry_and_stop(smollm2: LoadedModel) -> None:
    with live_server(smollm2, max_num_seqs=2) as s:
        c = ollama.Client(host=s.url)
        r = _post(s, "/api/generate", {"model": MODEL, "stream": False})  # empty: load
        assert r.json()["done_reason"] == "load" and r.json()["response"] == ""
        [m] = c.ps().models
        assert m.expires_at is None  # kept: no keep_alive asked yet
        c.generate(model=MODEL, prompt="Hi", options={"num_predict": 1}, keep_alive="10m")
        [m] = c.ps().models
        left = m.expires_at.timestamp() - time.time()
        assert 590 < left <= 600
        shown = _cli(s.url, "ps")
        assert shown.returncode == 0 and MODEL in shown.stdout and "cpu" in shown.stdout
        assert "NAME" in shown.stdout and "(in 9m" in shown.stdout
        # a short keep_alive: unloaded once it has passed
        c.generate(model=MODEL, prompt="Hi", options={"num_predict": 1}, keep_alive=0.5)
        deadline = time.monotonic() + 10
        while c.ps().models:
            assert time.monotonic() < deadline, "not unloaded after keep_alive"
            time.sleep(0.1)


def test_stop_unloads_and_a_stream_in_flight_finishes_first(smollm2: LoadedModel) -> None:
    with live_server(smollm2, max_num_seqs=2) as s:
        options = {"num_predict": 200, "temperature": 0, "stop": ["<|im_end|>"]}
        body = {"model": MODEL, "prompt": "Once upon a time", "raw": True, "options": options}
        with s.http() as http, http.stream("POST", "/api/generate", json=body) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines))["done"] is False
            # what `ollama stop` sends, while the stream is open: the model stays until it ends
            stop = _post(s, "/api/generate", {"model": MODEL, "keep_alive": 0, "stream": False})
            assert stop.json()["done_reason"] == "unload"
            assert [m["name"] for m in httpx.get(f"{s.url}/api/ps").json()["models"]] == [MODEL]
            rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["done"] is True and rest[-1]["done_reason"] == "length"
        assert rest[-1]["eval_count"] == 200  # nothing lost
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.url}/api/ps").json()["models"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # what `ollama stop` sends, for a model this server does not have
        r = _post(s, "/api/generate", {"model": "nope", "keep_alive": 0})
        assert r.status_code == 404 and "model 'nope' not found" in r.json()["error"]


def test_cli_stop_unloads(smollm2: LoadedModel) -> None:
    with live_server(smollm2, max_num_seqs=2) as s:
        assert [m["name"] for m in httpx.get(f"{s.url}/api/ps").json()["models"]] == [MODEL]
        stopped = _cli(s.url, "stop", MODEL)
        assert stopped.returncode == 0 and stopped.stdout == "", stopped.stderr
        assert httpx.get(f"{s.url}/api/ps").json()["models"] == []
        listed = _cli(s.url, "ps")
        assert listed.returncode == 0 and MODEL not in listed.stdout


def test_cli_says_when_no_server_runs() -> None:
    for args in (["ps"], ["stop", MODEL]):
        out = _cli("127.0.0.1:9", *args)
        assert out.returncode == 1
        assert "error: no DynaLM server answers at http://127.0.0.1:9" in out.stderr
    out = _cli("127.0.0.1:9", "ps", "--port", "0")
    assert out.returncode == 2  # a usage error: ports are 1..65535
