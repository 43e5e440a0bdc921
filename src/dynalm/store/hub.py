"""Hugging Face Hub repos as model sources: ``hf.co/ORG/REPO[:TAG][@REV]`` references, the
repo's file listing (its model API), the choice of files (a GGUF by its quant
tag, or a transformers model's SafeTensors set) and resumable, verified downloads.

Nothing here knows the model store's layout; ``registry.ModelStore`` decides where files go.
``huggingface_hub`` (for the user's token) and ``httpx`` are imported only when the Hub is
contacted: they cost ~0.3 s of every ``dynalm run``'s start otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from dynalm.errors import InvalidRequest, PullError, show

if TYPE_CHECKING:
    import httpx

CHUNK = 1 << 20
# A model API answer: ~250 bytes a file with its hashes, so 32 MiB lists 100k+ files (the
# largest repos hold a few thousand); more is a hostile server, refused before it is parsed.
MAX_LISTING_BYTES = 32 << 20
MAX_ERROR_BYTES = 64 << 10  # an error answer's body: read for its message, no more
MAX_REDIRECTS = 10  # the Hub sends one (to its CDN)
DEFAULT_TAG = "Q4_K_M"  # what a GGUF repo gives without a tag, as Ollama and llama.cpp pick

# A Hub owner or repo name (the Hub's own rule, minus anything a path could abuse).
_SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_TAG = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_REV = r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}"  # a branch, tag or commit; may hold '/'
_REF_RE = re.compile(
    rf"(?P<org>{_SEGMENT})/(?P<repo>{_SEGMENT})"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<rev>{_REV}))?(?::(?P<tag2>{_TAG}))?"
)
_HUB_PREFIXES = ("hf.co/", "huggingface.co/")

# A quant type as GGUF file names spell it: Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, TQ1_0 ...
_QUANT_RE = re.compile(r"(?i)(?:I?Q\d+(?:_[A-Z0-9]+)*|B?F16|F32|FP16|TQ\d_\d|MXFP4(?:_MOE)?)")
_SPLIT_RE = re.compile(r"(?i)-(\d{5})-of-(\d{5})\.gguf$")

# A transformers model's files besides its weights (the first three are required).
TRANSFORMERS_REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
TRANSFORMERS_OPTIONAL = (
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"


class SourceFailed(Exception):
    """A source could not deliver a file; the message is a one-line reason."""


class BadContent(SourceFailed):
    """A source delivered bytes that are not the expected file (wrong hash, too long)."""


# ---------------------------------------------------------------- references


@dataclass(frozen=True)
class HubRef:
    """``ORG/REPO`` with an optional quant tag and revision, as the user wrote them."""

    repo_id: str
    tag: str | None = None
    revision: str | None = None

    @property
    def label(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf.co/{self.repo_id}{tag}{rev}"


def looks_like_hub_ref(model: str) -> bool:
    """Whether ``model`` has the shape of a Hub reference (``hf.co/...`` or ``ORG/REPO...``)
    rather than of a path: no leading ``/``, ``./``, ``~``, one ``ORG/REPO``, no ``.gguf``
    repo name. It may still name an existing local path; the caller checks that first."""
    if model.startswith(_HUB_PREFIXES):
        return True
    if model.startswith(("/", ".", "~")) or "\\" in model:
        return False
    match = _REF_RE.fullmatch(model)
    return bool(match) and not match["repo"].lower().endswith(".gguf")


def parse_hub_ref(model: str) -> HubRef:
    """``[hf.co/]ORG/REPO[:TAG][@REV]`` (the tag may also follow the revision); InvalidRequest
    for anything else, and for any part that could step outside the store (``..``)."""
    prefix = next((p for p in _HUB_PREFIXES if model.startswith(p)), "")
    match = _REF_RE.fullmatch(model[len(prefix) :])
    if match and match["tag"] and match["tag2"]:
        match = None
    rev = match["rev"] if match else None
    parts = [match["org"], match["repo"], match["tag"] or match["tag2"] or ""] if match else []
    if (
        not match
        or any(".." in p for p in parts)
        or (rev is not None and (".." in rev or rev.endswith("/") or "//" in rev))
    ):
        raise InvalidRequest(
            f"invalid Hugging Face model {model!r}: expected [hf.co/]ORG/REPO[:TAG][@REVISION] "
            "(letters, digits, '.', '_', '-'; no '..')"
        )
    return HubRef(f"{match['org']}/{match['repo']}", match["tag"] or match["tag2"], rev)


# ---------------------------------------------------------------- the repo's files


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo at one commit, as the Hub lists it."""

    path: str
    size: int | None
    sha256: str | None  # LFS files: the Hub gives their sha256
    git_sha1: str | None = None  # other files: their git blob id (sha1 of "blob N\0" + bytes)


