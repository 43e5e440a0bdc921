"""Hugging Face repos as model sources (``hf.co/ORG/REPO[:TAG][@REV]``), against the fake Hub
of ``test_registry``: its model API (``/api/models/...``, what ``huggingface_hub`` calls) and
``resolve/`` downloads with the Hub's headers, LFS files redirected to a CDN path."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console
from test_catalog import Hub, hub  # noqa: F401 (the fixture)

import dynalm
from dynalm.errors import InvalidRequest, ModelNotFound, PullError
from dynalm.store import hub as hubmod
from dynalm.store.catalog import (
    CATALOG,
    CatalogEntry,
    HuggingFaceSource,
    ModelStore,
    is_local_path,
    make_catalog,
)
from dynalm.store.commands import list_command, rm_command

ORG_REPO = "acme/tiny-GGUF"
COMMIT = "a" * 40
LFS_MIN = 1000  # files from this size up are LFS files, as the Hub's .gitattributes would say


def blob(seed: str, n: int) -> bytes:
    return hashlib.sha256(seed.encode()).digest() * (n // 32) + b"x" * (n % 32)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def publish(
    hub: Hub,  # noqa: F811
    repo: str,
    files: dict[str, bytes],
    commit: str = COMMIT,
    revs: tuple = ("main",),
) -> None:
    """Serve ``files`` as ``repo`` at ``commit`` (also under each of ``revs``): the model API
    answer with sizes, blob ids and LFS sha256s, and ``resolve/<commit>/<file>``."""
    siblings = []
    for name, data in files.items():
        sibling: dict = {"rfilename": name, "size": len(data), "blobId": git_sha1(data)}
        path = f"/{repo}/resolve/{commit}/{name}"
        headers = {"X-Repo-Commit": commit}
        if len(data) >= LFS_MIN:
            sha = hashlib.sha256(data).hexdigest()
            sibling["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            hub.serve_model(path, data)
            hub.headers[hub.redirects[path].split("?")[0]] = {"ETag": f'"{sha}"'}
        else:
            hub.files[path] = data
            headers["ETag"] = f'"{git_sha1(data)}"'
        hub.headers[path] = headers
        siblings.append(sibling)
    answer = {"id": repo, "sha": commit, "siblings": siblings}
    hub.api[f"/api/models/{repo}"] = answer
    for rev in revs:
        hub.api[f"/api/models/{repo}/revision/{rev}"] = answer


GGUFS = {
    "README.md": b"# tiny\n",
    "tiny-Q4_K_M.gguf": blob("q4km", 3000),
    "tiny-Q8_0.gguf": blob("q80", 5000),
    "tiny-IQ2_XS.gguf": blob("iq2", 2000),
    "mmproj-tiny-f16.gguf": blob("mmproj", 1500),
}


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "home", catalog={})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- references


def test_references_parse() -> None:
    parse = hubmod.parse_hub_ref
    assert parse("hf.co/acme/tiny-GGUF:Q4_K_M") == hubmod.HubRef("acme/tiny-GGUF", "Q4_K_M")
    assert parse("acme/tiny-GGUF") == hubmod.HubRef("acme/tiny-GGUF")
    assert parse("huggingface.co/acme/x@v1.0") == hubmod.HubRef("acme/x", None, "v1.0")
    assert parse("acme/x:q8_0@refs/pr/1") == hubmod.HubRef("acme/x", "q8_0", "refs/pr/1")
    assert parse("acme/x@" + COMMIT + ":q8_0") == hubmod.HubRef("acme/x", "q8_0", COMMIT)
    assert parse("acme/x:q8_0@main").label == "hf.co/acme/x:q8_0@main"


@pytest.mark.parametrize(
    "bad",
    ["hf.co/../../etc", "hf.co/acme/..", "acme/..x:q4", "hf.co/acme/x:../../y", "acme/x@../../y",
     "acme/x@a/../../b", "hf.co/acme/x/extra", "hf.co/acme", "acme/x:q4@main:q8", "acme/x@/abs",
     "hf.co/acme/x y", "hf.co/acme/x\\y"],
)  # fmt: skip
def test_bad_references_are_refused(bad: str, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home", catalog={})
    for call in (store.pull, store.resolve, store.remove):
        with pytest.raises((InvalidRequest, ModelNotFound)):
            call(bad)
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("path", ["../../etc", "../../etc/passwd", "/etc", "./x", "~/x"])
def test_traversal_names_are_paths_never_store_names(path: str, tmp_path: Path) -> None:
    assert is_local_path(path)
    store = ModelStore(tmp_path / "home", catalog={})
    with pytest.raises(InvalidRequest, match="is a local path"):
        store.pull(path)
    with pytest.raises(InvalidRequest, match="is a local path"):
        store.remove(path)
    assert not (tmp_path / "home").exists()


def test_local_paths_and_repos_are_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert not is_local_path("acme/tiny-GGUF")
    assert not is_local_path("hf.co/acme/tiny-GGUF:Q4_K_M")
    assert not is_local_path("smollm2:135m")
    assert is_local_path("models/tiny.gguf")  # a repo is never named *.gguf
    assert is_local_path("tiny.gguf") and is_local_path("a/b/c")
    (tmp_path / "acme" / "tiny-GGUF").mkdir(parents=True)  # an existing directory wins
    assert is_local_path("acme/tiny-GGUF")
    store = ModelStore(tmp_path / "home", catalog={})
    assert store.resolve("acme/tiny-GGUF") == tmp_path / "acme" / "tiny-GGUF"
    assert not is_local_path("hf.co/acme/tiny-GGUF")


# ---------------------------------------------------------------- GGUF repos


def test_pull_gguf_by_tag(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    path = store.pull("hf.co/acme/tiny-GGUF:q8_0", progress=False)  # any case
    assert path == store.root / "hf" / ORG_REPO / "q8_0" / "tiny-Q8_0.gguf"
    assert path.read_bytes() == GGUFS["tiny-Q8_0.gguf"]
    assert hub.paths() == [
        f"/api/models/{ORG_REPO}",
        f"/{ORG_REPO}/resolve/{COMMIT}/tiny-Q8_0.gguf",  # pinned to the listed commit
        f"/cdn/{sha(GGUFS['tiny-Q8_0.gguf'])}",
    ]
    assert hub.requests[1][1]["authorization"] == "Bearer hf_dynalm_test_token"
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["commit"] == COMMIT and manifest["kind"] == "gguf"
    assert manifest["sha256"] == sha(GGUFS["tiny-Q8_0.gguf"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json", "tiny-Q8_0.gguf"]
    assert [p.name for p in (store.root / "hf" / ORG_REPO).iterdir()] == ["q8_0"]  # no staging

    n = len(hub.requests)
    assert store.resolve("acme/tiny-GGUF:Q8_0") == path  # from the store: no request
    assert len(hub.requests) == n
    assert store.pull("acme/tiny-GGUF:Q8_0", progress=False) == path  # listed, not downloaded
    assert hub.paths()[n:] == [f"/api/models/{ORG_REPO}"]
    [listed] = store.list()
    assert (listed.name, listed.path, listed.size) == ("hf.co/acme/tiny-GGUF:q8_0", path, 5000)
    assert listed.source == f"hf:{ORG_REPO}@{COMMIT[:12]}"


def test_default_tag_and_smallest(
    hub: Hub,  # noqa: F811
    store: ModelStore,
    capsys: pytest.CaptureFixture[str],
) -> None:
    publish(hub, ORG_REPO, GGUFS)
    with pytest.raises(ModelNotFound, match=r"not pulled; run `dynalm pull acme/tiny-GGUF`"):
        store.resolve("acme/tiny-GGUF", pull=False)
    path = store.pull("acme/tiny-GGUF")
    assert path.name == "tiny-Q4_K_M.gguf" and path.parent.name == "q4_k_m"
    err = capsys.readouterr().err
    assert "no tag given, using the default Q4_K_M (tiny-Q4_K_M.gguf)" in err
    assert "tags: IQ2_XS, Q4_K_M, Q8_0" in err  # the mmproj file is not a model
    assert store.resolve("acme/tiny-GGUF", pull=False) == path
    assert store.resolve("acme/tiny-GGUF:Q4_K_M", pull=False) == path

    publish(hub, "acme/other", {k: v for k, v in GGUFS.items() if "Q4_K_M" not in k})
    path = store.pull("acme/other")
    assert path.name == "tiny-IQ2_XS.gguf"
    assert "using the smallest IQ2_XS" in capsys.readouterr().err


def test_tag_errors_list_the_available_tags(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q5_K_M", progress=False)
    assert str(e.value) == (
        "hf.co/acme/tiny-GGUF:Q5_K_M: no GGUF file carries the tag Q5_K_M; available tags: "
        "IQ2_XS, Q4_K_M, Q8_0"
    )
    with pytest.raises(PullError, match="no GGUF file carries the tag Q4_K;"):
        store.pull("acme/tiny-GGUF:Q4_K", progress=False)  # not a prefix match of Q4_K_M
    publish(hub, "acme/dup", {"a-Q4_0.gguf": blob("a", 1000), "b-Q4_0.gguf": blob("b", 1000)})
    with pytest.raises(PullError, match="tag Q4_0 is ambiguous, it matches a-Q4_0.gguf, b-Q4_0"):
        store.pull("acme/dup:Q4_0", progress=False)
    split = {f"big-Q8_0-0000{i}-of-00002.gguf": blob(str(i), 1000) for i in (1, 2)}
    publish(hub, "acme/split", split)
    with pytest.raises(PullError, match="Q8_0 is a GGUF split into 2 files"):
        store.pull("acme/split:Q8_0", progress=False)
    publish(hub, "acme/empty", {"README.md": b"hi"})
    with pytest.raises(PullError, match="neither GGUF files nor a transformers model"):
        store.pull("acme/empty", progress=False)
    assert store.list() == []


def test_unknown_repo_and_revision(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    with pytest.raises(PullError) as e:
        store.pull("acme/nope:Q4_K_M", progress=False)
    assert str(e.value) == (
        f"hf.co/acme/nope ({hub.url}): repository not found (a private or gated repo? set "
        "HF_TOKEN or run `hf auth login`)"
    )
    publish(hub, ORG_REPO, GGUFS)
    with pytest.raises(PullError, match=r"hf.co/acme/tiny-GGUF@v9 \(.*\): revision 'v9' not found"):
        store.pull("acme/tiny-GGUF@v9", progress=False)
    assert not (store.root / "hf").exists()


def test_network_down_is_one_line(
    store: ModelStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert str(e.value).startswith(
        f"hf.co/acme/tiny-GGUF (http://127.0.0.1:{port}): cannot reach the Hub: "
    )
    assert "refused" in str(e.value).lower()

    src = str(Path(dynalm.__file__).parents[1])
    env = {**os.environ, "DYNALM_HOME": str(tmp_path / "cli"), "PYTHONPATH": src}
    for args in (["pull", "hf.co/acme/tiny-GGUF:Q4_K_M"], ["run", "acme/tiny-GGUF", "hi"]):
        proc = subprocess.run(
            [sys.executable, "-m", "dynalm.cli", *args], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("error: hf.co/acme/tiny-GGUF (http://127.0.0.1:")


def test_interrupted_download_resumes(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    data = GGUFS["tiny-Q8_0.gguf"]
    cdn = f"/cdn/{sha(data)}"
    hub.drop_after[cdn] = 2048
    with pytest.raises(PullError, match=r"could not pull hf.co/acme/tiny-GGUF:Q8_0 from .*"):
        store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    staging = store.root / "hf" / ORG_REPO / ".q8_0.partial"
    assert (staging / "tiny-Q8_0.gguf.partial").stat().st_size == 2048
    assert store.list() == []
    with pytest.raises(ModelNotFound):
        store.resolve("acme/tiny-GGUF:Q8_0", pull=False)

    hub.drop_after.clear()
    path = store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    assert path.read_bytes() == data
    assert hub.requests[-1][0] == cdn and hub.requests[-1][1]["range"] == "bytes=2048-"
    assert not staging.exists()


def test_wrong_bytes_are_never_published(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    data = GGUFS["tiny-Q8_0.gguf"]
    hub.files[f"/cdn/{sha(data)}"] = data[::-1]  # right size, wrong bytes
    with pytest.raises(PullError, match="sha256 mismatch"):
        store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    assert store.list() == []
    assert not (store.root / "hf" / ORG_REPO / "q8_0").exists()


def test_hostile_listing_cannot_escape_the_store(
    hub: Hub,  # noqa: F811
    tmp_path: Path,
) -> None:
    store = ModelStore(tmp_path / "home", catalog={})
    for name in ("../../evil-Q4_0.gguf", "sub/../../evil-Q4_0.gguf", ".hidden/x-Q4_0.gguf"):
        hub.api.clear()
        publish(hub, ORG_REPO, {name: blob("evil", 1000)})
        with pytest.raises(PullError, match="the Hub lists an unsafe file name"):
            store.pull("acme/tiny-GGUF:Q4_0", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the store was made
    # a GGUF in a folder of the repo lands flat in its variant's directory
    hub.api.clear()
    publish(hub, ORG_REPO, {"Q4_0/tiny-Q4_0.gguf": blob("ok", 1000)})
    path = store.pull("acme/tiny-GGUF:Q4_0", progress=False)
    assert path == store.root / "hf" / ORG_REPO / "q4_0" / "tiny-Q4_0.gguf"


def test_revision_pinning(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    old = {"tiny-Q4_K_M.gguf": blob("old", 2500)}
    publish(hub, ORG_REPO, old, commit="b" * 40, revs=("v1",))
    hub.api[f"/api/models/{ORG_REPO}"] = hub.api[f"/api/models/{ORG_REPO}/revision/main"]
    pinned = store.pull("acme/tiny-GGUF:Q4_K_M@v1", progress=False)
    latest = store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert pinned.parent.name == "q4_k_m@v1" and pinned.read_bytes() == old["tiny-Q4_K_M.gguf"]
    assert latest.parent.name == "q4_k_m" and latest.read_bytes() == GGUFS["tiny-Q4_K_M.gguf"]
    assert f"/{ORG_REPO}/resolve/{'b' * 40}/tiny-Q4_K_M.gguf" in hub.paths()
    assert store.resolve("acme/tiny-GGUF@v1:Q4_K_M", pull=False) == pinned

    # rm: one tag, or with no tag every variant of the repo (at a revision if one is named)
    removed = store.remove("acme/tiny-GGUF@v1")
    assert [m.path for m in removed] == [pinned]
    assert [m.path for m in store.list()] == [latest]
    store.remove("acme/tiny-GGUF")
    assert store.list() == [] and not (store.root / "hf" / "acme").exists()
    with pytest.raises(ModelNotFound, match="'hf.co/acme/tiny-GGUF' is not in the store"):
        store.remove("acme/tiny-GGUF")


def test_new_commit_replaces_the_stored_file(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    path = store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    publish(hub, ORG_REPO, {"tiny-Q8_0.gguf": blob("new", 4000)}, commit="c" * 40)
    assert store.pull("acme/tiny-GGUF:Q8_0", progress=False) == path
    assert path.read_bytes() == blob("new", 4000)
    assert sorted(p.name for p in path.parent.parent.iterdir()) == ["q8_0"]


# ---------------------------------------------------------------- transformers repos

CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
SAFE_INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = json.dumps({"weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}).encode()
TRANSFORMERS = {
    "config.json": CONFIG,
    "generation_config.json": b"{}",
    "tokenizer.json": blob("tok", 3000),
    "tokenizer_config.json": b'{"chat_template": "x"}',
    SAFE_INDEX: INDEX,
    "model-00001-of-00002.safetensors": blob("s1", 4000),
    "model-00002-of-00002.safetensors": blob("s2", 2000),
    "consolidated.safetensors": blob("other", 6000),  # not in the index: not downloaded
    "README.md": b"# model",
}


def test_pull_transformers_repo(
    hub: Hub,  # noqa: F811
    store: ModelStore,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the table's columns unfolded
    publish(hub, "acme/tiny-llama", TRANSFORMERS)
    path = store.pull("acme/tiny-llama", progress=False)
    assert path == store.root / "hf" / "acme" / "tiny-llama" / "safetensors"
    expected = [*TRANSFORMERS][:7]
    assert sorted(p.name for p in path.iterdir()) == sorted([*expected, "manifest.json"])
    for name in expected:
        assert (path / name).read_bytes() == TRANSFORMERS[name]
    assert store.resolve("acme/tiny-llama", pull=False) == path  # a directory: the loader's
    [listed] = store.list()
    assert listed.name == "hf.co/acme/tiny-llama" and listed.sha256 is None
    assert listed.size == sum(len(TRANSFORMERS[n]) for n in expected)
    list_command(store=store)
    out = capsys.readouterr().out
    assert "hf.co/acme/tiny-llama" in out and f"hf:acme/tiny-llama@{COMMIT[:12]}" in out
    rm_command("hf.co/acme/tiny-llama", store=store)
    assert "removed hf.co/acme/tiny-llama" in capsys.readouterr().out


def test_transformers_repo_errors(hub: Hub, store: ModelStore) -> None:  # noqa: F811
    files = {k: v for k, v in TRANSFORMERS.items() if k != "tokenizer.json"}
    publish(hub, "acme/a", files)
    with pytest.raises(PullError, match="needs tokenizer.json, which the repo lacks"):
        store.pull("acme/a", progress=False)
    files = {**TRANSFORMERS, SAFE_INDEX: json.dumps({"weight_map": {"a": "gone.safetensors"}})}
    publish(hub, "acme/b", {k: v.encode() if isinstance(v, str) else v for k, v in files.items()})
    with pytest.raises(PullError, match="names 'gone.safetensors', not in the repo"):
        store.pull("acme/b", progress=False)
    files = {k: v for k, v in TRANSFORMERS.items() if k != SAFE_INDEX}
    publish(hub, "acme/c", files)
    with pytest.raises(PullError, match=r"3 \*.safetensors files .* and no model.safetensors"):
        store.pull("acme/c", progress=False)
    # a small (non-LFS) file is checked against its git blob id
    publish(hub, "acme/d", TRANSFORMERS)
    hub.files[f"/acme/d/resolve/{COMMIT}/config.json"] = CONFIG.replace(b"llama", b"LLAMA")
    with pytest.raises(PullError, match="git blob id mismatch"):
        store.pull("acme/d", progress=False)
    assert store.list() == []


# ---------------------------------------------------------------- the catalog


def test_catalog_entry_without_sha_takes_the_hubs(hub: Hub, tmp_path: Path) -> None:  # noqa: F811
    publish(hub, ORG_REPO, GGUFS)
    source = HuggingFaceSource(ORG_REPO, "tiny-Q8_0.gguf")
    entry = CatalogEntry("tiny", "q8", "tiny-Q8_0.gguf", None, None, (source,), "")
    store = ModelStore(tmp_path, catalog=make_catalog(entry))
    path = store.pull("tiny:q8", progress=False)
    assert path.read_bytes() == GGUFS["tiny-Q8_0.gguf"]
    assert store.list()[0].sha256 == sha(GGUFS["tiny-Q8_0.gguf"])
    assert f"/{ORG_REPO}/resolve/{COMMIT}/tiny-Q8_0.gguf" in hub.paths()  # the listed commit
    assert store.resolve("tiny:q8", pull=False) == path

    hub.files[f"/cdn/{sha(GGUFS['tiny-Q8_0.gguf'])}"] = GGUFS["tiny-Q8_0.gguf"][::-1]
    store.remove("tiny:q8")
    with pytest.raises(PullError, match="sha256 mismatch"):
        store.pull("tiny:q8", progress=False)
    gone = CatalogEntry("tiny", "q8", "gone.gguf", None, None, (HuggingFaceSource(ORG_REPO,
                        "gone.gguf"),), "")  # fmt: skip
    with pytest.raises(PullError, match=f"gone.gguf is not in the repo at {COMMIT[:12]}"):
        ModelStore(tmp_path, catalog=make_catalog(gone)).pull("tiny:q8", progress=False)


def test_default_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    keys = ["smollm2:135m", "smollm2:360m", "smollm2:1.7b", "qwen2.5:0.5b", "qwen2.5:1.5b",
            "llama3.2:1b", "gemma3:270m", "gemma3:1b"]  # fmt: skip
    assert list(CATALOG) == keys
    for entry in CATALOG.values():
        [hf] = [s for s in entry.sources if isinstance(s, HuggingFaceSource)]
        assert hubmod.looks_like_hub_ref(hf.repo_id)
        assert hubmod.quant_tag(entry.filename) is not None
    assert CATALOG["smollm2:135m"].sha256 is not None  # the one whose bytes we know
    list_command(store=ModelStore(Path("/nonexistent")), catalog=True)
    out = capsys.readouterr().out
    for text in ("gemma3:270m", "ggml-org/gemma-3-270m-it-GGUF", "from the Hub", "93.8 MiB"):
        assert text in out


@pytest.mark.slow  # pulls and runs a model
def test_run_a_transformers_repo_end_to_end(hub: Hub, tmp_path: Path) -> None:  # noqa: F811
    """`dynalm run ORG/REPO`: the repo's SafeTensors set is pulled into the store and the
    directory runs (a tiny random llama written by transformers' save_pretrained)."""
    from models.tiny_models import SPECS, reference_model, write_hf_dir

    local = write_hf_dir(reference_model(SPECS["llama"]), tmp_path / "tiny-llama")
    publish(hub, "acme/tiny-llama", {p.name: p.read_bytes() for p in local.iterdir()})
    env = {**os.environ, "DYNALM_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "dynalm.cli", "run", "acme/tiny-llama", "hi"]
    cmd += ["--max-tokens", "4", "--temperature", "0"]
    ran = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr
    pulled = tmp_path / "home" / "hf" / "acme" / "tiny-llama" / "safetensors"
    assert (pulled / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout == ran.stdout  # the stored copy, same text


# ---------------------------------------------------------------- hostile listings (issues 25, 31)


def listing(hub: Hub, repo: str = ORG_REPO) -> dict:  # noqa: F811
    """The model API answer ``publish`` registered for ``repo``, to corrupt in place (one
    object behind every revision's path)."""
    return hub.api[f"/api/models/{repo}"]  # type: ignore[return-value]


def sibling(hub: Hub, name: str) -> dict:  # noqa: F811
    return next(s for s in listing(hub)["siblings"] if s["rfilename"] == name)


def test_a_file_with_nothing_to_verify_it_against_is_refused(
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issue 31 (3a): no size, no LFS sha256, no blob id — the server's bytes would be
    published unchecked; a blob id without a size cannot be checked either."""
    publish(hub, ORG_REPO, GGUFS)
    entry = sibling(hub, "tiny-Q8_0.gguf")
    del entry["lfs"], entry["size"], entry["blobId"]
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    assert str(e.value) == (
        f"could not pull hf.co/acme/tiny-GGUF:Q8_0 from {hub.url}: acme/tiny-GGUF "
        "tiny-Q8_0.gguf: the listing gives no sha256 and no git blob id with a size for it, "
        "nothing to verify the download against"
    )
    entry["blobId"] = git_sha1(GGUFS["tiny-Q8_0.gguf"])  # a blob id, but no size
    with pytest.raises(PullError, match="nothing to verify the download against"):
        store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    assert not any("/resolve/" in p or "/cdn/" in p for p in hub.paths())  # never fetched
    assert store.list() == []
    # a catalog entry without a sha256 of its own takes the listing's: the same refusal
    source = HuggingFaceSource(ORG_REPO, "tiny-Q8_0.gguf")
    tiny = CatalogEntry("tiny", "q8", "tiny-Q8_0.gguf", None, None, (source,), "")
    catalog_store = ModelStore(store.root, catalog=make_catalog(tiny))
    with pytest.raises(PullError, match="nothing to verify the download against"):
        catalog_store.pull("tiny:q8", progress=False)
    assert catalog_store.list() == []


def test_a_file_staged_at_another_commit_is_verified_again(
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issue 31 (3b): a pull fails after staging config.json at commit A; the retry lists
    commit B whose config.json has the same size. A's bytes must not be published as B's."""
    publish(hub, "acme/tiny-llama", TRANSFORMERS)
    hub.drop_after[f"/cdn/{sha(TRANSFORMERS['tokenizer.json'])}"] = 100
    with pytest.raises(PullError):
        store.pull("acme/tiny-llama", progress=False)
    staged = store.root / "hf" / "acme" / "tiny-llama" / ".safetensors.partial" / "config.json"
    assert staged.read_bytes() == CONFIG
    hub.drop_after.clear()
    config_b = CONFIG.replace(b"llama", b"LLAMA")
    assert len(config_b) == len(CONFIG)
    publish(hub, "acme/tiny-llama", {**TRANSFORMERS, "config.json": config_b}, commit="b" * 40)
    path = store.pull("acme/tiny-llama", progress=False)
    assert (path / "config.json").read_bytes() == config_b
    assert f"/acme/tiny-llama/resolve/{'b' * 40}/config.json" in hub.paths()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["commit"] == "b" * 40
    [row] = [f for f in manifest["files"] if f["path"] == "config.json"]
    assert row["sha256"] == sha(config_b)


def test_a_staged_file_that_still_verifies_is_not_fetched_again(
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    publish(hub, "acme/tiny-llama", TRANSFORMERS)
    hub.drop_after[f"/cdn/{sha(TRANSFORMERS['tokenizer.json'])}"] = 100
    with pytest.raises(PullError):
        store.pull("acme/tiny-llama", progress=False)
    hub.drop_after.clear()
    n = len(hub.requests)
    store.pull("acme/tiny-llama", progress=False)
    assert f"/acme/tiny-llama/resolve/{COMMIT}/config.json" not in hub.paths()[n:]


def _corrupt(key: str, value: object) -> Callable[[dict], None]:
    def apply(answer: dict) -> None:
        target = answer["siblings"][1]  # tiny-Q4_K_M.gguf, an LFS file
        if key.startswith("lfs."):
            target = target["lfs"]
        target[key.removeprefix("lfs.")] = value

    return apply


Q4 = "'tiny-Q4_K_M.gguf'"
HOSTILE_LISTINGS = {
    # the whole answer
    "html": (b"<html><body>hi</body></html>", "the Hub's answer is not JSON: b'<html><body>hi"),
    "list": (b"[]", "the Hub's answer is [], not a JSON object"),
    "null": (b"null", "the Hub's answer is null, not a JSON object"),
    "number": (b"12", "the Hub's answer is 12, not a JSON object"),
    "no-commit": (lambda a: a.pop("sha"), "the Hub's answer has no commit ('sha')"),
    "commit-path": (
        lambda a: a.update(sha="../../x"),
        "the Hub lists the repo with 'sha' '../../x', expected a commit id (40 or 64",
    ),
    "siblings-object": (
        lambda a: a.update(siblings={}),
        "the Hub's answer has no commit ('sha') or no list of files ('siblings' is {})",
    ),
    "siblings-null": (lambda a: a.update(siblings=None), "('siblings' is None)"),
    # one file
    "sibling-empty": (
        lambda a: a["siblings"].append({}),
        "the Hub lists an unsafe file name None",
    ),
    "sibling-string": (
        lambda a: a["siblings"].append("x.gguf"),
        "the Hub lists file 5 as 'x.gguf', not an object",
    ),
    "name-number": (_corrupt("rfilename", 5), "the Hub lists an unsafe file name 5"),
    "name-list": (_corrupt("rfilename", ["a"]), "the Hub lists an unsafe file name ['a']"),
    "size-string": (
        _corrupt("size", "3000"),
        f"the Hub lists file {Q4} with 'size' '3000', expected a non-negative integer",
    ),
    "size-negative": (_corrupt("size", -1), f"file {Q4} with 'size' -1, expected a non-neg"),
    "size-bool": (_corrupt("size", True), f"file {Q4} with 'size' True, expected a non-neg"),
    "size-float": (_corrupt("size", 3000.5), f"file {Q4} with 'size' 3000.5, expected a non"),
    "blob-id-number": (
        _corrupt("blobId", 123),
        f"file {Q4} with 'blobId' 123, expected 40 lowercase hex digits",
    ),
    "lfs-string": (_corrupt("lfs", "x"), f"file {Q4} with 'lfs' 'x', expected an object"),
    "lfs-sha256-path": (
        _corrupt("lfs.sha256", "../../x"),
        f"the Hub lists file {Q4} (lfs) with 'sha256' '../../x', expected 64 lowercase hex",
    ),
    "lfs-sha256-number": (
        _corrupt("lfs.sha256", 1234),
        f"file {Q4} (lfs) with 'sha256' 1234, expected 64 lowercase hex digits",
    ),
    "lfs-sha256-short": (
        _corrupt("lfs.sha256", "ab" * 20),
        f"file {Q4} (lfs) with 'sha256' '{'ab' * 20}', expected 64 lowercase hex digits",
    ),
    "lfs-size-string": (
        _corrupt("lfs.size", "3000"),
        f"file {Q4} (lfs) with 'size' '3000', expected a non-negative integer",
    ),
    "lfs-size-differs": (
        _corrupt("lfs.size", 3001),
        f"the Hub lists file {Q4} with size 3000 but LFS size 3001",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_LISTINGS)
def test_hostile_listing_is_a_clear_error(
    case: str,
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issues 25 and 31 (4): a model API answer of the wrong shape or types is one PullError
    naming the server and what was wrong (never a TypeError/KeyError), before any download."""
    change, message = HOSTILE_LISTINGS[case]
    publish(hub, ORG_REPO, GGUFS)
    if isinstance(change, bytes):
        hub.api[f"/api/models/{ORG_REPO}"] = change
    else:
        change(listing(hub))
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert str(e.value).startswith(f"hf.co/acme/tiny-GGUF ({hub.url}): ")
    assert message in str(e.value)
    assert hub.paths() == [f"/api/models/{ORG_REPO}"]
    assert not store.root.exists()


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "unsized"])
def test_a_listing_past_its_size_bound_is_refused(
    sized: bool,
    hub: Hub,  # noqa: F811
    store: ModelStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25: the model API answer was read whole, however long; past
    ``MAX_LISTING_BYTES`` (lowered here to 4 KiB) it is refused naming the URL and the
    bound, by its Content-Length or, without one, as it arrives."""
    publish(hub, ORG_REPO, GGUFS)
    listing(hub)["cardData"] = {"padding": "x" * 8192}
    hub.api_unsized = not sized
    monkeypatch.setattr(hubmod, "MAX_LISTING_BYTES", 4096)
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    url = f"{hub.url}/api/models/{ORG_REPO}"
    size = len(json.dumps(listing(hub)).encode())
    tail = f"is {size} bytes long, more than 4096" if sized else "is longer than 4096 bytes"
    assert str(e.value) == f"hf.co/{ORG_REPO} ({hub.url}): the Hub's answer ({url}) {tail}"
    assert not store.root.exists()


SENT_AT_MOST = 64 << 20  # what socket buffers may take of a 1 GiB body nobody reads


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "unsized"])
def test_an_endless_error_body_from_the_hub_is_read_only_up_to_its_bound(
    sized: bool,
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issue 25: an error answer of the model API was read whole (by huggingface_hub, for
    its message). Now at most ``MAX_ERROR_BYTES`` of it are read, and the error names the URL
    and the bound; a short JSON error is shown, escaped."""
    api = f"/api/models/{ORG_REPO}"
    hub.endless[api] = (500, {}, sized)
    t0 = time.monotonic()
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    bound = hubmod.MAX_ERROR_BYTES
    tail = (
        f"is {1 << 30} bytes long, more than {bound}" if sized else f"is longer than {bound} bytes"
    )
    assert str(e.value) == (
        f"hf.co/{ORG_REPO} ({hub.url}): the Hub answered HTTP 500, and the Hub's error answer "
        f"({hub.url}{api}?blobs=true) {tail}"
    )
    assert time.monotonic() - t0 < 10 and hub.sent[api] < SENT_AT_MOST
    assert not store.root.exists()
    del hub.endless[api]
    hub.api[api] = b'{"error": "busy \\u001b[31mnow"}'
    hub.api_status[api] = 503
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert (
        str(e.value)
        == f"hf.co/{ORG_REPO} ({hub.url}): the Hub answered HTTP 503: 'busy \\x1b[31mnow'"
    )


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "unsized"])
def test_an_endless_redirect_body_is_never_read(
    sized: bool,
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issue 25: httpx reads a redirect's whole body before it follows it (a hostile Hub's
    can be endless). Redirects are followed by `hub._stream`, which never reads one: the
    listing and an LFS file each come through a redirect with a 1 GiB body."""
    publish(hub, ORG_REPO, GGUFS)
    api = f"/api/models/{ORG_REPO}"
    hub.api["/api/moved"] = hub.api.pop(api)
    hub.endless[api] = (307, {"Location": "/api/moved?blobs=true"}, sized)
    path = f"/{ORG_REPO}/resolve/{COMMIT}/tiny-Q4_K_M.gguf"
    hub.endless[path] = (302, {"Location": hub.redirects[path]}, sized)
    t0 = time.monotonic()
    store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert time.monotonic() - t0 < 20
    assert hub.sent[api] < SENT_AT_MOST and hub.sent[path] < SENT_AT_MOST
    assert [m.name for m in store.list()] == ["hf.co/acme/tiny-GGUF:Q4_K_M"]


def test_a_redirect_loop_is_refused_naming_the_url_and_the_bound(
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    publish(hub, ORG_REPO, GGUFS)
    api = f"/api/models/{ORG_REPO}"
    hub.redirects[api] = api
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_K_M", progress=False)
    assert str(e.value) == (
        f"hf.co/{ORG_REPO} ({hub.url}): cannot reach the Hub: more than "
        f"{hubmod.MAX_REDIRECTS} redirects from {hub.url}{api}"
    )
    assert len(hub.paths()) == hubmod.MAX_REDIRECTS + 1


def test_a_listing_error_on_the_command_line_is_one_line(
    hub: Hub,  # noqa: F811
    tmp_path: Path,
) -> None:
    hub.api[f"/api/models/{ORG_REPO}"] = b"<html>\x1b]0;pwned\x07</html>"
    proc = _cli(tmp_path, "pull", "acme/tiny-GGUF:Q4_K_M")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"error: hf.co/acme/tiny-GGUF ({hub.url}): the Hub's answer")
    assert "\x1b" not in proc.stderr and "\\x1b]0;pwned\\x07" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    src = str(Path(dynalm.__file__).parents[1])
    env = {**os.environ, "DYNALM_HOME": str(tmp_path / "cli"), "PYTHONPATH": src}
    return subprocess.run(
        [sys.executable, "-m", "dynalm.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_file_name_with_terminal_escapes_is_refused_and_shown_escaped(
    hub: Hub,  # noqa: F811
    store: ModelStore,
    tmp_path: Path,
) -> None:
    name = "\x1b]0;pwned\x07tiny-Q4_0.gguf"
    publish(hub, ORG_REPO, {name: blob("esc", 1000)})
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q4_0", progress=False)
    assert str(e.value).endswith(
        "the Hub lists an unsafe file name '\\x1b]0;pwned\\x07tiny-Q4_0.gguf'"
    )
    proc = _cli(tmp_path, "pull", "acme/tiny-GGUF:Q4_0")
    assert proc.returncode == 1 and "\x1b" not in proc.stderr + proc.stdout
    assert "'\\x1b]0;pwned\\x07tiny-Q4_0.gguf'" in proc.stderr
    for bad in ("a\nb-Q4_0.gguf", "a\x00b-Q4_0.gguf", "a\u202eb-Q4_0.gguf"):
        hub.api.clear()
        publish(hub, ORG_REPO, {bad: blob("esc", 1000)})
        with pytest.raises(PullError, match="the Hub lists an unsafe file name"):
            store.pull("acme/tiny-GGUF:Q4_0", progress=False)


def test_a_file_name_with_rich_markup_is_shown_as_it_is(
    hub: Hub,  # noqa: F811
    store: ModelStore,
) -> None:
    """Issue 31 (4): ``x[/bad]y-Q4_K_M.gguf`` is a file name, not markup for the progress
    bar or the "no tag given" note."""
    name = "x[/bad]y-Q4_K_M.gguf"
    publish(hub, ORG_REPO, {name: blob("markup", 3000)})
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    bar = hubmod.progress_bar(console, True)
    with bar:
        bar.add_task(f"{ORG_REPO} {name}", total=3000)
        bar.refresh()
    assert name in out.getvalue()
    path = store.pull("acme/tiny-GGUF", progress=True)  # the note names the chosen file
    assert path.name == "bad]y-Q4_K_M.gguf"  # in the repo folder "x[", it lands flat
    assert path.read_bytes() == blob("markup", 3000)
    proc = _cli(store.root.parent, "pull", "acme/tiny-GGUF")
    assert proc.returncode == 0, proc.stderr
    assert f"({name}); tags: Q4_K_M" in proc.stderr


def test_pull_deadline(
    hub: Hub,  # noqa: F811
    store: ModelStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31 (4): a server that stops sending (or trickles) cannot hold a pull past its
    deadline, ``DYNALM_PULL_TIMEOUT`` seconds."""
    publish(hub, ORG_REPO, GGUFS)
    hub.stall_after[f"/cdn/{sha(GGUFS['tiny-Q8_0.gguf'])}"] = 1024
    monkeypatch.setenv("DYNALM_PULL_TIMEOUT", "1.5")
    with pytest.raises(PullError) as e:
        store.pull("acme/tiny-GGUF:Q8_0", progress=False)
    assert str(e.value) == (
        f"could not pull hf.co/acme/tiny-GGUF:Q8_0 from {hub.url}: the pull took longer than "
        "its deadline of 1.5 s (set DYNALM_PULL_TIMEOUT to allow longer)"
    )
    hub.release.set()
    assert store.list() == []
    for bad in ("0", "-1", "1e3", "²", "9" * 400, "3000000", "abc"):
        monkeypatch.setenv("DYNALM_PULL_TIMEOUT", bad)
        with pytest.raises(InvalidRequest) as e:
            store.pull("acme/tiny-GGUF:Q8_0", progress=False)
        assert str(e.value).startswith(f"DYNALM_PULL_TIMEOUT={bad!r}"[:40])
        assert "expected seconds from 1 to 2592000 (30 days)" in str(e.value)


def test_the_deadline_covers_a_trickling_server(tmp_path: Path) -> None:
    """Bytes that keep coming, slowly, never trip a read timeout; the deadline still ends
    the download, checked between chunks."""
    deadline = hubmod.Deadline.start(0.2)

    def trickle() -> Iterator[bytes]:
        while True:
            time.sleep(0.05)
            yield b"x"

    want = hubmod.Expected("slow", 10**6, "0" * 64)
    bar = hubmod.progress_bar(Console(file=io.StringIO()), False)
    task = bar.add_task("slow", total=10**6)
    with pytest.raises(hubmod.SourceFailed, match="longer than its deadline of 0.2 s"):
        hubmod.stream_to(tmp_path / "f", trickle(), 0, want, bar, task, deadline)
