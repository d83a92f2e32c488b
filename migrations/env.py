"""Alembic environment: the URL comes from the caller or from memlm's settings."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from memlm.db.models import Base
from memlm.db.session import make_engine

config = context.config
if config.config_file_name is not None and not config.attributes.get("url"):
    # Only the `alembic` command line configures logging; memlm keeps its own.
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return str(url)
    from memlm.settings import Settings

    return Settings().db_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    with engine.connect() as conn:
        # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
        context.configure(
            connection=conn,
            target_metadata=target_metadata,
            render_as_batch=conn.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