@dataclass(frozen=True)
class Listing:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]

    def get(self, path: str) -> RemoteFile | None:
        return next((f for f in self.files if f.path == path), None)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def _safe_repo_path(path: str) -> bool:
    """A listed file name that cannot leave the directory it is written into."""
    parts = path.split("/")
    return all(p and p not in (".", "..") and not p.startswith(".") for p in parts) and not (
        "\\" in path or len(path) > 1024 or not path.isprintable()  # no NUL, no escapes
    )


def list_repo(repo_id: str, revision: str | None) -> Listing:
    """The repo's files (sizes and hashes) at ``revision`` (default branch if None), from the
    Hub's model API; a failure or an answer of the wrong shape is a PullError naming the
    repo, the endpoint and what was wrong. Every byte read is bounded (`_stream`)."""
    import httpx

    where = f"hf.co/{repo_id}" + (f"@{revision}" if revision else "") + f" ({endpoint()})"
    url = f"{endpoint()}/api/models/{repo_id}"
    if revision is not None:
        url += f"/revision/{quote(revision, safe='')}"
    try:
        with (
            client(Deadline.start()) as http,
            _stream(http, url, params={"blobs": True}) as response,
        ):
            if response.status_code >= 400:
                raise PullError(f"{where}: {_refusal(response, revision)}")
            body = _read_bounded(response, MAX_LISTING_BYTES, f"{where}: the Hub's answer ({url})")
    except httpx.HTTPError as e:
        raise PullError(f"{where}: cannot reach the Hub: {printable(str(e))}") from None
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise PullError(f"{where}: the Hub's answer is not JSON: {show(body[:60])}") from None
    try:
        return parse_listing(repo_id, data)
    except ListingError as e:
        raise PullError(f"{where}: {e}") from None


def _refusal(response: httpx.Response, revision: str | None) -> str:
    """What an error answer of the model API means, as ``huggingface_hub`` reads the Hub's
    ``X-Error-Code`` (a 401 is also how the Hub hides a private repo), with the server's own
    message from at most `MAX_ERROR_BYTES` of its body."""
    code, status = response.headers.get("x-error-code", ""), response.status_code
    if code == "RevisionNotFound":
        return f"revision {revision!r} not found"
    if code in ("RepoNotFound", "GatedRepo") or status == 401:
        return "repository not found (a private or gated repo? set HF_TOKEN or run `hf auth login`)"
    what = f"the Hub's error answer ({response.url})"
    try:
        body = _read_bounded(response, MAX_ERROR_BYTES, what)
    except PullError as e:
        return f"the Hub answered HTTP {status}, and {e}"
    try:
        said = json.loads(body).get("error")
    except (ValueError, AttributeError):
        said = None
    return f"the Hub answered HTTP {status}" + (
        f": {printable(show(said, 200))}" if isinstance(said, str) and said else ""
    )


@contextmanager
def _stream(
    http: httpx.Client, url: str, headers: dict | None = None, params: dict | None = None
) -> Iterator[httpx.Response]:
    """``GET url`` as a stream, following up to `MAX_REDIRECTS` redirects here: httpx reads
    a redirect's whole body before it follows it, and a hostile server's can be endless; a
    redirect's body is never read (its connection is closed)."""
    import httpx

    request = http.build_request("GET", url, headers=headers, params=params)
    for _ in range(MAX_REDIRECTS + 1):
        response = http.send(request, stream=True, follow_redirects=False)
        if response.next_request is None:
            try:
                yield response
            finally:
                response.close()
            return
        request = response.next_request
        response.close()
    raise httpx.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects from {url}", request=request)


