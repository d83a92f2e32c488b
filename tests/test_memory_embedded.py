"""The embedded Milvus server (memlm.memory.embedded): its etcd on ports of its own, so a
second server starts on a machine where one runs already."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from memlm.memory import open_milvus
from memlm.memory.embedded import EmbeddedMilvus, _etcd_ports, start_embedded


def test_the_embedded_etcd_listens_on_free_ports_of_its_own(tmp_path: Path) -> None:
    package = tmp_path / "package"
    (package / "data").mkdir(parents=True)
    (package / "data" / "config.yaml.template").write_text(
        "etcd:\n  endpoints: localhost:2379\n  use:\n    embed: true\n  data:\n    dir: x\n"
    )
    template = _etcd_ports(tmp_path, package)
    etcd = tmp_path / "etcd.yaml"
    assert template.read_text() == (
        "etcd:\n  endpoints: localhost:2379\n"
        f"  config:\n    path: {etcd}\n  use:\n    embed: true\n  data:\n    dir: x\n"
    )
    conf = dict(line.split(": ", 1) for line in etcd.read_text().splitlines())
    client = int(conf["listen-client-urls"].rsplit(":", 1)[1])
    peer = int(conf["listen-peer-urls"].rsplit(":", 1)[1])
    assert conf["initial-cluster"] == f"memlm=http://127.0.0.1:{peer}"
    assert client != peer and not {client, peer} & {2379, 2380}
    for port in (client, peer):  # free now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.milvus
def test_a_second_server_starts_beside_the_first(
    milvus_server: EmbeddedMilvus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative data directory (`memlm eval --out runs/x`)
    second = start_embedded(Path("second"))
    try:
        assert second.port != milvus_server.port
        memory = open_milvus(f"{second.url}/beside?consistency=Strong", 4)
        memory.append(np.eye(4), [1, 2, 3, 4], [7, 7, 7, 7], [0, 1, 2, 3], [1, 1, 1, 1])
        assert memory.count() == 4
        memory.close()
    finally:
        second.stop()
