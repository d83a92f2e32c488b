"""GET /admin/stats: the database's counters joined with the engine's memory figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from memlm.api import (
    CalibratorOut,
    DayStatOut,
    IndexOut,
    InterpolationOut,
    PolicyOut,
    StatsResponse,
)
from memlm.db.models import DayStat, IndexBuild, PolicySetting
from memlm.db.repositories import (
    BuildRepository,
    DocumentRepository,
    PolicyRepository,
    StatsRepository,
)
from memlm.settings import Settings


def _rate(stored: int, seen: int) -> float:
    return stored / seen if seen else 0.0


def per_day(rows: Sequence[DayStat]) -> list[DayStatOut]:
    out, seen, stored = [], 0, 0
    for r in rows:
        seen += r.tokens_seen
        stored += r.tokens_stored
        out.append(
            DayStatOut(
                day=r.day,
                policy=r.policy,
                documents=r.documents,
                tokens_seen=r.tokens_seen,
                tokens_stored=r.tokens_stored,
                entries_forgotten=r.entries_forgotten,
                memrate=_rate(r.tokens_stored, r.tokens_seen),
                cumulative_memrate=_rate(stored, seen),
            )
        )
    return out


def policy_out(row: PolicySetting) -> PolicyOut:
    return PolicyOut(
        policy=row.policy, delta=row.delta, params=row.params, updated_at=row.updated_at
    )


def read_db(s: Session, settings: Settings) -> dict[str, Any]:
    """Everything /admin/stats needs from the database, read in one session."""
    return {
        "per_day": StatsRepository(s).per_day(),
        "documents": DocumentRepository(s).counts_by_status(),
        "active": BuildRepository(s).active(),
        "policy": PolicyRepository(s).get(
            default_policy=settings.policy, default_delta=settings.delta
        ),
    }


def summarise(
    db: dict[str, Any], engine_stats: dict[str, Any], served: str | None
) -> StatsResponse:
    days = per_day(db["per_day"])
    seen = sum(d.tokens_seen for d in days)
    stored = sum(d.tokens_stored for d in days)
    active: IndexBuild | None = db["active"]
    return StatsResponse(
        backend=str(engine_stats.get("backend", "faiss")),
        entries=int(engine_stats["entries"]),
        datastore_entries=int(engine_stats["datastore_entries"]),
        tokens_seen=seen,
        tokens_stored=stored,
        entries_forgotten=sum(d.entries_forgotten for d in days),
        memrate=_rate(stored, seen),
        per_day=days,
        documents=db["documents"],
        bytes_on_disk=engine_stats.get("bytes_on_disk"),
        bytes_in_ram=engine_stats.get("bytes_in_ram"),
        bytes_reclaimed=engine_stats.get("bytes_reclaimed"),
        index=IndexOut(
            version=None if active is None else active.version,
            built_at=None if active is None else active.finished_at,
            entries=None if active is None else active.entries,
            seconds=None if active is None else active.seconds,
            served_version=served,
        ),
        policy=policy_out(db["policy"]),
        calibrator=calibrator_out(engine_stats.get("calibrator")),
        interpolation=interpolation_out(engine_stats.get("interpolation")),
        device=engine_stats.get("device"),
        precision=engine_stats.get("precision"),
        consolidation=engine_stats.get("consolidation"),
    )


def interpolation_out(served: dict[str, Any] | None) -> InterpolationOut | None:
    """The engine's served interpolation (versions as strings, like the index's)."""
    if served is None:
        return None
    versions = {
        k: None if served.get(k) is None else str(served[k])
        for k in ("index_version", "chosen_for")
    }
    return InterpolationOut.model_validate({**served, **versions})


def calibrator_out(cal: dict[str, Any] | None) -> CalibratorOut | None:
    """The engine's calibrator figures (versions as strings, like the index's)."""
    if cal is None:
        return None
    versions = {
        k: None if cal.get(k) is None else str(cal[k]) for k in ("index_version", "trained_for")
    }
    return CalibratorOut.model_validate({**cal, **versions})
