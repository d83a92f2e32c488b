"""When a try fails because something the service needs is away, not because of the input.

Three dependencies can go away under a running service: the disk of the data directory
(full), the database (restarted, unreachable) and the Milvus server. Each failure then
is passing: the API answers 503 with the reason and a Retry-After (``service.errors``),
and the ingest worker puts the document back with the reason and pauses before its next
claim (``workers.ingest``). This module only recognises them, in one place.
"""

from __future__ import annotations

import errno

# A full disk, or a quota reached: space may come back, the document is not at fault.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

DISK_FULL = "no space left on device: the data directory is full; retried when space returns"
DATABASE = "the database is unavailable (restarting, unreachable or busy); retried when it is back"
MEMORY = "the vector memory server is unavailable (restarting or unreachable)"


class MemoryUnavailable(RuntimeError):
    """The memory backend's server cannot be reached (the Milvus memory raises it)."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from, innermost last (cycles stopped)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _database_away(exc: BaseException) -> bool:
    # Imported here: the workers and the API import this module before the database layer.
    from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError

    if isinstance(exc, OperationalError | InterfaceError | DisconnectionError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    # psycopg's own errors, raised by code that talks to PostgreSQL without SQLAlchemy
    # (the workers' liveness locks); matched by name, so psycopg is never imported here
    mod = type(exc).__module__
    return mod.startswith("psycopg") and type(exc).__name__ in (
        "OperationalError",
        "InterfaceError",
    )


def unavailable(exc: BaseException) -> str | None:
    """The client-safe reason when ``exc`` says a dependency is away, else None."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return DISK_FULL
    for e in chain:
        if isinstance(e, MemoryUnavailable):
            return MEMORY
        if _database_away(e):
            # SQLite on a full disk says so through the database layer
            return DISK_FULL if "disk is full" in str(e) else DATABASE
    return None
