"""The wheel carries the Alembic migrations (the checkout's top-level migrations/, shipped
as memlm/db/migrations), and an installed copy migrates without a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memlm.db.migrate import head_revision

ROOT = Path(__file__).resolve().parents[1]
MIGRATIONS = ROOT / "migrations"
SHIPPED = "memlm/db/migrations"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a clean copy of the sources (no stale build/ in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("memlm", "service", "workers", "migrations"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--disable-pip-version-check", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    [whl] = out.glob("memlm-*.whl")
    return whl


def test_wheel_contains_every_migration_file(wheel: Path) -> None:
    expected = {
        f"{SHIPPED}/{p.relative_to(MIGRATIONS).as_posix()}"
        for p in MIGRATIONS.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert f"{SHIPPED}/versions/0001_initial_schema.py" in expected
    assert f"{SHIPPED}/script.py.mako" in expected
    assert f"{SHIPPED}/env.py" in expected
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    shipped = {n for n in names if n.startswith(f"{SHIPPED}/")}
    assert shipped == expected
    assert not [n for n in names if n.startswith("migrations/")]  # no top-level package


def test_the_checkout_keeps_its_migrations_at_the_top_level() -> None:
    assert (MIGRATIONS / "env.py").is_file()
    assert not (ROOT / "memlm" / "db" / "migrations").exists()


def test_installed_wheel_migrates_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    """Unpacked (what pip does with a pure wheel) and run away from the checkout."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    db = tmp_path / "m.sqlite"
    script = (
        "import memlm.db.migrate as m\n"
        "from memlm.db.session import make_engine\n"
        f"m.upgrade({f'sqlite:///{db}'!r})\n"
        f"e = make_engine({f'sqlite:///{db}'!r})\n"
        "print(m.__file__)\n"
        "print(m.current_revision(e), m.head_revision())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": str(site)},
        check=True,
        capture_output=True,
        text=True,
    )
    head = head_revision()
    assert head is not None
    assert out.stdout.splitlines() == [str(site / "memlm" / "db" / "migrate.py"), f"{head} {head}"]


def test_installed_wheel_runs_memlm_db_upgrade(wheel: Path, tmp_path: Path) -> None:
    """The CLI of the unpacked wheel (not the checkout) migrates a fresh database."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    env = {**os.environ, "PYTHONPATH": str(site), "MEMLM_DATABASE_URL": url}
    env.pop("MEMLM_ENV", None)
    run = [sys.executable, "-m", "memlm.cli", "db"]
    up = subprocess.run([*run, "upgrade"], cwd=workdir, env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    cur = subprocess.run([*run, "current"], cwd=workdir, env=env, capture_output=True, text=True)
    head = head_revision()
    assert cur.stdout.strip() == f"current {head}; head {head}", cur.stderr
