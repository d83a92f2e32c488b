"""A local Milvus standalone server from the PyPI package ``milvus`` (tests, benchmarks).

``milvus==2.3.5`` ships the server binary; pymilvus needs ``pkg_resources``
(setuptools 77-80; torch 2.13 needs >= 77.0.3).
Production runs against Milvus standalone or Distributed by URL (docs/service.md); this
module only starts the embedded one, in its own base directory, on free ports: the
package resolves free ports for the Milvus services, and ``_etcd_ports`` gives the
in-process etcd two of its own (etcd's defaults, 2379 and 2380, would make a second
server on the machine fail to start).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Startup on this machine kind: ~15 s (the binary is unpacked the first time).
START_TIMEOUT_S = 120.0
# Seconds between the query coordinator's moves to newly flushed segments (Milvus:
# ``queryCoord.updateNextTargetInterval``, 10 by default): how long a build waits, at
# most, before its new index serves.
TARGET_INTERVAL_S = 2


class MilvusUnavailable(RuntimeError):
    """The embedded Milvus server cannot start here (package missing, no binary, timeout)."""


@dataclass
class EmbeddedMilvus:
    """A running embedded server: where to connect and how to stop it."""

    server: Any
    host: str
    port: int
    base_dir: Path
    start_seconds: float

    @property
    def url(self) -> str:
        """The ``MEMLM_MEMORY_URL`` prefix of this server (append ``/collection``)."""
        return f"milvus://{self.host}:{self.port}"

    def rss_bytes(self) -> int:
        """Resident memory of the server process (0 when it is gone)."""
        proc = getattr(self.server, "server_proc", None)
        if proc is None:
            return 0
        try:
            text = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.server is None:  # a server this process did not start
            return
        proc = getattr(self.server, "server_proc", None)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)  # the package waits only 1 s before a kill
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _etcd_ports(base_dir: Path, package_dir: Path) -> Path:
    """A config template (``base_dir/config.yaml.template``) whose embedded etcd listens
    on free ports (its own config file, ``etcd.yaml``), instead of etcd's fixed defaults;
    returns the template."""
    client, peer = _free_port(), _free_port()
    etcd = base_dir / "etcd.yaml"
    etcd.write_text(
        "name: memlm\n"
        f"listen-client-urls: http://127.0.0.1:{client}\n"
        f"advertise-client-urls: http://127.0.0.1:{client}\n"
        f"listen-peer-urls: http://127.0.0.1:{peer}\n"
        f"initial-advertise-peer-urls: http://127.0.0.1:{peer}\n"
        f"initial-cluster: memlm=http://127.0.0.1:{peer}\n"
    )
    text = (package_dir / "data" / "config.yaml.template").read_text()
    embed = "  use:\n    embed: true"
    if embed not in text:
        raise MilvusUnavailable("the milvus package's config template has no embedded etcd")
    text = text.replace(embed, f"  config:\n    path: {etcd}\n{embed}", 1)
    handoff = "  autoHandoff: true"
    if handoff in text:  # the query nodes move to newly flushed, indexed segments every
        # 2 s instead of 10 s: a build waits for it (milvus_builds.wait_handed_over)
        text = text.replace(
            handoff, f"{handoff}\n  updateNextTargetInterval: {TARGET_INTERVAL_S}", 1
        )
    interim = "    interimIndex: # build a vector temperate index for growing segment or binlog to accelerate search\n      enableIndex: true"
    if interim in text:  # a segment not indexed yet (growing, or a compaction's merged
        # one before its index) is searched exactly, not through a 128-list IVF probed
        # 16 lists deep (0.68 of the exact top-10 in two CI failures of the index-kind test)
        text = text.replace(interim, interim.replace("enableIndex: true", "enableIndex: false"), 1)
    template = base_dir / "config.yaml.template"
    template.write_text(text)
    return template


def start_embedded(base_dir: Path, *, timeout: float = START_TIMEOUT_S) -> EmbeddedMilvus:
    """Start a Milvus standalone server with its data under ``base_dir``.

    Raises ``MilvusUnavailable`` with the reason when it cannot start here.
    """
    if importlib.util.find_spec("milvus") is None:
        raise MilvusUnavailable("the package 'milvus' (pip install milvus==2.3.5) is missing")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # its pkg_resources import
            warnings.filterwarnings("ignore", message="pkg_resources is deprecated")
            import milvus
            from milvus import MilvusServer, MilvusServerConfig
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to report
        raise MilvusUnavailable(f"cannot import milvus: {type(exc).__name__}: {exc}") from exc
    base_dir = Path(base_dir).resolve()  # the server runs elsewhere: paths must be absolute
    base_dir.mkdir(parents=True, exist_ok=True)
    package_dir = Path(milvus.__file__).parent
    config = MilvusServerConfig(template=str(_etcd_ports(base_dir, package_dir)))
    config.glog_conf_file = str(package_dir / "data" / "glog.conf")  # set only without one
    server = MilvusServer(config, wait_for_started=False)
    server.set_base_dir(str(base_dir))
    t0 = time.perf_counter()
    old_cwd = os.getcwd()
    try:
        with warnings.catch_warnings():
            # its port search leaves the sockets of ports it could not bind to the GC
            warnings.simplefilter("ignore", ResourceWarning)
            server.start()  # resolves free ports (19530 and up), unpacks the binary once
            gc.collect()
        server.wait_started(timeout=int(timeout * 1000))
    except Exception as exc:  # noqa: BLE001
        os.chdir(old_cwd)
        server.stop()
        log_file = base_dir / "logs" / "milvus-stderr.log"
        tail = ""
        if log_file.exists():
            tail = " | ".join(log_file.read_text(errors="replace").splitlines()[-3:])
        raise MilvusUnavailable(
            f"Milvus did not start in {timeout:.0f} s: {type(exc).__name__}: {exc} {tail}"
        ) from exc
    return EmbeddedMilvus(
        server, "127.0.0.1", int(server.listen_port), base_dir, time.perf_counter() - t0
    )
