"""The memorisation policy the service runs (set over the admin API)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from memlm.db.models import PolicySetting
from memlm.db.repositories.common import utcnow


class PolicyRepository:
    """The active memorisation policy (one row); seeded from the settings."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def get(self, *, default_policy: str, default_delta: float | None) -> PolicySetting:
        row = self.s.get(PolicySetting, 1)
        return row if row is not None else self._seed(default_policy, default_delta, {})

    def set(self, policy: str, delta: float | None, params: dict[str, Any]) -> PolicySetting:
        row = self.s.get(PolicySetting, 1) or self._seed(policy, delta, params)
        row.policy, row.delta, row.params = policy, delta, params
        row.updated_at = utcnow()
        self.s.flush()
        return row

    def _seed(self, policy: str, delta: float | None, params: dict[str, Any]) -> PolicySetting:
        """Insert the row; when another process (API and worker start together) inserted
        it first, its row wins, as in :meth:`BuildRepository.enqueue`."""
        row = PolicySetting(id=1, policy=policy, delta=delta, params=params)
        try:
            with self.s.begin_nested():
                self.s.add(row)
        except IntegrityError:
            winner = self.s.get(PolicySetting, 1)
            if winner is None:
                raise
            return winner
        return row
