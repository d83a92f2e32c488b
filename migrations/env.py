"""Alembic environment: the URL comes from the caller or from memlm's settings."""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any, Literal

from alembic import context

from memlm.db.models import Base, UTCDateTime
from memlm.db.session import make_engine

config = context.config
if config.config_file_name is not None and not config.attributes.get("url"):
    # Only the `alembic` command line configures logging; memlm keeps its own.
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Autogenerate writes memlm's column types as the plain types they emit, so a
    migration never imports the models (whose code changes after the migration)."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return str(url)
    from memlm.settings import Settings

    return Settings().db_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, render_item=render_item
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_item=render_item
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
            context.configure(
                connection=conn,
                target_metadata=target_metadata,
                render_item=render_item,
                render_as_batch=conn.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:  # a failed migration (or autogenerate's check) must not leave connections open
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
