"""One error body, ``{"error": ..., "detail": ...}``, for every failure the API answers.

Domain errors carry a message meant for clients. Anything else is logged with its
traceback and answered with a generic message: exception text never reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from memlm.api import ErrorOut
from memlm.db.errors import DomainError
from memlm.unavailable import MemoryUnavailable, unavailable

log = logging.getLogger(__name__)


class Unauthorized(DomainError):
    status_code = 401
    error = "unauthorized"


class InvalidRequest(DomainError):
    """Well-formed, but against a limit the settings set (the schema cannot say it)."""

    status_code = 422
    error = "validation_error"


class PayloadTooLarge(DomainError):
    status_code = 413
    error = "payload_too_large"


class Overloaded(DomainError):
    status_code = 429
    error = "overloaded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(DomainError):
    status_code = 503
    error = "unavailable"


_HTTP_NAMES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
}


# What each error status means, for OpenAPI; every one has the ErrorOut body.
_MEANING = {
    400: "the body is not valid UTF-8",
    401: "no valid bearer token (WWW-Authenticate: Bearer)",
    404: "no such resource",
    409: "the resource's state does not allow it now",
    413: "the body, a document or a text is larger than the server accepts",
    422: "the request does not validate (validation_error) or the engine cannot use "
    "its text (invalid_input)",
    429: "the model's queue is full; retry after Retry-After seconds",
    500: "an unexpected error (logged by the server; the detail never says more)",
    503: "a dependency is away: the model is not loaded yet (or failed to load), the "
    "database or the vector memory server is unreachable, or the data directory's disk "
    "is full; the detail says which; retry after Retry-After seconds",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    429: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    503: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with the ErrorOut body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorOut, "description": _MEANING[status]}
        if status in _HEADERS:
            out[status]["headers"] = _HEADERS[status]
    return out


def error_body(error: str, detail: Any) -> dict[str, Any]:
    return {"error": error, "detail": detail}


# The status and body of an error, from (status, error code, detail, the request field at
# fault or None). A family of routes that speaks another API's dialect answers its errors
# in that API's body (the OpenAI-compatible /v1/: service/routes/openai.py); it installs
# its shape for its path prefix with ``install_error_shape``.
ErrorShape = Callable[[int, str, Any, "str | None"], tuple[int, dict[str, Any]]]


def install_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    """Answer every error of a request whose path starts with ``prefix`` with ``shape``."""
    shapes: dict[str, ErrorShape] = getattr(app.state, "error_shapes", {})
    app.state.error_shapes = {**shapes, prefix: shape}


def shaped_error(
    where: Any, status: int, error: str, detail: Any, param: str | None = None
) -> tuple[int, dict[str, Any]]:
    """The status and body of an error answered to ``where`` (a request or an ASGI scope)."""
    scope = where if isinstance(where, dict) else getattr(where, "scope", {})
    app = scope.get("app")
    shapes: dict[str, ErrorShape] = getattr(getattr(app, "state", None), "error_shapes", {})
    path = scope.get("path", "")
    for prefix, shape in shapes.items():
        if path.startswith(prefix):
            return shape(status, error, detail, param)
    return status, error_body(error, detail)


def error_response(
    status: int,
    error: str,
    detail: Any,
    headers: dict[str, str] | None = None,
    *,
    where: Any = None,
    param: str | None = None,
) -> JSONResponse:
    """The error answer; ``where`` (the request) picks its body (``install_error_shape``)."""
    if where is None:
        return JSONResponse(error_body(error, detail), status_code=status, headers=headers)
    status, body = shaped_error(where, status, error, detail, param)
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_param(exc: RequestValidationError) -> str | None:
    """The body field of the first problem (dotted), None when the body as a whole is."""
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return loc or None
    return None


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


_sleep = asyncio.sleep  # tests record the pauses through this name


def _settings_of(request_or_scope: Any) -> Any:
    app = getattr(request_or_scope, "app", None)
    if app is None and isinstance(request_or_scope, dict):
        app = request_or_scope.get("app")
    state = getattr(getattr(app, "state", None), "memlm", None)
    return getattr(state, "settings", None)


async def overload_pause(request_or_scope: Any, exc: Overloaded) -> None:
    """Hold a 429 for ``MEMLM_OVERLOAD_DELAY_SECONDS`` (at most its Retry-After).

    Clients that ignore Retry-After and retry at once would otherwise keep the event loop
    busy answering refusals, starving the requests it accepted.
    """
    delay = getattr(_settings_of(request_or_scope), "overload_delay_seconds", 0.0)
    if delay > 0:
        await _sleep(min(float(delay), float(exc.retry_after)))


def allowed_methods(request: Request) -> str | None:
    """The methods the OpenAPI documents for this path, for a 405's Allow header.

    Starlette's 405 names only the methods of the first route whose path matched: PUT
    /admin/policy's neighbour GET answered OPTIONS with ``Allow: GET``. None: a path the
    OpenAPI does not list (the dashboard's pages), left to Starlette.
    """
    path = request.url.path
    for template, operations in request.app.openapi()["paths"].items():
        if re.fullmatch(re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)), path):
            return ", ".join(sorted(method.upper() for method in operations))
    return None


def unavailable_response(request_or_scope: Any, reason: str) -> JSONResponse:
    """503 with the reason a dependency is away and when to come back."""
    retry = getattr(_settings_of(request_or_scope), "retry_after_seconds", 1)
    return error_response(
        503, "unavailable", reason, {"Retry-After": str(retry)}, where=request_or_scope
    )


def install_error_handlers(app: FastAPI) -> None:
    async def domain(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DomainError)
        headers = None
        if isinstance(exc, Overloaded):
            headers = {"Retry-After": str(exc.retry_after)}
            await overload_pause(request, exc)
        elif isinstance(exc, Unauthorized):
            headers = {"WWW-Authenticate": "Bearer"}
        elif isinstance(exc, Unavailable):
            return unavailable_response(request, str(exc))
        return error_response(
            exc.status_code,
            exc.error,
            str(exc),
            headers,
            where=request,
            param=getattr(exc, "param", None),
        )

    async def dependency(request: Request, exc: Exception) -> JSONResponse:
        # The database, the memory server or the disk is away: a passing state, answered
        # 503 with the reason (never 500); other errors of these types are bugs.
        reason = unavailable(exc)
        if reason is None:
            return await unexpected(request, exc)
        log.warning("%s %s: %s (%s)", request.method, request.url.path, reason, exc)
        return unavailable_response(request, reason)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(
            422,
            "validation_error",
            _validation_detail(exc),
            where=request,
            param=_validation_param(exc),
        )

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        name = _HTTP_NAMES.get(exc.status_code, "error")
        detail = exc.detail if isinstance(exc.detail, str) else name
        headers = getattr(exc, "headers", None)
        allow = allowed_methods(request) if exc.status_code == 405 else None
        if allow is not None:
            headers = {**(headers or {}), "Allow": allow}
        return error_response(exc.status_code, name, detail, headers, where=request)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal_error", "internal server error", where=request)

    async def value_error(request: Request, exc: Exception) -> JSONResponse:
        # The engine says "this text cannot be used" with EngineInputError; other
        # ValueErrors are bugs. Imported here: by the time one is raised, it is loaded.
        from memlm.engine import EngineInputError

        if isinstance(exc, EngineInputError):
            return error_response(422, "invalid_input", str(exc), where=request)
        return await unexpected(request, exc)

    app.add_exception_handler(DomainError, domain)
    for kind in (DBAPIError, MemoryUnavailable, OSError):
        app.add_exception_handler(kind, dependency)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(Exception, unexpected)
