"""Bodies of ingest, documents and forget (`/ingest`, `/documents/{id}`)."""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from memlm.api.common import (
    TEXT_PATTERN,
    DocumentStatus,
    StoredJson,  # noqa: F401 - StoredObject's recursive alias resolves it by name here
    StoredObject,
    Strict,
    check_storable,
    no_nul,
)

# --- ingest -----------------------------------------------------------------------------


# RFC 3339 full-date, or date-time (JSON Schema's "date" and "date-time" formats).
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})"
    r"(?:[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.[0-9]+)?(?:[Zz]|[+-]([0-9]{2}):([0-9]{2})))?"
)


def _published_day(v: Any) -> Any:
    """The date of an RFC 3339 date or date-time string (as written, whatever the offset)."""
    if isinstance(v, dt.datetime):  # Python callers (memlm.client)
        return v.date()
    if not isinstance(v, str):
        return v  # a date passes; anything else is refused by the strict date
    m = _RFC3339.fullmatch(v)
    try:
        if m is None:
            raise ValueError
        day = dt.date.fromisoformat(m[1])
        hour, minute, second, off_h, off_m = (int(x or 0) for x in m.groups()[1:])
        if hour > 23 or minute > 59 or second > 59 or off_h > 23 or off_m > 59:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"published_at {v!r} is not an ISO date (2017-02-07) or date-time "
            "(2017-02-07T10:00:00Z, with its offset)"
        ) from None
    return day


PublishedAt = Annotated[
    dt.date,
    BeforeValidator(_published_day),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "format": "date"},
                {"type": "string", "format": "date-time"},
            ],
            "description": "the day (a date-time counts as the date written in it)",
        }
    ),
]


class DocumentIn(Strict):
    model_config = ConfigDict(json_schema_extra=no_nul("source", "external_id", "title"))

    text: str = Field(
        min_length=1,
        examples=["The central bank raised its key rate on Tuesday."],
        json_schema_extra={"pattern": TEXT_PATTERN},
    )
    published_at: PublishedAt = Field(examples=["2017-02-07"])
    source: str = Field(min_length=1, max_length=200, examples=["www.bbc.com"])
    external_id: str | None = Field(None, min_length=1, max_length=200, examples=["bbc-123"])
    title: str = Field("", max_length=1000, examples=["Rates rise again"])
    metadata: StoredObject = Field(default_factory=dict)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("text is empty")
        return v

    @field_validator("text", "source", "external_id", "title", "metadata")
    @classmethod
    def _storable(cls, v: Any, info: ValidationInfo) -> Any:
        check_storable(v, str(info.field_name))
        return v


class IngestRequest(Strict):
    documents: list[DocumentIn] = Field(min_length=1)

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "documents": [
                        {
                            "text": "The central bank raised its key rate on Tuesday.",
                            "published_at": "2017-02-07",
                            "source": "www.bbc.com",
                            "external_id": "bbc-123",
                            "title": "Rates rise again",
                        }
                    ]
                }
            ]
        },
    )


class AcceptedDocument(BaseModel):
    id: int
    status: DocumentStatus
    duplicate: bool = False


class IngestResponse(BaseModel):
    documents: list[AcceptedDocument]


class DocumentOut(BaseModel):
    id: int
    status: DocumentStatus
    source: str
    external_id: str | None
    title: str
    published_at: dt.date
    metadata: dict[str, Any]
    created_at: dt.datetime | None
    processed_at: dt.datetime | None
    error: str | None
    policy: str | None
    tokens_seen: int | None
    tokens_stored: int | None
    entry_start: int | None
    entry_end: int | None
    attempts: int = Field(0, description="failed tries so far (a passing error is retried)")
    retry_at: dt.datetime | None = Field(
        None, description="a pending document retried after a failure waits until then"
    )
