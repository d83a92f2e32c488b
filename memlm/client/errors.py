"""Typed exceptions for the API's error answers: every one carries the ``{"error",
"detail"}`` body, the status, and (429) the Retry-After the server asked for."""

from __future__ import annotations

from typing import Any


class MemlmError(Exception):
    """An error answer of the memlm API (or a stream's ``error`` event)."""

    status: int = 0

    def __init__(self, status: int, error: str, detail: str, body: Any = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error  # the stable code: validation_error, overloaded, ...
        self.detail = detail
        self.body = body if body is not None else {"error": error, "detail": detail}


class BadRequest(MemlmError):
    """400: the body is not valid UTF-8 or not JSON."""


class Unauthorized(MemlmError):
    """401: no valid bearer token for this route."""


class NotFound(MemlmError):
    """404: no such document or build."""


class Conflict(MemlmError):
    """409: the resource's state does not allow it now."""


class PayloadTooLarge(MemlmError):
    """413: the body, a document or a text is larger than the server accepts."""


class ValidationFailed(MemlmError):
    """422: the request does not validate, or the engine cannot use its text."""


class Overloaded(MemlmError):
    """429: the model's queue is full; ``retry_after`` seconds is the server's advice."""

    def __init__(self, status: int, error: str, detail: str, body: Any = None,
                 retry_after: float = 1.0) -> None:  # fmt: skip
        super().__init__(status, error, detail, body)
        self.retry_after = retry_after


class ServerError(MemlmError):
    """500 (or another 5xx but 503): something failed on the server (its log says what)."""


class Unavailable(MemlmError):
    """503: the model is not loaded yet, or failed to load."""


class TransportError(MemlmError):
    """The server could not be reached or the connection broke (no HTTP answer)."""


_BY_STATUS: dict[int, type[MemlmError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationFailed,
    429: Overloaded,
    503: Unavailable,
}


def error_for(status: int, body: Any, retry_after: str | None = None) -> MemlmError:
    """The exception of an error answer: its class by status, its body as sent."""
    error, detail = "error", str(body)
    if isinstance(body, dict):
        error = str(body.get("error", error))
        detail = str(body.get("detail", ""))
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else MemlmError)
    if cls is Overloaded:
        try:
            wait = float(retry_after) if retry_after is not None else 1.0
        except ValueError:
            wait = 1.0
        return Overloaded(status, error, detail, body, retry_after=wait)
    return cls(status, error, detail, body)
