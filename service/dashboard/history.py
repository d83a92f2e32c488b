"""The dashboard's time series, read from the database in one session.

* stream days: the ``day_stats`` counters (MemRate per day and cumulative, live entries);
* memory size: every finished build's entries and sizes (``index_builds``), then now;
* worker speed: the newest done documents' tokens over their claim-to-done time;
* queue and failures: ``documents`` by status, the failed ones with their reasons;
* builds: times, entries, and what the calibrator training did at each.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from memlm.api.dashboard import (
    BuildRow,
    DayPoint,
    Failed,
    FailedDocument,
    MemoryPoint,
    Queue,
    Throughput,
    ThroughputPoint,
)
from memlm.db.models import DOCUMENT_STATUSES, DayStat, Document, IndexBuild

BUILDS_SHOWN = 50
FAILED_SHOWN = 50
# The speed chart reads the newest this many done documents.
THROUGHPUT_DOCUMENTS = 5000
THROUGHPUT_BUCKETS = 48
# Bucket widths in seconds: the smallest that keeps the chart within THROUGHPUT_BUCKETS.
_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def read(s: Session, now: dt.datetime) -> dict[str, Any]:
    """Everything the history needs from the database (plain values, detached)."""
    docs = Document
    counts = dict(s.execute(select(docs.status, func.count()).group_by(docs.status)).all())
    waiting = s.scalar(select(func.count()).where(docs.status == "pending", docs.retry_at > now))
    failed_q = (
        select(
            docs.id,
            docs.source,
            docs.external_id,
            docs.title,
            docs.published_at,
            docs.attempts,
            docs.error,
            docs.processed_at,
        )
        .where(docs.status == "failed")
        .order_by(docs.processed_at.desc(), docs.id.desc())
        .limit(FAILED_SHOWN)
    )
    timing_q = (
        select(docs.claimed_at, docs.processed_at, docs.tokens_seen)
        .where(
            docs.status.in_(("done", "forgetting", "forgotten")),
            docs.claimed_at.is_not(None),
            docs.processed_at.is_not(None),
        )
        .order_by(docs.processed_at.desc())
        .limit(THROUGHPUT_DOCUMENTS)
    )
    builds = s.scalars(select(IndexBuild).order_by(IndexBuild.id.desc()).limit(BUILDS_SHOWN))
    return {
        "day_stats": [
            (r.day, r.policy, r.documents, r.tokens_seen, r.tokens_stored, r.entries_forgotten)
            for r in s.scalars(select(DayStat).order_by(DayStat.day, DayStat.policy))
        ],
        "counts": {k: int(v) for k, v in counts.items()},
        "waiting_retry": int(waiting or 0),
        "failed_total": int(counts.get("failed", 0)),
        "failed": [tuple(r) for r in s.execute(failed_q)],
        "timing": [tuple(r) for r in s.execute(timing_q)],
        "builds": [_build_values(b) for b in builds],
    }


def _build_values(b: IndexBuild) -> dict[str, Any]:
    names = ("id", "version", "status", "requested_by", "requested_at", "finished_at")
    out = {n: getattr(b, n) for n in (*names, "seconds", "entries", "error")}
    out["params"] = dict(b.params or {})
    return out


def _rate(stored: int, seen: int) -> float:
    return stored / seen if seen else 0.0


def days(rows: Sequence[tuple[Any, ...]]) -> list[DayPoint]:
    """Per stream day, the policies' counters added up; cumulative figures in day order."""
    by_day: dict[dt.date, list[Any]] = {}
    for day, policy, documents, seen, stored, forgotten in rows:
        acc = by_day.setdefault(day, [[], 0, 0, 0, 0])
        acc[0].append(policy)
        acc[1] += documents
        acc[2] += seen
        acc[3] += stored
        acc[4] += forgotten
    out, seen_c, stored_c, live_c = [], 0, 0, 0
    for day in sorted(by_day):
        policies, documents, seen, stored, forgotten = by_day[day]
        seen_c += seen
        stored_c += stored
        live_c += stored - forgotten
        out.append(
            DayPoint(
                day=day,
                policies=sorted(policies),
                documents=documents,
                tokens_seen=seen,
                tokens_stored=stored,
                entries_forgotten=forgotten,
                memrate=_rate(stored, seen),
                cumulative_memrate=_rate(stored_c, seen_c),
                cumulative_entries=live_c,
            )
        )
    return out


