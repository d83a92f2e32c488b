"""Admin routes (admin bearer token): stats, rebuild, policy, forget, retry."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import APIRouter, status
from starlette.concurrency import run_in_threadpool

from memlm.api import (
    BuildOut,
    DocumentOut,
    PolicyIn,
    PolicyOut,
    RebuildRequest,
    StatsResponse,
    policy_params,
)
from memlm.db.models import IndexBuild
from memlm.db.repositories import BuildRepository, DocumentRepository, PolicyRepository
from service.deps import AdminAuth, DbSession, EngineDep, RowId, State, after_commit
from service.errors import error_responses
from service.routes.documents import document_out
from service.stats import policy_out, read_db, summarise

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[AdminAuth], responses=error_responses(401, 503)
)


def build_out(b: IndexBuild) -> BuildOut:
    names = ("id", "request_key", "requested_by", "status", "version", "entries", "seconds")
    times = ("requested_at", "started_at", "finished_at")
    data = {n: getattr(b, n) for n in (*names, *times, "error")}
    params = dict(b.params or {})
    data["calibrator"] = params.pop("calibrator", None)
    data["interpolation"] = params.pop("interpolation", None)
    data["sizes"] = params.pop("sizes", None)
    data["consolidation"] = params.pop("consolidation", None)
    data["params"] = params or None
    return BuildOut.model_validate(data)


@router.get(
    "/stats",
    response_model=StatsResponse,
    responses=error_responses(429, 503),
    summary="MemRate, entries, index, documents",
)
async def stats(state: State, engine: EngineDep) -> StatsResponse:
    def db() -> dict[str, object]:
        with state.sessions.begin() as s:
            return read_db(s, state.settings)

    # Database first: entries the worker adds in between show up in the engine figures
    # only, never counted in the database and missing from the memory.
    db_part = await run_in_threadpool(db)
    engine_stats = await state.executor.call(engine.stats)
    # what the engine serves now: with the embedded worker its builds swap the index in
    # this process before the next poll updates ``state.served_version``
    version = engine_stats.get("index_version", state.served_version)
    return summarise(db_part, engine_stats, None if version is None else str(version))


@router.post(
    "/rebuild",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=BuildOut,
    responses=error_responses(400, 413, 422),
    summary="Request an index build (idempotent)",
)
def rebuild(session: DbSession, body: RebuildRequest | None = None) -> BuildOut:
    row, _ = BuildRepository(session).request(
        body.key if body else None, requested_by="api", retrain=bool(body and body.retrain)
    )
    return build_out(row)


@router.get(
    "/builds/{build_id}",
    response_model=BuildOut,
    responses=error_responses(404, 422),
    summary="An index build's status",
)
def get_build(build_id: RowId, session: DbSession) -> BuildOut:
    return build_out(BuildRepository(session).get(build_id))


@router.get("/policy", response_model=PolicyOut, summary="The active memorisation policy")
def get_policy(state: State, session: DbSession) -> PolicyOut:
    repo = PolicyRepository(session)
    return policy_out(
        repo.get(default_policy=state.settings.policy, default_delta=state.settings.delta)
    )


@router.put(
    "/policy",
    response_model=PolicyOut,
    responses=error_responses(400, 413, 422),
    summary="Change the policy for new documents",
)
def put_policy(body: PolicyIn, session: DbSession) -> PolicyOut:
    params = policy_params(body)
    return policy_out(PolicyRepository(session).set(body.policy, body.delta, params))


@router.delete(
    "/documents/{doc_id}",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=DocumentOut,
    responses=error_responses(400, 404, 409, 413, 422),
    summary="Forget a document: its entries leave the memory",
)
def forget(doc_id: RowId, session: DbSession, state: State) -> DocumentOut:
    """A done or processing document becomes ``forgetting`` until the worker deletes its
    entries; this process stops serving them at once (others at their next index sync)."""
    doc = DocumentRepository(session).request_forget(doc_id)
    engine = state.engine  # None while the model loads: the index sync hides it then
    if engine is not None and doc.status == "forgetting":
        hide = engine.hide_documents
        # Only once "forgetting" is committed: on Milvus hiding deletes the entries, and a
        # failed commit would leave a done document without them. Committed first, a
        # failure anywhere after leaves a forget that the worker (and every API process's
        # index sync) completes.
        after_commit(session, lambda: _hide(hide, doc_id))
    return document_out(doc)


def _hide(hide: Callable[[list[int]], object], doc_id: int) -> None:
    try:
        hide([doc_id])
    except Exception:  # the forget is committed: the index sync and the worker finish it
        log.exception("could not hide document %d now; the next index sync will", doc_id)


@router.post(
    "/documents/{doc_id}/retry",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=DocumentOut,
    responses=error_responses(400, 404, 409, 413, 422),
    summary="Queue a failed document again",
)
def retry(doc_id: RowId, session: DbSession) -> DocumentOut:
    """A failed document goes back to ``pending`` with its tries counted from zero;
    404 when it does not exist, 409 when it is not failed."""
    return document_out(DocumentRepository(session).requeue_failed(doc_id))
