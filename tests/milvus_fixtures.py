"""The real Milvus server of the tests: ``milvus==2.3.5`` from PyPI, started once per session.

One server per session, shared by the workers of a parallel run (each server starts in
15-30 s and holds ~0.5 GB; a second one on the machine runs beside the first:
memlm.memory.embedded gives its etcd ports of its own); ``MEMLM_TEST_MILVUS=host:port``
makes the tests use a running server instead.
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

# Under pytest-xdist the workers share one server, started by the controller
# (start_shared_server, from conftest's pytest_configure) and named to them through
# MEMLM_TEST_MILVUS; where it could not start, its reason travels the same way.
SKIP_REASON_ENV = "MEMLM_TEST_MILVUS_UNAVAILABLE"


def start_shared_server(config: pytest.Config) -> EmbeddedMilvus | None:
    """The controller of an xdist run starts the one server of the run (None: not the
    controller of a parallel run, or a server was named already)."""
    parallel = bool(getattr(config.option, "numprocesses", None))
    if not parallel or hasattr(config, "workerinput") or os.environ.get("MEMLM_TEST_MILVUS"):
        return None
    import tempfile

    try:
        server = start_embedded(Path(tempfile.mkdtemp(prefix="memlm-test-milvus-")))
    except MilvusUnavailable as exc:
        os.environ[SKIP_REASON_ENV] = str(exc)
        return None
    os.environ["MEMLM_TEST_MILVUS"] = f"{server.host}:{server.port}"
    print(f"\n[milvus] the workers share a server on port {server.port}", file=sys.stderr)
    return server


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMilvus]:
    unavailable = os.environ.get(SKIP_REASON_ENV)
    if unavailable:
        pytest.skip(f"the Milvus server cannot start here: {unavailable}")
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

    from memlm.memory.milvus_generations import generation_of

    alias = f"cleanup-{name}"
    connections.connect(alias=alias, host=milvus_server.host, port=milvus_server.port)
    try:
        # the memory's alias, then every generation of it (milvus_generations)
        mine = [
            n for n in utility.list_collections(using=alias) if generation_of(name, n) is not None
        ]
        for n in mine:
            for a in utility.list_aliases(n, using=alias):
                utility.drop_alias(a, using=alias)
        for n in mine:
            utility.drop_collection(n, using=alias)
    finally:
        connections.disconnect(alias)
