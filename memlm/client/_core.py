"""What the sync and the async client share: requests, answers, batching and retries.

Each call is a :class:`Call` (method, path, body, the pydantic model of the answer); the
two clients only differ in how they send it and how they sleep between retries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from pydantic import TypeAdapter

from memlm.api import DocumentIn, GenerateDone, GeneratedTokenOut
from memlm.client.errors import MemlmError, Overloaded, TransportError, error_for

M = TypeVar("M")

# Documents per POST /ingest: well under the server's default of 256 per request and
# its 8 MiB body, and few enough that one 429 delays little.
BATCH = 64
# Retries of one request refused with 429 (each waits its Retry-After) or cut off before
# an answer; ingest is idempotent (the server deduplicates by external id and content).
RETRIES = 8
MAX_WAIT_S = 60.0  # the longest pause between two tries, whatever Retry-After says
# Statuses a document leaves only by an operator's action.
FINAL = {"done", "failed", "forgotten"}


@dataclass(frozen=True)
class Call(Generic[M]):
    method: str
    path: str
    body: dict[str, Any] | None
    model: Any  # a pydantic model or TypeAdapter target for the answer

    def parse(self, response: httpx.Response) -> M:
        """The answer as the model, or the typed error of an error status."""
        if response.status_code >= 400:
            raise error_of(response)
        value: M = TypeAdapter(self.model).validate_json(response.content)
        return value


def error_of(response: httpx.Response) -> MemlmError:
    try:
        body: Any = response.json()
    except ValueError:
        body = {"error": "error", "detail": response.text[:500]}
    return error_for(response.status_code, body, response.headers.get("Retry-After"))


def options(**kw: Any) -> dict[str, Any]:
    """The request's options without those left at None (the server's defaults apply)."""
    return {k: v for k, v in kw.items() if v is not None}


def documents(docs: Iterable[DocumentIn | dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each document validated here, with the API's own model, as its JSON body."""
    for d in docs:
        model = d if isinstance(d, DocumentIn) else DocumentIn.model_validate(d)
        yield model.model_dump(mode="json", exclude_none=True)


def batches(items: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def pause(error: MemlmError, attempt: int) -> float | None:
    """Seconds to wait before trying again after ``error``, or None to give up."""
    if attempt >= RETRIES:
        return None
    if isinstance(error, Overloaded):
        return min(MAX_WAIT_S, max(0.0, error.retry_after))
    if isinstance(error, TransportError):
        return min(MAX_WAIT_S, 0.5 * 2**attempt)
    return None


def transport_error(exc: httpx.TransportError) -> TransportError:
    return TransportError(0, "transport_error", f"{type(exc).__name__}: {exc}")


def sse_event(name: str, data: str) -> GeneratedTokenOut | GenerateDone:
    """One event of a /generate stream as its model; an ``error`` event raises."""
    if name == "token":
        return GeneratedTokenOut.model_validate_json(data)
    if name == "done":
        return GenerateDone.model_validate_json(data)
    if name == "error":
        body = json.loads(data)
        raise error_for(500, body)
    raise MemlmError(0, "bad_stream", f"unexpected event {name!r} in a /generate stream")
