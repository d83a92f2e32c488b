"""The body of ``GET /admin/stats/history``: the dashboard's time series, all read from
the database and the data directory (nothing is sampled in memory or estimated)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, Field

from memlm.api.admin import StatsResponse


class DayPoint(BaseModel):
    """One stream day (publication date), every policy's documents together."""

    day: dt.date
    policies: list[str]
    documents: int
    tokens_seen: int
    tokens_stored: int
    entries_forgotten: int
    memrate: float = Field(description="tokens stored / seen on this day (FullMem: 1)")
    cumulative_memrate: float = Field(description="stored / seen, this day and every earlier")
    cumulative_entries: int = Field(
        description="entries of this day's and earlier days' documents still in the memory"
    )


class MemoryPoint(BaseModel):
    """The memory's size at one moment: after a finished build, or now."""

    at: dt.datetime
    label: str = Field(description="'index v3' (a build) or 'now' (the engine's figures)")
    entries: int
    bytes_on_disk: int | None = Field(
        default=None, description="null: a build recorded before sizes were"
    )
    bytes_in_ram: int | None = None


class ThroughputPoint(BaseModel):
    """One time bucket; each document's tokens are spread over its claim-to-done time."""

    start: dt.datetime = Field(description="start of the bucket")
    documents: int = Field(description="documents that finished in the bucket")
    tokens: float = Field(description="tokens processed in the bucket")
    busy_seconds: float = Field(description="seconds of processing in the bucket, all workers")
    tokens_per_s: float | None = Field(description="tokens / busy seconds: one worker's speed")
    throughput: float = Field(description="tokens / bucket seconds: all workers together")


class Throughput(BaseModel):
    bucket_seconds: float
    documents: int = Field(description="done documents considered (the newest ones)")
    points: list[ThroughputPoint]


class Queue(BaseModel):
    counts: dict[str, int] = Field(description="documents per status (every status listed)")
    waiting_retry: int = Field(description="pending documents waiting for their retry time")


class FailedDocument(BaseModel):
    id: int
    source: str
    external_id: str | None
    title: str
    published_at: dt.date
    attempts: int
    error: str | None
    failed_at: dt.datetime | None


class Failed(BaseModel):
    total: int
    documents: list[FailedDocument] = Field(description="the newest failures first")


class BuildRow(BaseModel):
    id: int
    version: str | None
    status: str
    requested_by: str
    requested_at: dt.datetime | None
    finished_at: dt.datetime | None
    seconds: float | None
    entries: int | None
    error: str | None
    calibrator: str | None = Field(
        description="what the calibrator training at this build did, or why it did not train"
    )
    interpolation: dict[str, Any] | None
    sizes: dict[str, Any] | None
    consolidation: dict[str, Any] | None = Field(
        None, description="what the consolidation before the build retired, per reason"
    )


class HeldOutDay(BaseModel):
    day: dt.date
    tokens: int
    tokens_with_neighbours: int
    lm_ppl: float
    augmented_ppl: float
    # the same tokens asked again once their document joined the memory (what a user who
    # asks about what they ingested gets); recorded since the evidence interpolation
    seen_tokens: int = 0
    seen_lm_ppl: float | None = None
    seen_augmented_ppl: float | None = None


class HeldOut(BaseModel):
    """Perplexity of the held-out tokens the worker recorded, per stream day.

    Each token was searched against the memory served when its document arrived (before
    the document's own entries joined it); the augmented figure mixes those neighbours
    with the interpolation served now.
    """

    tokens: int
    recording: bool = Field(description="the worker records held-out tokens")
    interpolation: dict[str, Any] | None = Field(
        default=None, description="k, temperature, lambda and lambda_source used for augmented_ppl"
    )
    note: str | None = Field(default=None, description="why there is nothing to show, when empty")
    days: list[HeldOutDay]


class DashboardData(BaseModel):
    generated_at: dt.datetime
    refresh_seconds: float
    model: str = Field(description="ready, loading or failed")
    stats: StatsResponse | None = Field(description="/admin/stats (null while the model loads)")
    days: list[DayPoint]
    memory: list[MemoryPoint]
    throughput: Throughput
    queue: Queue
    failed: Failed
    builds: list[BuildRow] = Field(description="the newest builds first")
    heldout: HeldOut