def _read_bounded(response: httpx.Response, limit: int, what: str) -> bytes:
    """A streamed response's body, refused (PullError naming ``what`` and the limit) as
    soon as it is known to be longer than ``limit`` bytes: by its Content-Length, else by
    counting what arrives."""
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PullError(f"{what} is {int(declared)} bytes long, more than {limit}")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise PullError(f"{what} is longer than {limit} bytes")
    return bytes(body)


class ListingError(ValueError):
    """A model API answer of the wrong shape; the message says what was wrong."""


_COMMIT_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git commit id (sha1 or sha256)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_BLOB_ID_RE = re.compile(r"[0-9a-f]{40}")  # a git blob id: sha1 of "blob N\0" + bytes


def _field(obj: dict, key: str, kind: type, where: str, pattern: re.Pattern | None = None):
    """``obj[key]`` if it is absent/null (None) or a ``kind`` (matching ``pattern``, for
    strings); a ListingError naming ``where``, the key and what it should be otherwise."""
    value = obj.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and isinstance(value, int):
        ok = value >= 0
    if ok and pattern is not None:
        ok = bool(pattern.fullmatch(value))
    if not ok:
        want = {str: "a string", int: "a non-negative integer", dict: "an object"}[kind]
        if pattern is _SHA256_RE:
            want = "64 lowercase hex digits"
        elif pattern is _BLOB_ID_RE:
            want = "40 lowercase hex digits"
        elif pattern is _COMMIT_RE:
            want = "a commit id (40 or 64 lowercase hex digits)"
        raise ListingError(f"the Hub lists {where} with {key!r} {show(value)}, expected {want}")
    return value


def parse_listing(repo_id: str, data: object) -> Listing:
    """The model API's JSON answer as a Listing: a commit id, and for each file a safe name,
    its size and its LFS sha256 or git blob id, each checked for type and form (a hash
    that is not one could never verify anything, or could be a path)."""
    if not isinstance(data, dict):
        what = "null" if data is None else show(data)
        raise ListingError(f"the Hub's answer is {what}, not a JSON object")
    commit = _field(data, "sha", str, "the repo", _COMMIT_RE)
    siblings = data.get("siblings")
    if commit is None or not isinstance(siblings, list):
        raise ListingError(
            "the Hub's answer has no commit ('sha') or no list of files ('siblings' is "
            f"{show(siblings)})"
        )
    files = []
    for i, s in enumerate(siblings):
        if not isinstance(s, dict):
            raise ListingError(f"the Hub lists file {i} as {show(s)}, not an object")
        name = s.get("rfilename")
        if not isinstance(name, str) or not _safe_repo_path(name):
            raise ListingError(f"the Hub lists an unsafe file name {show(name)}")
        where = f"file {show(name)}"
        size = _field(s, "size", int, where)
        blob_id = _field(s, "blobId", str, where, _BLOB_ID_RE)
        lfs = _field(s, "lfs", dict, where)
        sha256 = _field(lfs, "sha256", str, f"{where} (lfs)", _SHA256_RE) if lfs else None
        lfs_size = _field(lfs, "size", int, f"{where} (lfs)") if lfs else None
        if size is not None and lfs_size is not None and size != lfs_size:
            raise ListingError(f"the Hub lists {where} with size {size} but LFS size {lfs_size}")
        files.append(RemoteFile(name, size if size is not None else lfs_size, sha256,
                                None if lfs else blob_id))  # fmt: skip
    return Listing(repo_id, commit, tuple(files))


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes, newlines) written as escapes,
    for a server's string that is shown to the user."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


# ---------------------------------------------------------------- choosing files


def quant_tag(path: str) -> str | None:
    """The quant type a GGUF file's name carries (its last one), e.g. ``Q4_K_M``."""
    stem = _SPLIT_RE.sub("", Path(path).name)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    tokens = [t for t in re.split(r"[.\-]", stem) if _QUANT_RE.fullmatch(t)]
    return tokens[-1].upper() if tokens else None


def _carries(path: str, tag: str) -> bool:
    """Whether a file name carries ``tag``, case-insensitively, as a whole token
    (``Q4_K`` is not ``Q4_K_M``)."""
    return bool(re.search(rf"(?i)(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", path))


@dataclass(frozen=True)
class Selection:
    """What to download from a repo: ``kind`` "gguf" (one file) or "transformers"."""

    kind: str
    variant: str  # the store's name for it: the quant tag (lowercase) or "safetensors"
    files: tuple[RemoteFile, ...]
    note: str = ""  # said to the user (e.g. which tag was picked without one)


