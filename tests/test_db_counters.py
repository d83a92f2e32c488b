"""The per-day counters stay exact when two workers commit at once (the Milvus memory's
workers share no file lock; tests/test_workers_milvus.py once lost a document's counts)."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest

from memlm.db.models import DayStat
from memlm.db.repositories import StatsRepository

pytestmark = pytest.mark.postgres

DAY = dt.date(2017, 2, 7)


def test_concurrent_commits_to_one_day_lose_nothing(pg_url: str, make_sessions: Any) -> None:
    sessions = make_sessions(pg_url)
    with sessions.begin() as s:
        StatsRepository(s).add_document(DAY, "monim", 10, 4)  # the row exists
    first_holds = threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            first_holds.wait(30)
            with sessions.begin() as s:  # waits for the first transaction's row lock
                StatsRepository(s).add_document(DAY, "monim", 7, 3)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=second)
    t.start()
    with sessions.begin() as s:
        StatsRepository(s).add_document(DAY, "monim", 5, 2)
        first_holds.set()
        t.join(timeout=1.0)  # the second is blocked on the row until this commits
        assert t.is_alive()
    t.join(timeout=30)
    assert not errors, errors
    with sessions() as s:
        row = s.get(DayStat, (DAY, "monim"))
        assert (row.documents, row.tokens_seen, row.tokens_stored) == (3, 22, 9)
