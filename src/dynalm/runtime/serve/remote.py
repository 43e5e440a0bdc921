"""The commands that ask a running server (``dynalm ps``, ``dynalm stop``): its address as
Ollama's clients find theirs (``--host``/``--port``, else ``DYNALM_HOST`` like
``OLLAMA_HOST``: ``host``, ``host:port`` or a URL), and its Ollama API."""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from dynalm.errors import DynaError, ServerUnreachable
from dynalm.store.catalog import format_size

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # `dynalm serve`'s
_TIMEOUT_S = 30.0


def server_url(host: str | None = None, port: int | None = None) -> str:
    """The base URL of the server: ``host`` (or ``$DYNALM_HOST``) with ``port`` if given."""
    given = host or os.environ.get("DYNALM_HOST") or DEFAULT_HOST
    url = given if "://" in given else f"http://{given}"
    parsed = httpx.URL(url)
    if port is not None or parsed.port is None:
        parsed = parsed.copy_with(port=port if port is not None else DEFAULT_PORT)
    return str(parsed).rstrip("/")


def call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON the server answers; its error message, or that no server answers, raised."""
    key = os.environ.get("DYNALM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ServerUnreachable(
            f"no DynaLM server answers at {url} ({type(e).__name__}: {e}); start one with "
            "`dynalm serve`, or give its address with --host/--port or DYNALM_HOST"
        ) from None
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code >= 400:
        message = data.get("error") if isinstance(data, dict) else None
        raise DynaError(f"{url}: {message or f'HTTP {r.status_code}'}")
    if data is None:
        raise ServerUnreachable(f"{url} answered {path} with no JSON: is it a DynaLM server?")
    return data


def _until(expires_at: str | None) -> str:
    if expires_at is None:
        return "while in use / for good"
    t = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()
    left = max(0, int(t - time.time()))
    local = datetime.fromtimestamp(t).strftime("%H:%M:%S")
    return f"{local} (in {left // 60}m {left % 60}s)"


def ps_command(url: str, console: Console | None = None) -> None:
    """The loaded models: name, size, device, until when."""
    models = call(url, "GET", "/api/ps")["models"]
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "SIZE", "DEVICE", "UNTIL"):
        table.add_column(column)
    for m in models:
        table.add_row(
            m["name"], format_size(m["size"]), m.get("device", "cpu"), _until(m["expires_at"])
        )
    (console or Console()).print(table)


def stop_command(url: str, model: str) -> None:
    """Unload ``model`` now (after the requests using it end), as `ollama stop` does."""
    call(url, "POST", "/api/generate", {"model": model, "keep_alive": 0, "stream": False})