def _gguf_candidates(listing: Listing) -> list[RemoteFile]:
    return [
        f
        for f in listing.files
        if f.path.lower().endswith(".gguf") and not Path(f.path).name.lower().startswith("mmproj")
    ]


def _tags(files: Iterable[RemoteFile]) -> str:
    tags = sorted({quant_tag(f.path) or Path(f.path).name for f in files})
    return ", ".join(tags) or "(none)"


def _one_gguf(ref: HubRef, matches: list[RemoteFile], tag: str) -> RemoteFile:
    if len(matches) > 1 and all(_SPLIT_RE.search(f.path) for f in matches):
        raise PullError(
            f"{ref.label}: {tag} is a GGUF split into {len(matches)} files, which DynaLM does "
            "not load yet (merge them with `llama-gguf-split --merge`)"
        )
    if len(matches) > 1:
        names = ", ".join(f.path for f in matches)
        raise PullError(f"{ref.label}: tag {tag} is ambiguous, it matches {names}")
    return matches[0]


def select_files(ref: HubRef, listing: Listing) -> Selection:
    """The GGUF named by the tag, or without a tag a transformers model (config.json +
    tokenizer + *.safetensors) if the repo has one, else its default GGUF."""
    ggufs = _gguf_candidates(listing)
    top = {f.path: f for f in listing.files if "/" not in f.path}
    has_transformers = "config.json" in top and any(p.endswith(".safetensors") for p in top)
    if ref.tag:
        if not ggufs:
            raise PullError(f"{ref.label}: the repo has no GGUF files, so no tag {ref.tag}")
        matches = [f for f in ggufs if _carries(f.path, ref.tag)]
        if not matches:
            raise PullError(
                f"{ref.label}: no GGUF file carries the tag {ref.tag}; available tags: "
                f"{_tags(ggufs)}"
            )
        chosen = _one_gguf(ref, matches, ref.tag)
        return Selection("gguf", ref.tag.lower(), (chosen,))
    if has_transformers:
        return _transformers_files(ref, top)
    if not ggufs:
        raise PullError(
            f"{ref.label}: the repo has neither GGUF files nor a transformers model "
            "(config.json + *.safetensors)"
        )
    default = [f for f in ggufs if _carries(f.path, DEFAULT_TAG)]
    if default:
        chosen, how = _one_gguf(ref, default, DEFAULT_TAG), "the default"
    else:
        singles = [f for f in ggufs if not _SPLIT_RE.search(f.path)] or ggufs
        chosen, how = min(singles, key=lambda f: (f.size or 0, f.path)), "the smallest"
    tag = quant_tag(chosen.path) or Path(chosen.path).stem
    note = f"{ref.label}: no tag given, using {how} {tag} ({chosen.path}); tags: {_tags(ggufs)}"
    return Selection("gguf", tag.lower(), (chosen,), note)


def _transformers_files(ref: HubRef, top: dict[str, RemoteFile]) -> Selection:
    missing = [name for name in TRANSFORMERS_REQUIRED if name not in top]
    if missing:
        raise PullError(
            f"{ref.label}: a transformers model needs {', '.join(missing)}, which the repo lacks"
        )
    names = [*TRANSFORMERS_REQUIRED, *(n for n in TRANSFORMERS_OPTIONAL if n in top)]
    weights = sorted(p for p in top if p.endswith(".safetensors"))
    if SAFETENSORS_INDEX in top:
        names.append(SAFETENSORS_INDEX)  # the shards follow once the index is read
    elif "model.safetensors" in top:
        names.append("model.safetensors")
    elif len(weights) == 1:
        names.append(weights[0])
    else:
        raise PullError(
            f"{ref.label}: {len(weights)} *.safetensors files ({', '.join(weights)}) and no "
            f"{SAFETENSORS_INDEX} saying which form the model"
        )
    return Selection("transformers", "safetensors", tuple(top[n] for n in names))


