"""A logical copy of memlm's tables through SQLAlchemy: read in one snapshot, loaded into
an empty database at the same migration head, on SQLite and PostgreSQL alike.

The one module outside ``repositories.py`` that queries tables: it copies whole tables
generically (every table of the models, every column), which no domain query does. A
logical copy, not ``pg_dump`` or a file copy: it needs no server tools, works between
SQLite and PostgreSQL, and reads exactly the snapshot that :func:`snapshot_engine`'s
transaction saw, while ingest goes on.

Format: one gzipped JSON-lines file per table (``<table>.jsonl.gz``), one object per row
keyed by column name; dates and timestamps as ISO 8601 text (timestamps with their UTC
offset), binary columns as base64. Rows in primary-key order.
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from sqlalchemy import Connection, Engine, Table, create_engine, event, func, inspect, select, text

from memlm.db.migrate import current_revision, head_revision
from memlm.db.models import Base
from memlm.db.session import ClosingQueuePool

# Rows per INSERT batch and per fetch while streaming a table.
_BATCH = 2000


def tables() -> list[Table]:
    """memlm's tables, parents before children (the order to load them in)."""
    return list(Base.metadata.sorted_tables)


def snapshot_engine(url: str) -> Engine:
    """An engine whose transactions are read-only snapshots that never block writers.

    PostgreSQL: REPEATABLE READ, READ ONLY (the snapshot is taken at the first query).
    SQLite: a deferred ``BEGIN`` (the read snapshot of WAL mode starts at the first
    query); ``memlm.db.session.make_engine`` begins IMMEDIATE, which takes the write lock
    and would stop every commit of the workers and the API for the whole dump.
    """
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _manual(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # SQLAlchemy's pysqlite recipe: we BEGIN

        @event.listens_for(engine, "begin")
        def _deferred(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN")

        return engine
    return create_engine(
        url,
        pool_pre_ping=True,
        poolclass=ClosingQueuePool,
        isolation_level="REPEATABLE READ",
        execution_options={"postgresql_readonly": True},
    )


def _encode(v: Any) -> Any:
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, dt.date):  # dt.datetime too: aware timestamps keep their offset
        return v.isoformat()
    return v


def _decoder(table: Table) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function turning a dumped row back into the values the column types bind."""
    parse: dict[str, Callable[[Any], Any]] = {}
    for col in table.columns:
        # a TypeDecorator (UTCDateTime) answers ``object``: its implementation says more
        kind = getattr(col.type, "impl_instance", col.type).python_type
        if kind is bytes:
            parse[col.name] = base64.b64decode
        elif kind is dt.datetime:  # before date: a datetime is a date
            parse[col.name] = dt.datetime.fromisoformat
        elif kind is dt.date:
            parse[col.name] = dt.date.fromisoformat

    def decode(row: dict[str, Any]) -> dict[str, Any]:
        return {k: (v if v is None or k not in parse else parse[k](v)) for k, v in row.items()}

    return decode


def dump_table(conn: Connection, table: Table, out: IO[bytes]) -> int:
    """Write every row of ``table`` as gzipped JSON lines to ``out``; returns the rows."""
    n = 0
    names = [c.name for c in table.columns]
    # mtime=0: the same rows give the same bytes (and checksum)
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz:
        q = select(table).order_by(*table.primary_key.columns)
        for row in conn.execution_options(yield_per=_BATCH).execute(q):
            line = json.dumps(dict(zip(names, map(_encode, row), strict=True)))
            gz.write(line.encode("utf-8") + b"\n")
            n += 1
    return n


def load_table(conn: Connection, table: Table, lines: Iterable[bytes]) -> int:
    """Insert the dumped rows (JSON lines) into ``table``; returns the rows."""
    decode = _decoder(table)
    n = 0
    batch: list[dict[str, Any]] = []
    for line in lines:
        if not line.strip():
            continue
        batch.append(decode(json.loads(line)))
        if len(batch) == _BATCH:
            conn.execute(table.insert(), batch)
            n, batch = n + len(batch), []
    if batch:
        conn.execute(table.insert(), batch)
        n += len(batch)
    return n


def read_lines(raw: IO[bytes]) -> Iterator[bytes]:
    """The JSON lines of a dumped table file (gzip)."""
    with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        yield from gz


def reset_sequences(conn: Connection) -> None:
    """PostgreSQL: move each serial id's sequence past the loaded ids (explicit ids were
    inserted, which a sequence does not see); SQLite takes max(rowid) + 1 by itself."""
    if conn.dialect.name != "postgresql":
        return
    for table in tables():
        for col in table.primary_key.columns:
            seq = conn.scalar(
                text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table.name, "c": col.name}
            )
            if seq is None:
                continue
            top = conn.scalar(select(func.max(col)))
            # is_called false: the next id is 1 on an empty table
            conn.execute(
                text("SELECT setval(:s, :v, :called)"),
                {"s": seq, "v": top or 1, "called": top is not None},
            )


def not_empty_reason(engine: Engine) -> str | None:
    """Why the database cannot receive a restore (None: it can).

    It can when it holds none of memlm's tables, or all of them at the migration head
    and without a row (as ``memlm db upgrade`` leaves a new database).
    """
    ours = {t.name for t in tables()}
    present = ours & set(inspect(engine).get_table_names())
    if not present:
        return None
    revision, head = current_revision(engine), head_revision()
    if revision != head:
        return f"it holds memlm tables at migration {revision or 'none'}, not the head {head}"
    with engine.connect() as conn:
        for table in tables():
            if table.name in present and conn.scalar(select(func.count()).select_from(table)):
                return f"its table {table.name} holds rows"
    return None
