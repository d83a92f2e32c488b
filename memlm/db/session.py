"""Database engines and sessions: SQLite (embedded default) or PostgreSQL by URL."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, QueuePool


class ClosingQueuePool(QueuePool):
    """SQLAlchemy's ``QueuePool``, except that a connection checked in after the pool was
    disposed is closed at once.

    ``Engine.dispose()`` closes the idle connections and swaps in a fresh pool; one still
    checked out (a thread the API abandoned at shutdown, a poll still running) goes back
    to the old pool's queue, where only the garbage collector would find it, and psycopg
    then warns that a connection was deleted while still open, at some unrelated later
    moment. Closing it on its return leaves nothing to that collector.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._disposed = False
        # a return that found the pool live finishes queueing before dispose() drains the
        # queue: without it, a connection queued just after the drain would stay open
        self._return_lock = threading.Lock()

    def dispose(self) -> None:
        with self._return_lock:
            self._disposed = True
        super().dispose()

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        with self._return_lock:
            if not self._disposed:
                super()._do_return_conn(record)  # non-blocking: queued, or closed on overflow
                return
        record.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine; SQLite gets WAL and a busy timeout so API and worker can share it."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL lets the API read while the worker writes; NORMAL is durable at checkpoints
            # and commits survive a process crash (only power loss can lose the last ones).
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            # A forgotten document's text must leave the file: freed cells and pages are
            # zeroed, not left for a later write to overwrite (see purge_wal).
            cur.execute("PRAGMA secure_delete=ON")
            cur.close()
            # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin, so
            # SAVEPOINTs work (SQLAlchemy's documented pysqlite recipe).
            dbapi_conn.isolation_level = None

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE: take the write lock up front; a deferred read-then-write transaction
            # can fail with SQLITE_BUSY in WAL mode when another process wrote meanwhile.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, poolclass=ClosingQueuePool, **kwargs)


def purge_wal(engine: Engine) -> bool:
    """SQLite: checkpoint the WAL into the database and truncate it to 0 bytes, so old
    page images (a forgotten document's text among them) leave the -wal file too.

    Returns False when a reader kept the checkpoint from finishing (the next call does it)
    and on PostgreSQL, where an updated row's old version stays until VACUUM reclaims it.
    Runs outside any transaction, on its own DBAPI connection.
    """
    if engine.dialect.name != "sqlite":
        return False
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        cur.close()
    finally:
        raw.close()
    return busy == 0


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def is_postgres(session_or_engine: Session | Engine) -> bool:
    bind = (
        session_or_engine.get_bind()
        if isinstance(session_or_engine, Session)
        else session_or_engine
    )
    return bind.dialect.name == "postgresql"