def index_shards(ref: HubRef, listing: Listing, index: Path) -> list[RemoteFile]:
    """The shards a downloaded ``model.safetensors.index.json`` names, each in the listing."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PullError(f"{ref.label}: {SAFETENSORS_INDEX} is not a valid index: {e}") from None
    files = []
    for name in shards:
        file = listing.get(name) if isinstance(name, str) and "/" not in name else None
        if file is None:
            raise PullError(f"{ref.label}: {SAFETENSORS_INDEX} names {name!r}, not in the repo")
        files.append(file)
    return files


# ---------------------------------------------------------------- downloading


@dataclass(frozen=True)
class Expected:
    """What a download must turn out to be: its sha256, or its git blob id and size (an
    unknown size is not checked when the sha256 is known)."""

    label: str  # names the file in progress bars and errors
    size: int | None
    sha256: str | None = None
    git_sha1: str | None = None

    def check_verifiable(self) -> None:
        """Refuse a file with nothing to verify its bytes against: the server's bytes
        would be published as they came."""
        if not (self.sha256 or (self.git_sha1 and self.size is not None)):
            raise BadContent(
                f"{self.label}: the listing gives no sha256 and no git blob id with a size "
                "for it, nothing to verify the download against"
            )


DEADLINE_ENV = "DYNALM_PULL_TIMEOUT"
DEFAULT_DEADLINE_S = 6 * 3600
MAX_DEADLINE_S = 30 * 24 * 3600


@dataclass(frozen=True)
class Deadline:
    """The time a whole pull may take (listing, every file, every source): ``$DYNALM_PULL_
    TIMEOUT`` seconds, 6 hours by default. A server that trickles bytes never trips the
    per-read timeout; this ends the pull with a clear error instead."""

    seconds: float
    at: float  # time.monotonic() when it expires

    @classmethod
    def start(cls, seconds: float | None = None) -> Deadline:
        if seconds is None:
            text = os.environ.get(DEADLINE_ENV, "").strip()
            seconds = DEFAULT_DEADLINE_S
            if text:
                if not re.fullmatch(r"[0-9]{1,9}(?:\.[0-9]{1,6})?", text, re.ASCII) or not (
                    1 <= float(text) <= MAX_DEADLINE_S
                ):
                    raise InvalidRequest(
                        f"{DEADLINE_ENV}={show(text)}: expected seconds from 1 to "
                        f"{MAX_DEADLINE_S} (30 days)"
                    )
                seconds = float(text)
        return cls(seconds, time.monotonic() + seconds)

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self) -> None:
        if self.left() <= 0:
            raise SourceFailed(
                f"the pull took longer than its deadline of {self.seconds:g} s (set "
                f"{DEADLINE_ENV} to allow longer)"
            )


class _Hashes:
    """sha256 (and the git blob sha1 when one is expected) of the bytes written."""

    def __init__(self, want: Expected):
        self.sha256 = hashlib.sha256()
        self.sha1 = None
        if want.git_sha1 and want.size is not None:
            self.sha1 = hashlib.sha1(f"blob {want.size}\0".encode(), usedforsecurity=False)

    def update(self, block: bytes) -> None:
        self.sha256.update(block)
        if self.sha1 is not None:
            self.sha1.update(block)

    def file(self, path: Path, upto: int | None = None) -> None:
        """Hash ``path``'s first ``upto`` bytes (all of it if None)."""
        with open(path, "rb") as f:
            left = upto
            while block := f.read(CHUNK if left is None else min(CHUNK, left)):
                self.update(block)
                if left is not None:
                    left -= len(block)

    def mismatch(self, want: Expected) -> str | None:
        got = self.sha256.hexdigest()
        if want.sha256 and got != want.sha256:
            return f"sha256 mismatch: got {got[:12]}…, expected {want.sha256[:12]}…"
        if self.sha1 is not None and self.sha1.hexdigest() != want.git_sha1:
            return f"git blob id mismatch: got {self.sha1.hexdigest()[:12]}…"
        return None


def verified(path: Path, want: Expected) -> str | None:
    """The sha256 of a file already on disk if it is what ``want`` says (size and hashes),
    else None: a file staged by an earlier pull may be of another commit."""
    want.check_verifiable()
    if want.size is not None and path.stat().st_size != want.size:
        return None
    hashes = _Hashes(want)
    hashes.file(path)
    return None if hashes.mismatch(want) else hashes.sha256.hexdigest()


