"""The chat page at ``/``: static files shipped inside the package (``static/``), no build
step and nothing fetched from elsewhere; the page talks to the server's own OpenAI API.
Its Content-Security-Policy allows this origin only, so neither a script from outside nor
HTML injected through a model's answer could run."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
_POLICY = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"


def install_chat_page(app: FastAPI) -> None:
    """``/`` serves the page, ``/static/...`` its scripts and style (outside the OpenAPI
    document: they are no part of the API)."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": _POLICY})

    app.get("/", include_in_schema=False)(index)
