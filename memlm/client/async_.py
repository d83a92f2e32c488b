"""The asyncio client: ``AsyncClient(url, token=...)`` over ``httpx.AsyncClient``; the same
methods as :class:`memlm.client.Client`, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import httpx
from httpx_sse import aconnect_sse

from memlm.api import (
    AcceptedDocument,
    BuildOut,
    DocumentIn,
    DocumentOut,
    GenerateDone,
    GeneratedTokenOut,
    GenerateResponse,
    IngestResponse,
    PolicyOut,
    PredictResponse,
    ScoreResponse,
    StatsResponse,
)
from memlm.client import _core
from memlm.client._core import Call
from memlm.client.errors import MemlmError

M = TypeVar("M")


class AsyncClient:
    """The memlm API from asyncio code; answers are the API's own pydantic models.

    ``http``: an ``httpx.AsyncClient`` to use instead of one of its own (tests give one on
    ``httpx.ASGITransport``; the caller closes it);
    ``sleep``: how retries wait (tests record it).
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = 60.0,
        http: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        # sent with each request: a shared ``http`` client is left as it was given
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = http if http is not None else httpx.AsyncClient(base_url=url, timeout=timeout)
        self._owns_http = http is None
        self.sleep = sleep

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    # --- sending ----------------------------------------------------------------------

    async def _call(self, call: Call[M], *, retry: bool = False) -> M:
        """Send ``call``; with ``retry``, again after a 429 (its Retry-After) or a cut."""
        attempt = 0
        while True:
            try:
                response = await self.http.request(
                    call.method, call.path, json=call.body, headers=self.headers
                )
                return call.parse(response)
            except httpx.TransportError as exc:
                error: MemlmError = _core.transport_error(exc)
            except MemlmError as exc:
                error = exc
            wait = _core.pause(error, attempt) if retry else None
            if wait is None:
                raise error
            await self.sleep(wait)
            attempt += 1

    # --- documents --------------------------------------------------------------------

    async def ingest(
        self,
        docs: Iterable[DocumentIn | dict[str, Any]],
        *,
        batch_size: int = _core.BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> list[AcceptedDocument]:
        """Queue documents (batched; each batch retried on 429 and on a broken connection,
        which is safe: the server deduplicates by (source, external_id) and by content).

        ``progress(n)`` is called after each batch with the documents it held.
        """
        out: list[AcceptedDocument] = []
        for batch in _core.batches(_core.documents(docs), batch_size):
            call: Call[IngestResponse] = Call(
                "POST", "/ingest", {"documents": batch}, IngestResponse
            )
            out.extend((await self._call(call, retry=True)).documents)
            if progress is not None:
                progress(len(batch))
        return out

    async def document(self, doc_id: int) -> DocumentOut:
        return await self._call(Call("GET", f"/documents/{doc_id}", None, DocumentOut))

    async def wait(
        self, doc_ids: Sequence[int], *, timeout: float = 600.0, poll: float = 0.5
    ) -> list[DocumentOut]:
        """Poll until every document is done, failed or forgotten; TimeoutError if not."""
        deadline = time.monotonic() + timeout
        final: dict[int, DocumentOut] = {}
        while True:
            for i in doc_ids:
                if i not in final:
                    d = await self.document(i)
                    if d.status in _core.FINAL:
                        final[i] = d
            if len(final) == len(set(doc_ids)):
                return [final[i] for i in doc_ids]
            if time.monotonic() >= deadline:
                left = sorted(set(doc_ids) - set(final))
                raise TimeoutError(f"documents {left} not processed within {timeout} s")
            await self.sleep(poll)

    # --- inference --------------------------------------------------------------------

    async def predict(self, context: str, **opts: Any) -> PredictResponse:
        """``POST /predict``; ``opts``: top_n, neighbours, words, local_memory..."""
        body = {"context": context, **_core.options(**opts)}
        return await self._call(Call("POST", "/predict", body, PredictResponse))

    async def score(self, text: str, **opts: Any) -> ScoreResponse:
        body = {"text": text, **_core.options(**opts)}
        return await self._call(Call("POST", "/score", body, ScoreResponse))

    async def generate(self, context: str, **opts: Any) -> GenerateResponse:
        """``POST /generate``; ``opts``: max_tokens, temperature, top_p, seed, stop, neighbour."""
        body = {"context": context, **_core.options(**opts), "stream": False}
        return await self._call(Call("POST", "/generate", body, GenerateResponse))

    async def generate_stream(
        self, context: str, **opts: Any
    ) -> AsyncIterator[GeneratedTokenOut | GenerateDone]:
        """``POST /generate`` as server-sent events: each token as it comes, then the
        GenerateDone; an error before the stream or an ``error`` event raises."""
        body = {"context": context, **_core.options(**opts), "stream": True}
        try:
            async with aconnect_sse(
                self.http, "POST", "/generate", json=body, headers=self.headers
            ) as source:
                if source.response.status_code >= 400:
                    await source.response.aread()
                    raise _core.error_of(source.response)
                async for event in source.aiter_sse():
                    yield _core.sse_event(event.event, event.data)
        except httpx.TransportError as exc:
            raise _core.transport_error(exc) from exc

    # --- admin ------------------------------------------------------------------------

    async def stats(self) -> StatsResponse:
        return await self._call(Call("GET", "/admin/stats", None, StatsResponse))

    async def rebuild(
        self, key: str | None = None, *, wait: bool = False, timeout: float = 3600.0
    ) -> BuildOut:
        """Request an index build (idempotent by ``key``); ``wait``: until it finished."""
        call: Call[BuildOut] = Call("POST", "/admin/rebuild", _core.options(key=key), BuildOut)
        build = await self._call(call)
        deadline = time.monotonic() + timeout
        while wait and build.status not in ("done", "failed"):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"build {build.id} not finished within {timeout} s")
            await self.sleep(1.0)
            build = await self.build(build.id)
        return build

    async def build(self, build_id: int) -> BuildOut:
        return await self._call(Call("GET", f"/admin/builds/{build_id}", None, BuildOut))

    async def forget(self, doc_id: int) -> DocumentOut:
        """Forget a document: its entries leave the memory (``DELETE /admin/documents``)."""
        return await self._call(Call("DELETE", f"/admin/documents/{doc_id}", None, DocumentOut))

    async def policy(
        self,
        policy: str | None = None,
        *,
        delta: float | None = None,
        params: dict[str, Any] | None = None,
    ) -> PolicyOut:
        """The active memorisation policy; with ``policy``, set it first."""
        if policy is None:
            return await self._call(Call("GET", "/admin/policy", None, PolicyOut))
        body = {"policy": policy, "delta": delta, "params": params or {}}
        return await self._call(Call("PUT", "/admin/policy", body, PolicyOut))
