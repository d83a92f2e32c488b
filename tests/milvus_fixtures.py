"""The real Milvus server of the tests: ``milvus==2.3.5`` from PyPI, started once per session.

One embedded server per machine: its etcd peer port (2380) is fixed, so a second one
crashes; ``MEMLM_TEST_MILVUS=host:port`` makes the tests use a running server instead.
Where it cannot start, every test that asks for it is skipped with the reason (shown by
``-ra`` in the summary and printed to stderr), never silently.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from memlm.memory.embedded import EmbeddedMilvus, MilvusUnavailable, start_embedded


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMilvus]:
    given = os.environ.get("MEMLM_TEST_MILVUS")  # host:port of a server already running
    if given:
        host, _, port = given.rpartition(":")
        print(f"\n[milvus] tests use the server at {given}", file=sys.stderr)
        yield EmbeddedMilvus(None, host or "127.0.0.1", int(port), Path("."), 0.0)
        return
    try:
        server = start_embedded(tmp_path_factory.mktemp("milvus"))
    except MilvusUnavailable as exc:
        print(f"\n[milvus] tests skipped: {exc}", file=sys.stderr)
        pytest.skip(f"the Milvus server cannot start here: {exc}")
    print(
        f"\n[milvus] server started on port {server.port} in {server.start_seconds:.1f} s",
        file=sys.stderr,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def milvus_url(milvus_server: EmbeddedMilvus) -> Iterator[str]:
    """A memory URL with a collection of its own (dropped afterwards); searches use
    Strong consistency so that a test reads what it just wrote from any connection."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield f"{milvus_server.url}/{name}?consistency=Strong&timeout=60"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated")
        from pymilvus import connections, utility

    alias = f"cleanup-{name}"
    connections.connect(alias=alias, host=milvus_server.host, port=milvus_server.port)
    try:
        if utility.has_collection(name, using=alias):
            utility.drop_collection(name, using=alias)
    finally:
        connections.disconnect(alias)
