"""A PostgreSQL server of the test's own, which the test may stop and start again.

The shared server at 127.0.0.1:5432 serves other tests at the same time, so a test
that restarts "the database" starts its own with the server binaries (``initdb``,
``pg_ctl``), as the ``postgres`` user (the server refuses to run as root), on a free
port, in a temporary directory removed afterwards. Skips with the reason when the
binaries or the user are missing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One private PostgreSQL cluster: ``url``, ``stop()``, ``start()``."""

    def __init__(self, root: Path, user: str, pg_ctl: str) -> None:
        self.root, self.user, self.pg_ctl = root, user, pg_ctl
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_user(self, *cmd: str) -> None:
        prefix = [] if os.geteuid() != 0 else ["runuser", "-u", self.user, "--"]
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.root / "server.log")
        self._as_user(
            self.pg_ctl, "-D", str(self.root / "data"), "-o", opts, "-l", log, "-w", "start"
        )

    def stop(self) -> None:
        """Stop at once (``-m fast``: open connections are cut, as in a restart)."""
        self._as_user(self.pg_ctl, "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[Server]:
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) for a private server")
    user = "postgres"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.skip("running as root without a postgres user to run the server as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser to start the server as postgres")
    root = Path(tempfile.mkdtemp(prefix="memlm-pg-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(root, user)
        server = Server(root, user, pg_ctl)
        server._as_user(initdb, "-D", str(root / "data"), "-U", "postgres", "-A", "trust")
        server.start()
        try:
            yield server
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