def stream_to(
    partial: Path,
    chunks: Iterable[bytes],
    offset: int,
    want: Expected,
    progress: Progress,
    task: TaskID,
    deadline: Deadline,
) -> str:
    """Append ``chunks`` to ``partial`` after its first ``offset`` bytes, then verify size and
    hashes and fsync; returns the sha256. A file that fails verification is deleted."""
    want.check_verifiable()
    hashes = _Hashes(want)
    if offset:
        hashes.file(partial, offset)
    with open(partial, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.truncate()
        written = offset
        for chunk in chunks:
            deadline.check()
            written += len(chunk)
            if want.size is not None and written > want.size:
                raise BadContent(f"sent more than the expected {want.size} bytes")
            hashes.update(chunk)
            f.write(chunk)
            progress.advance(task, len(chunk))
        f.flush()
        os.fsync(f.fileno())
    if want.size is not None and written != want.size:
        raise SourceFailed(f"got {written} bytes, expected {want.size}")
    if reason := hashes.mismatch(want):
        partial.unlink()
        raise BadContent(reason)
    return hashes.sha256.hexdigest()


def client(deadline: Deadline) -> httpx.Client:
    """An HTTP client for the Hub: the user's token (HF_TOKEN or `hf auth login`), no
    compression (byte offsets must be the file's), no read waiting past the pull's
    deadline; redirects are `_stream`'s. Headers built by hand: huggingface_hub's probe the
    Hub for a telemetry list."""
    import httpx
    from huggingface_hub import get_token

    headers = {"user-agent": f"dynalm/{__version__}", "accept-encoding": "identity"}
    if token := get_token():
        headers["authorization"] = f"Bearer {token}"
    wait = max(0.1, min(60.0, deadline.left()))
    timeout = httpx.Timeout(wait, connect=min(10.0, wait))
    return httpx.Client(headers=headers, timeout=timeout)  # redirects: `_stream`


def file_url(repo_id: str, revision: str, path: str) -> str:
    return f"{endpoint()}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"


def download(
    http: httpx.Client,
    url: str,
    partial: Path,
    want: Expected,
    progress: Progress,
    deadline: Deadline,
) -> str:
    """Download ``url`` into ``partial``, resuming a leftover one with a Range request (and
    starting over if the resumed file does not verify); returns its sha256."""
    want.check_verifiable()
    deadline.check()
    size = partial.stat().st_size if partial.exists() else 0
    offset = size if want.size is None or size < want.size else 0
    try:
        return _get(http, url, offset, partial, want, progress, deadline)
    except BadContent:
        if not offset:
            raise
        return _get(http, url, 0, partial, want, progress, deadline)  # a bad leftover: redo


def _get(
    http: httpx.Client,
    url: str,
    offset: int,
    partial: Path,
    want: Expected,
    progress: Progress,
    deadline: Deadline,
) -> str:
    import httpx

    headers = {"range": f"bytes={offset}-"} if offset else {}
    try:
        with _stream(http, url, headers) as response:
            if response.status_code == 416:  # the file is shorter than the leftover
                raise BadContent("server refused to resume the partial download")
            response.raise_for_status()
            if response.status_code != 206:
                offset = 0
            total = want.size
            length = response.headers.get("content-length", "")
            if total is None and length.isascii() and length.isdigit():
                total = offset + int(length)
            task = progress.add_task(want.label, total=total, completed=offset)
            try:
                chunks = response.iter_raw()
                return stream_to(partial, chunks, offset, want, progress, task, deadline)
            finally:
                progress.remove_task(task)
    except httpx.HTTPStatusError as e:
        status = e.response.status_code
        hint = (
            " (a gated repo? set HF_TOKEN or run `hf auth login`)" if status in (401, 403) else ""
        )
        where = e.request.url.copy_with(query=None)
        reason = printable(e.response.reason_phrase)
        raise SourceFailed(f"HTTP {status} {reason} from {where}{hint}") from e
    except httpx.TimeoutException as e:
        deadline.check()  # the read timed out because the deadline came
        raise SourceFailed(f"{type(e).__name__}: {printable(str(e))}") from e
    except httpx.HTTPError as e:
        raise SourceFailed(f"{type(e).__name__}: {printable(str(e))}") from e


def progress_bar(console: Console, enabled: bool) -> Progress:
    """The download progress bar (on stderr). Descriptions hold the Hub's file names, so
    they are plain text: ``x[/b]y.gguf`` is a name, not markup."""
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console, disable=not enabled)
