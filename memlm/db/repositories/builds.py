"""Index builds: queued, running, done or failed, and the versions they recorded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from memlm.db.errors import NotFound
from memlm.db.models import IndexBuild
from memlm.db.repositories.common import utcnow
from memlm.db.session import is_postgres


class BuildRepository:
    """Index build requests (idempotent by key) and their results."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def enqueue(
        self, key: str, requested_by: str, *, retrain: bool = False
    ) -> tuple[IndexBuild, bool]:
        """Request a build under ``key``; the same key twice gives the first request.
        ``retrain``: train the index from scratch (``params["retrain"]`` until it ran)."""
        existing = self.s.scalars(select(IndexBuild).where(IndexBuild.request_key == key)).first()
        if existing is not None:
            return existing, False
        params = {"retrain": True} if retrain else {}
        row = IndexBuild(request_key=key, requested_by=requested_by, status="queued", params=params)
        try:
            with self.s.begin_nested():
                self.s.add(row)
        except IntegrityError:
            # Another process inserted the same key between our lookup and insert.
            winner = self.s.scalars(select(IndexBuild).where(IndexBuild.request_key == key)).one()
            return winner, False
        return row, True

    def request(
        self, key: str | None = None, requested_by: str = "manual", *, retrain: bool = False
    ) -> tuple[IndexBuild, bool]:
        """Request a build. With a key, the same key twice gives the first request; without,
        the request joins a build already queued or running, else a new one is queued.
        Returns (the request, whether it is new).

        ``retrain``: the build trains the index from scratch instead of adding to the served
        version. It joins a queued request (which then retrains), not a running one that
        does not retrain: a new request is queued after it.
        """
        if key is None:
            pending = self.open_request()
            if pending is not None and retrain and not (pending.params or {}).get("retrain"):
                if pending.status == "queued":
                    pending.params = {**(pending.params or {}), "retrain": True}
                    return pending, False
                pending = None  # running without retraining: queue one after it
            if pending is not None:
                return pending, False
            key = f"{requested_by}:{utcnow().isoformat(timespec='microseconds')}"
        return self.enqueue(key, requested_by, retrain=retrain)

    def open_request(self) -> IndexBuild | None:
        """A queued or running build, if any (manual requests coalesce onto it)."""
        q = (
            select(IndexBuild)
            .where(IndexBuild.status.in_(("queued", "building")))
            .order_by(IndexBuild.id)
            .limit(1)
        )
        return self.s.scalars(q).first()

    def claim_queued(self) -> IndexBuild | None:
        q = select(IndexBuild).where(IndexBuild.status == "queued").order_by(IndexBuild.id).limit(1)
        if is_postgres(self.s):
            q = q.with_for_update(skip_locked=True)
        row = self.s.scalars(q).first()
        if row is not None:
            row.status = "building"
            row.started_at = utcnow()
        return row

    def release_orphans(self) -> int:
        res = self.s.execute(
            update(IndexBuild).where(IndexBuild.status == "building").values(status="queued")
        )
        return int(res.rowcount)  # type: ignore[attr-defined]

    def finish(
        self, build_id: int, *, version: str, entries: int, params: dict[str, Any], seconds: float
    ) -> None:
        row = self.get(build_id)
        row.status = "done"
        row.version = version
        row.entries = entries
        row.params = params
        row.seconds = seconds
        row.finished_at = utcnow()

    def fail(self, build_id: int, reason: str) -> None:
        row = self.get(build_id)
        row.status = "failed"
        row.error = reason[:2000]
        row.finished_at = utcnow()

    def get(self, build_id: int) -> IndexBuild:
        row = self.s.get(IndexBuild, build_id)
        if row is None:
            raise NotFound(f"index build {build_id} does not exist")
        return row

    def active(self) -> IndexBuild | None:
        """The newest finished build: the index the server should serve."""
        q = (
            select(IndexBuild)
            .where(IndexBuild.status == "done")
            .order_by(IndexBuild.finished_at.desc(), IndexBuild.id.desc())
            .limit(1)
        )
        return self.s.scalars(q).first()

    def recorded_versions(self) -> set[int]:
        """The index versions of finished builds: the only ones that may be served."""
        q = select(IndexBuild.version).where(
            IndexBuild.status == "done", IndexBuild.version.is_not(None)
        )
        return {int(v) for v in self.s.scalars(q) if v is not None and v.isdigit()}

    def recent(self, n: int = 10) -> Sequence[IndexBuild]:
        return self.s.scalars(select(IndexBuild).order_by(IndexBuild.id.desc()).limit(n)).all()
