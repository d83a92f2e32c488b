"""POST /ingest and GET /documents/{id}: accept documents; the worker does the rest."""

from __future__ import annotations

from fastapi import APIRouter, status

from memlm.api import AcceptedDocument, DocumentOut, IngestRequest, IngestResponse
from memlm.db.models import Document
from memlm.db.repositories import DocumentRepository, NewDocument
from service.deps import DbSession, IngestAuth, RowId, State
from service.errors import PayloadTooLarge, error_responses

router = APIRouter(tags=["documents"])


@router.post(
    "/ingest",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=IngestResponse,
    dependencies=[IngestAuth],
    responses=error_responses(400, 401, 413, 422, 503),
    summary="Queue documents for memorisation",
)
def ingest(body: IngestRequest, session: DbSession, state: State) -> IngestResponse:
    """Store documents as pending, deduplicated by (source, external_id) and content hash."""
    s = state.settings
    if len(body.documents) > s.max_documents_per_request:
        raise PayloadTooLarge(
            f"{len(body.documents)} documents in one request; at most "
            f"{s.max_documents_per_request} are accepted"
        )
    for i, d in enumerate(body.documents):
        if len(d.text) > s.max_text_chars:
            raise PayloadTooLarge(
                f"documents.{i}.text has {len(d.text)} characters; at most {s.max_text_chars}"
            )
    accepted = DocumentRepository(session).add_many(
        NewDocument(
            text=d.text,
            published_at=d.published_at,
            source=d.source,
            external_id=d.external_id,
            title=d.title,
            metadata=d.metadata,
        )
        for d in body.documents
    )
    return IngestResponse(
        documents=[
            AcceptedDocument.model_validate(
                {"id": a.id, "status": a.status, "duplicate": a.duplicate}
            )
            for a in accepted
        ]
    )


def document_out(d: Document) -> DocumentOut:
    fields = ("id", "status", "source", "external_id", "title", "published_at", "created_at")
    more = ("processed_at", "error", "policy", "tokens_seen", "tokens_stored")
    tries = ("attempts", "retry_at")
    data = {name: getattr(d, name) for name in (*fields, *more, "entry_start", "entry_end", *tries)}
    return DocumentOut.model_validate({**data, "metadata": d.meta})


@router.get(
    "/documents/{doc_id}",
    response_model=DocumentOut,
    dependencies=[IngestAuth],  # ids are sequential: open, it would list every document
    responses=error_responses(401, 404, 422, 503),
    summary="A document's status and what was stored",
)
def get_document(doc_id: RowId, session: DbSession) -> DocumentOut:
    return document_out(DocumentRepository(session).get(doc_id))