def memory(
    builds: Sequence[dict[str, Any]], engine_stats: dict[str, Any] | None, now: dt.datetime
) -> list[MemoryPoint]:
    """The finished builds in time order (their entries and recorded sizes), then now."""
    out = []
    for b in sorted(
        (b for b in builds if b["status"] == "done" and b["finished_at"] is not None),
        key=lambda b: (b["finished_at"], b["id"]),
    ):
        sizes = b["params"].get("sizes") or {}
        out.append(
            MemoryPoint(
                at=b["finished_at"],
                label=f"index v{b['version']}",
                entries=int(b["entries"] or 0),
                bytes_on_disk=sizes.get("bytes_on_disk"),
                bytes_in_ram=sizes.get("bytes_in_ram"),
            )
        )
    if engine_stats is not None:
        out.append(
            MemoryPoint(
                at=now,
                label="now",
                entries=int(engine_stats["entries"]),
                bytes_on_disk=engine_stats.get("bytes_on_disk"),
                bytes_in_ram=engine_stats.get("bytes_in_ram"),
            )
        )
    return out


def throughput(timing: Sequence[tuple[Any, ...]]) -> Throughput:
    """Tokens per second of ingest in time buckets.

    Each document's tokens are spread evenly over its claim-to-done interval, so a bucket
    gets the share processed inside it: ``throughput`` (tokens / bucket seconds, all
    workers together) is what the workers did in that bucket, and ``tokens_per_s``
    (tokens / busy seconds) is one worker's speed while it works. ``documents``: those
    that finished in the bucket.
    """
    pairs = [(c, max(p, c), int(n or 0)) for c, p, n in timing if c is not None and p is not None]
    if not pairs:
        return Throughput(bucket_seconds=0, documents=0, points=[])
    first = min(c for c, _, _ in pairs)
    span = max((max(p for _, p, _ in pairs) - first).total_seconds(), 1e-9)
    width = next((w for w in _WIDTHS if span / w < THROUGHPUT_BUCKETS), None)
    if width is None:
        width = _WIDTHS[-1] * math.ceil(span / _WIDTHS[-1] / THROUGHPUT_BUCKETS)
    # seconds from a bucket boundary (a multiple of the width since the epoch) just before
    # the first claim: small numbers, exact to the microsecond the database keeps
    origin = dt.datetime.fromtimestamp(first.timestamp() // width * width, dt.UTC)
    rows = [((c - origin).total_seconds(), (p - origin).total_seconds(), n) for c, p, n in pairs]
    buckets: dict[int, list[float]] = {}  # bucket -> [documents, tokens, busy seconds]
    for claimed, processed, n in rows:
        end_b = int(processed // width)
        buckets.setdefault(end_b, [0, 0.0, 0.0])[0] += 1
        if processed == claimed:  # no measurable time: all of it where it finished
            buckets[end_b][1] += n
            continue
        rate = n / (processed - claimed)
        for b in range(int(claimed // width), end_b + 1):
            lo, hi = max(claimed, b * width), min(processed, (b + 1) * width)
            if hi > lo or b == end_b:
                acc = buckets.setdefault(b, [0, 0.0, 0.0])
                acc[1] += rate * (hi - lo)
                acc[2] += hi - lo
    points = [
        ThroughputPoint(
            start=origin + dt.timedelta(seconds=b * width),
            documents=int(d),
            tokens=t,
            busy_seconds=busy,
            tokens_per_s=t / busy if busy > 0 else None,
            throughput=t / width,
        )
        for b, (d, t, busy) in sorted(buckets.items())
    ]
    return Throughput(bucket_seconds=float(width), documents=len(rows), points=points)


def queue(counts: dict[str, int], waiting_retry: int) -> Queue:
    return Queue(
        counts={s: int(counts.get(s, 0)) for s in DOCUMENT_STATUSES}, waiting_retry=waiting_retry
    )


def failed(total: int, rows: Sequence[tuple[Any, ...]]) -> Failed:
    names = ("id", "source", "external_id", "title", "published_at", "attempts", "error")
    docs = [FailedDocument(**dict(zip(names, r[:7], strict=True)), failed_at=r[7]) for r in rows]
    return Failed(total=total, documents=docs)


def calibrator_summary(report: dict[str, Any] | None) -> str | None:
    """One line: what the calibrator training at a build did (the retrain reason)."""
    if not report:
        return None
    if report.get("trained"):
        cal = report.get("calibrator") or {}
        warm = "warm start" if cal.get("warm_start") else "from scratch"
        return (
            f"trained on {report.get('new_tokens', 0)} new held-out tokens "
            f"({report.get('training_tokens', 0)} in all, {warm})"
        )
    reason = report.get("reason") or "not trained"
    carried = report.get("carried_from")
    return reason if carried is None else f"{reason}; kept the calibrator of v{carried}"


def builds(rows: Sequence[dict[str, Any]]) -> list[BuildRow]:
    out = []
    for b in rows:
        params = b["params"]
        out.append(
            BuildRow(
                **{k: v for k, v in b.items() if k != "params"},
                calibrator=calibrator_summary(params.get("calibrator")),
                interpolation=params.get("interpolation"),
                sizes=params.get("sizes"),
                consolidation=params.get("consolidation"),
            )
        )
    return out
