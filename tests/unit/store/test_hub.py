"""Hugging Face repos as model sources (``hf.co/ORG/REPO[:TAG][@REV]``), against the fake Hub
of ``test_registry``: its model API (``/api/models/...``, what ``huggingface_hub`` calls) and
``resolve/`` downloads with the Hub's headers, LFS files redirected to a CDN path."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
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
