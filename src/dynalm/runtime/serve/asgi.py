"""The HTTP layer beneath the OpenAI endpoints (`server`): OpenAI's error JSON for every
failure, JSON bodies parsed strictly, a limit on request bodies, and an OpenAPI document
that says what the server really sends.

Whatever a client sends, the answer is a 4xx naming what was wrong, never a 500: a body
over the limit is refused (413) before it is read in full, text with a lone UTF-16
surrogate (``"\\ud800"``, which no encoder can write back) is refused as invalid JSON,
and error messages are bounded in length because they may quote the input.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynalm.errors import DynaError
from dynalm.runtime.serve import protocol as p

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 asks clients to wait, unless the error says otherwise
MAX_BODY_BYTES = 8 << 20  # the default limit on a request body
BODY_TIMEOUT_S = 30.0  # the default time a request body may take to arrive, from its start
_MAX_MESSAGE = 1000  # characters of an error message
OLLAMA_PREFIX = "/api/"  # Ollama's API: its errors are {"error": "message"}
_MAX_PARAM = 100


def _bounded(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and made encodable (no lone surrogates)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error response: an HTTP status and the fields of OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int = RETRY_AFTER_S,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, _bounded(message, _MAX_MESSAGE)
        self.param = None if param is None else _bounded(param, _MAX_PARAM)
        self.code = code
        self.headers = dict(headers or {})
        if status == 503:
            self.headers["Retry-After"] = str(retry_after)

    @classmethod
    def of(cls, e: Exception) -> APIError:
        """The response for any exception; internal errors never show their details."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, DynaError):
            code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).lower()
            retry_after = getattr(e, "retry_after", RETRY_AFTER_S)
            return cls(e.http_status, str(e), code=code, retry_after=retry_after)
        log.error("internal error", exc_info=e)
        return cls(500, "internal server error (see the server log)")

    def body(self, path: str = "") -> dict[str, Any]:
        """The error JSON of the API ``path`` belongs to: Ollama's or OpenAI's."""
        if path.startswith(OLLAMA_PREFIX):
            return {"error": self.message}
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return p.error_body(self.message, kind, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers or None)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def _invalid_body(e: RequestValidationError) -> APIError:
    """A 400 naming the first field that failed validation (FastAPI's default is a 422)."""
    error = e.errors()[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {error['ctx']['error']}")
    where = ".".join(str(x) for x in error["loc"] if x != "body")
    message = error["msg"].removeprefix("Value error, ")  # pydantic's prefix for our own checks
    return APIError(400, f"{where or 'body'}: {message}", param=where or None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error JSON (Ollama's under `OLLAMA_PREFIX`), with its status and
    headers (405: ``Allow``)."""

    async def api_error(request: Request, e: Exception) -> Response:
        return APIError.of(e).response(request.url.path)

    async def invalid_body(request: Request, e: Exception) -> Response:
        assert isinstance(e, RequestValidationError)
        return _invalid_body(e).response(request.url.path)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        message = str(e.detail)
        if e.status_code in (404, 405):  # Starlette's bare "Not Found": say what was not found
            message = f"{message}: {request.method} {request.url.path}"
        return APIError(e.status_code, message, headers=e.headers).response(request.url.path)

    async def client_gone(_: Request, e: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed"

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(DynaError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)


_HANDLED = (APIError, DynaError, RequestValidationError, HTTPException, ClientGone)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class StrictJSONRequest(Request):
    """A request whose JSON body is parsed by pydantic's parser, which refuses lone surrogates
    (Python's `json` lets them through to fail later, in the tokenizer or an encoder: a 500)
    and nesting deeper than 200, with a message that says where."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body, allow_inf_nan=True)
            except ValueError as e:
                reason = str(e)
                if not _is_utf8(body):
                    reason = "it is not UTF-8"
                elif "surrogate" in reason or "end of hex escape" in reason:
                    # what the parser says of "\ud800" alone: name the real problem
                    reason = f"a lone UTF-16 surrogate escape is not text ({reason})"
                elif "number out of range" in reason:  # an integer of 5,000 digits
                    limit = sys.get_int_max_str_digits()
                    reason = f"{reason} (an integer may have at most {limit} digits)"
                # FastAPI turns this one into a validation error (and so a 400)
                raise json.JSONDecodeError(reason, "", 0) from None
        return self._json


_FORM = b"application/x-www-form-urlencoded"


def _form_as_json(scope: dict) -> dict:
    """`curl -d '{...}'` labels a JSON body as a form: read it as JSON, as llama-server and
    Ollama do (these endpoints take no forms), instead of refusing the README's own example."""
    headers = scope.get("headers", [])
    if not any(k == b"content-type" and v.lower().startswith(_FORM) for k, v in headers):
        return scope
    as_json = [(k, b"application/json" if k == b"content-type" else v) for k, v in headers]
    return {**scope, "headers": as_json}


class Route(APIRoute):
    """Every endpoint: strict JSON bodies; an unexpected exception becomes a 500 response
    here (logged once), where Starlette would log it, answer, then re-raise it to uvicorn
    ("Exception in ASGI application")."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                scope = _form_as_json(request.scope)
                return await handler(StrictJSONRequest(scope, request.receive))
            except _HANDLED:
                raise
            except Exception as e:
                return APIError.of(e).response(request.url.path)

        return route


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 as soon as
    that is known (from Content-Length, else while the body arrives), never buffered whole;
    one that has not arrived whole ``timeout_s`` after the request began is refused with 408
    (a client that sends half a body would otherwise hold its connection, and a task, open
    forever)."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    def _too_large(self) -> HTTPException:
        return HTTPException(
            413, f"the request body is over this server's limit of {self.limit} bytes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared[:20]) > self.limit:
            e = self._too_large()
            response = APIError(413, e.detail).response(scope.get("path", ""))
            return await response(scope, receive, send)
        seen, whole = 0, False
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def limited() -> Message:
            nonlocal seen, whole
            if whole:  # the body is in: what follows is the disconnect, however late
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0))
            except TimeoutError:
                raise HTTPException(  # (passed on like the 413)
                    408, f"the request body did not arrive within {self.timeout_s:g} s"
                ) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise self._too_large()  # FastAPI passes it on to the HTTPException handler
            return message

        await self.app(scope, limited, send)


class OllamaError(BaseModel):
    """Ollama's error JSON (under `OLLAMA_PREFIX`)."""

    error: str


def error_responses(
    *statuses: int, schema: type[BaseModel] = p.ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the errors an endpoint may answer (``schema``: the
    error JSON's, OpenAI's unless the endpoint is Ollama's)."""
    described = {
        400: "Invalid request: a parameter missing, out of range or of the wrong kind, "
        "or a prompt over the context; the message names it.",
        401: "Missing or wrong API key.",
        404: "No such model.",
        408: "The request body did not arrive in time.",
        413: "The request body is over the server's limit.",
        500: "Internal error (a bug: the server log has the details).",
        501: "Not implemented yet (the message names the issue).",
        503: "The waiting queue is full or the server is shutting down: retry after "
        "Retry-After seconds.",
    }
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": schema, "description": described[status]}
        if status == 503:
            out[status]["headers"] = {
                "Retry-After": {"schema": {"type": "integer"}, "required": True}
            }
    return out


def install_openapi(app: FastAPI) -> None:
    """FastAPI's OpenAPI document without the 422 it adds to every endpoint with a body:
    this server answers 400 (documented per endpoint through `error_responses`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in doc["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
