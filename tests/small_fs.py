"""A real small filesystem for disk-full tests: a tmpfs mounted for the test (root only)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``256k``, ``3m``) at ``where`` for the block; skips the
    test with the reason when this process may not mount (not root, in a container)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a disk-full test needs a small filesystem")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({r.stderr.strip()}): run the test as root")
    try:
        yield where
    finally:
        # lazy: a handle the test still holds (a memmap) must not keep it mounted
        subprocess.run(["umount", "-l", str(where)], check=False)


def resize(where: Path, size: str) -> None:
    """Give the mounted tmpfs at ``where`` a new size (space comes back)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)
