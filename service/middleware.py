"""ASGI middleware: body size limit and strict UTF-8 for JSON bodies, request metrics, and
the last line of defence that answers an unexpected exception with a normal 500."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import Overloaded, overload_pause, shaped_error
from service.metrics import Metrics

log = logging.getLogger(__name__)


async def _send_error(
    scope: Scope,
    send: Send,
    status: int,
    error: str,
    detail: str,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    status, shaped = shaped_error(scope, status, error, detail)
    body = json.dumps(shaped).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """Reject bodies over ``max_bytes`` (413) and JSON bodies that are not UTF-8 (400).

    The body is read once here (it is bounded) and replayed to the app.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"the body exceeds {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(scope, send, 413, "payload_too_large", too_big)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(scope, send, 413, "payload_too_large", too_big)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if b"json" in headers.get(b"content-type", b"json"):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                await _send_error(
                    scope, send, 400, "bad_request", f"the body is not valid UTF-8 (byte {e.start})"
                )
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _recording_status(send: Send) -> tuple[dict[str, int], Send]:
    """``send`` that also records the response's status (500 until one starts)."""
    status = {"code": 500}

    async def send_wrapper(message: Message) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]
        await send(message)

    return status, send_wrapper


class RequestMetrics:
    """Observe the latency of every request under its route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, send_wrapper = _recording_status(send)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(
                scope["method"], path, status["code"], time.perf_counter() - t0
            )


class RequestSlots:
    """Hold one of the model executor's request slots for each model request (429 if refused).

    A middleware rather than a dependency, and outside ``BodyGuard`` (``create_app``):
    a refused request is answered before a byte of its body is read, and the slot covers
    the whole request (reading the body, validation, the response), which is where
    requests wait when the event loop, not the model, is the bottleneck.
    """

    def __init__(
        self,
        app: ASGIApp,
        paths: tuple[str, ...] = (
            "/predict",
            "/score",
            "/generate",
            "/v1/completions",
            "/v1/chat/completions",
        ),
    ) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "memlm", None) if "app" in scope else None
        if scope["type"] != "http" or scope["path"] not in self.paths or state is None:
            await self.app(scope, receive, send)
            return
        executor = state.executor
        try:
            executor.enter_request()
        except Overloaded as exc:
            await overload_pause(scope, exc)
            extra = ((b"retry-after", str(exc.retry_after).encode()),)
            await _send_error(scope, send, 429, exc.error, str(exc), extra)
            return
        status, send_wrapper = _recording_status(send)

        served = False
        try:
            await self.app(scope, receive, send_wrapper)
            served = status["code"] < 400
        finally:
            executor.leave_request(served)


class CatchAll:
    """Answer an exception no handler took with the generic 500 body, and stop it here.

    Starlette's ``ServerErrorMiddleware`` (where an ``Exception`` handler lands) sends the
    500 and then re-raises, and uvicorn closes the connection of a request whose app
    raised: the client's next request on that keep-alive connection failed too. Here the
    exception ends as a complete response. Once a response has started it cannot become
    a 500, so it is re-raised and the server cuts the truncated response off.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            await _send_error(scope, send, 500, "internal_error", "internal server error")
