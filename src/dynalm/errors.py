"""User-facing errors: each one carries a one-line message naming what was wrong.

The CLI prints ``DynaError`` as ``error: <message>`` and exits non-zero; the HTTP
server maps them to OpenAI-style error JSON with ``http_status``.
"""

from __future__ import annotations

MAX_SHOWN = 200  # characters of a value that a message shows


def show(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr`` of a value for a message, on one line, cut to about ``limit`` characters: a
    corrupt file can hold a megabyte-long key or array, which must not become a megabyte-long
    line."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:  # a numpy array
        value, n = value[:9].tolist(), len(value)
    else:
        n = len(value) if isinstance(value, (list, tuple)) else 0
    if n > 8:
        head = ", ".join(show(v, limit // 8) for v in value[:8])  # type: ignore[index]
        return f"[{head}, ... ({n} items)]"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class DynaError(Exception):
    """Base class of every error a user can cause (bad file, bad name, bad request)."""

    http_status = 400


class ModelNotFound(DynaError):
    """A model name or path that resolves to nothing."""

    http_status = 404


class ModelFormatError(DynaError):
    """A file that is not a valid GGUF, or is truncated/corrupt."""


class UnsupportedModel(DynaError):
    """A valid file we cannot run: unknown architecture, unsupported tensor type."""


class PullError(DynaError):
    """Downloading a model failed from every source."""


class PromptTooLong(DynaError):
    """The prompt (plus requested tokens) does not fit the context window."""


class InvalidRequest(DynaError):
    """A parameter out of range or of the wrong kind."""


class NonFiniteLogits(DynaError):
    """The model produced NaN or infinite logits: corrupt weights, not a bad request."""

    http_status = 500


class DeviceUnavailable(DynaError):
    """A forced backend (e.g. --gpu) that cannot run on this machine."""


class EngineFailure(DynaError):
    """The one error that is not the user's: a step of the engine failed (a bug, logged with
    its traceback) and the requests in it were aborted."""

    http_status = 500


class QueueFull(DynaError):
    """The engine's waiting queue is full (or it is shutting down): retry later."""

    http_status = 503
    retry_after = 1  # seconds, for the Retry-After header


class ClusterUnavailable(DynaError):
    """``dynalm serve --replicas``: Ray is not installed, or its cluster cannot be reached."""


class ReplicaLost(DynaError):
    """The cluster replica running a request died after the request had produced output
    (a request that had not started is retried on another replica instead)."""

    http_status = 503
    retry_after = 1


class ServerUnreachable(DynaError):
    """``dynalm ps`` / ``stop``: no server answers at the address (or it is not DynaLM's)."""
