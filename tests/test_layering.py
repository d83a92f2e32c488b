"""The layering (issues 12 and 33): import-linter's contracts in pyproject.toml hold, and break.

The service and the workers stand on the engine and the database and never import each
other; memlm (the CLI, the composition root, aside) imports neither of them; the API's
bodies and the client stand on no server code; nothing the service runs imports the
research code; the engine, the service and the workers reach the memory only through
memlm.memory (docs/architecture.md).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("memlm", "service", "workers")


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """Run the contracts of ``root/pyproject.toml`` (all, or these ids) on the packages
    under ``root``."""
    # import-linter finds the packages from the working directory, so the tree under test
    # is analysed, never the installed copy
    run = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    only = [arg for c in contracts for arg in ("--contract", c)]
    return subprocess.run(
        [sys.executable, "-c", run, "--no-cache", "--no-logo", *only, "pyproject.toml"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_core_contract_names_every_package_but_the_cli() -> None:
    """The core contract lists memlm's packages one by one (the CLI, the composition root,
    is the one left out, with no exception): a new package must join the list."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (core,) = [c for c in config["contracts"] if c["id"] == "core"]
    assert "ignore_imports" not in core
    here = {
        f"memlm.{p.stem}"
        for p in (ROOT / "memlm").iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.stem != "__init__"
    }
    assert set(core["source_modules"]) == here - {"memlm.cli"}


def test_no_contract_has_exceptions() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert [c["id"] for c in config["contracts"] if c.get("ignore_imports")] == []


def test_the_layering_contracts_hold() -> None:
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 6 kept, 0 broken." in out.stdout


@pytest.mark.parametrize(
    ("path", "forbidden", "contract"),
    [
        ("memlm/engine/core.py", "service.app", "core"),  # engine -> service
        ("memlm/datastore/store.py", "workers.ingest", "core"),  # memory -> workers
        ("memlm/db/repositories/builds.py", "workers.builder", "db"),  # db -> workers
        ("service/deps.py", "workers.ingest", "service-workers"),
        ("workers/builder.py", "service.state", "service-workers"),
        ("memlm/client/sync.py", "memlm.engine.facade", "api"),  # client -> engine
        ("memlm/api/inference.py", "service.app", "api"),  # bodies -> service
        ("memlm/engine/ingest.py", "memlm.research.trime", "research"),
        ("service/app.py", "memlm.research.lstm_train", "research"),
        ("memlm/engine/build.py", "memlm.index.build", "memory-boundary"),  # around the memory
        ("memlm/engine/core.py", "memlm.datastore", "memory-boundary"),
        ("workers/ingest.py", "memlm.datastore.store", "memory-boundary"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, path: str, forbidden: str, contract: str
) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    module = tmp_path / path
    module.write_text(module.read_text() + f"\nimport {forbidden}  # noqa: E402\n")
    out = lint_imports(tmp_path, contract)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Contracts: 0 kept, 1 broken." in out.stdout
    importer = path.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {forbidden}" in out.stdout
