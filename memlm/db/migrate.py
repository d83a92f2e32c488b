"""Alembic from Python: upgrade, downgrade, current revision, and the start-up check."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from memlm.db.errors import DatabaseNotMigrated


def _script_location() -> Path:
    """The Alembic folder: inside the installed package, else the checkout's top level.

    The scripts live in the repository's top-level ``migrations/`` (where alembic.ini
    points); setup.py ships that folder inside the wheel as ``memlm/db/migrations``, so an
    installed wheel migrates without a checkout.
    """
    here = Path(__file__).resolve()
    for folder in (here.with_name("migrations"), here.parents[2] / "migrations"):
        if (folder / "env.py").is_file():
            return folder
    return here.with_name("migrations")  # neither: Alembic names the missing folder


SCRIPT_LOCATION = _script_location()


def alembic_config(url: str) -> Config:
    """An Alembic config for ``url`` using the packaged migrations (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    # env.py reads this attribute first, so a caller's URL wins over the settings.
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def known_revisions() -> set[str]:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return {rev.revision for rev in script.walk_revisions()}


def check_migrated(engine: Engine) -> None:
    """Raise :class:`DatabaseNotMigrated` unless the schema is at the head revision."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    db = engine.url.render_as_string(hide_password=True)
    if current is not None and current not in known_revisions():
        # Migrated by newer code (a rollback of the code, or an old replica): upgrading
        # cannot help, and downgrading needs the newer code's migration scripts.
        raise DatabaseNotMigrated(
            f"database {db} is at revision {current}, which this code does not know (it "
            f"needs {head}): run the newer memlm, or its `memlm db downgrade {head}`"
        )
    raise DatabaseNotMigrated(
        f"database {db} is at revision {current or 'none (empty)'}, the code needs {head}: "
        "run `memlm db upgrade`"
    )
