"""Per-day counters of what was seen and stored (MemRate)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from memlm.db.models import DayStat


class StatsRepository:
    """Per-day counters; MemRate = tokens stored / tokens seen."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def _row(self, day: dt.date, policy: str) -> DayStat:
        # FOR UPDATE: workers on the Milvus memory commit without a common file lock, and
        # two read-modify-writes of one day's row would lose one's counts (PostgreSQL
        # makes the second wait and read the first's committed row; SQLite has one writer)
        row = self.s.get(DayStat, (day, policy), with_for_update=True, populate_existing=True)
        if row is None:
            row = DayStat(
                day=day,
                policy=policy,
                documents=0,
                tokens_seen=0,
                tokens_stored=0,
                entries_forgotten=0,
            )
            self.s.add(row)
        return row

    def add_document(self, day: dt.date, policy: str, tokens_seen: int, tokens_stored: int) -> None:
        row = self._row(day, policy)
        row.documents += 1
        row.tokens_seen += tokens_seen
        row.tokens_stored += tokens_stored

    def add_forgotten(self, day: dt.date, policy: str, entries: int) -> None:
        self._row(day, policy).entries_forgotten += entries

    def memrate(self, policies: Sequence[str]) -> float | None:
        """Cumulative MemRate (stored / seen) of these policies; None when they saw nothing."""
        q = select(func.sum(DayStat.tokens_stored), func.sum(DayStat.tokens_seen)).where(
            DayStat.policy.in_(list(policies))
        )
        stored, seen = self.s.execute(q).one()
        return int(stored) / int(seen) if seen else None

    def per_day(self) -> Sequence[DayStat]:
        return self.s.scalars(select(DayStat).order_by(DayStat.day, DayStat.policy)).all()
