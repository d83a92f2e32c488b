"""Two `memlm serve` processes (each with its ingest worker) on data directories of their
own, sharing only PostgreSQL and one Milvus collection (issue 32, item 6): documents
ingested through both while clients predict through both. The concurrency oracle: no
5xx, every stored key is its own document's (a clean re-encode), and the statistics each
API shows equal what the collection holds."""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from memlm.memory import open_milvus
from tests.processes import TEST_TOKENS, free_port, memlm_env, start_memlm, stop
from tests.service_helpers import ADMIN, INGEST, doc, make_settings, predicting
from tests.texts import random_text

pytestmark = [pytest.mark.postgres, pytest.mark.milvus]


def api_env(data_dir: Path, db_url: str, memory_url: str) -> dict[str, str]:
    """``memlm serve`` with its embedded worker (FullMem) on ``data_dir``, the shared
    database and the shared Milvus memory."""
    return memlm_env(
        **TEST_TOKENS,
        MEMLM_ENV="test",
        MEMLM_DATA_DIR=str(data_dir),
        MEMLM_DATABASE_URL=db_url,
        MEMLM_MEMORY_URL=memory_url,
        MEMLM_EMBEDDED_WORKER="true",
        MEMLM_POLICY="fullmem",
        MEMLM_WORKER_POLL_SECONDS="0.2",
        MEMLM_INDEX_POLL_SECONDS="3600",
        MEMLM_PROTECT_READ="false",
        MEMLM_PRECISION="float32",
        MEMLM_DEVICE="cpu",
    )


@contextlib.contextmanager
def api_processes(envs: list[dict[str, str]], logs: Path) -> Iterator[list[str]]:
    """One ``memlm serve`` per environment; yields their base URLs once all are ready."""
    procs: list[tuple[subprocess.Popen[str], str]] = []
    files = contextlib.ExitStack()
    try:
        for i, env in enumerate(envs):
            port = free_port()
            log = files.enter_context((logs / f"serve-{i}.log").open("w"))
            procs.append((start_memlm(["serve", "--port", str(port)], env, log), str(port)))
        bases = [f"http://127.0.0.1:{port}" for _, port in procs]
        deadline = time.monotonic() + 120
        for (proc, _), base in zip(procs, bases, strict=True):
            while True:
                assert proc.poll() is None, [f.read_text()[-3000:] for f in logs.glob("*.log")]
                assert time.monotonic() < deadline, "memlm serve not ready in 120 s"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                        break
                time.sleep(0.3)
        yield bases
    finally:
        for proc, _ in procs:
            stop(proc)
        files.close()


def test_two_api_processes_share_postgres_and_milvus(
    tmp_path: Path, pg_url: str, milvus_url: str
) -> None:
    rng = random.Random(11)
    texts = [random_text(rng, rng.randint(80, 240)) for _ in range(16)]
    contexts = [random_text(rng, 300) for _ in range(6)]
    envs = [api_env(tmp_path / d, pg_url, milvus_url) for d in ("a", "b")]
    with api_processes(envs, tmp_path) as bases:
        ids: list[int] = []
        with httpx.Client(timeout=60) as c:
            for i, base in enumerate(bases):  # half the documents through each API
                part = texts[i::2]
                r = c.post(
                    f"{base}/ingest",
                    headers=INGEST,
                    json={
                        "documents": [doc(t, external_id=f"{i}-{j}") for j, t in enumerate(part)]
                    },
                )
                assert r.status_code == 202, r.text
                ids += [d["id"] for d in r.json()["documents"]]
        by_id = dict(zip(ids, texts[0::2] + texts[1::2], strict=True))

        with predicting(bases, contexts) as statuses:
            deadline = time.monotonic() + 120
            with httpx.Client(timeout=60) as c:
                while time.monotonic() < deadline:
                    rows = [
                        c.get(f"{bases[i % 2]}/documents/{i}", headers=ADMIN).json() for i in ids
                    ]
                    if all(r["status"] in ("done", "failed") for r in rows):
                        break
                    time.sleep(0.3)
                # the last documents' entries are searched through both APIs meanwhile
                time.sleep(1.0)
        with httpx.Client(timeout=60) as c:
            stats = [c.get(f"{b}/admin/stats", headers=ADMIN).json() for b in bases]
    # 429: the admission control's answer (a full queue, or the first requests being
    # timed), with a Retry-After; a 5xx is a failure
    failed = [s for s in statuses if s >= 500]
    print(f"predicts: {len(statuses)}, 429: {statuses.count(429)}, 5xx: {len(failed)}")
    assert [r["status"] for r in rows] == ["done"] * len(ids)
    assert failed == [] and set(statuses) <= {200, 429} and statuses.count(200) > 0

    # every stored key is its own document's, as one process encodes it alone
    from memlm.engine import open_engine

    reader = make_settings(tmp_path / "c", pg_url, model="tiny-llama", memory_url=milvus_url)
    engine: Any = open_engine(reader, writer=False)
    mem = open_milvus(milvus_url, None)
    try:
        wrong = []
        for row in rows:
            clean = engine.encoder.encode_ids(
                engine.encoder.tokenize(by_id[row["id"]]), engine.window
            )
            got = mem.collection.query(
                f"doc_id == {row['id']}",
                output_fields=["position", "key"],
                consistency_level="Strong",
            )
            got.sort(key=lambda r: int(r["position"]))
            assert [int(r["position"]) for r in got] == list(range(1, len(clean) + 1))
            assert row["tokens_stored"] == len(clean)
            keys = np.array([r["key"] for r in got], np.float32)
            if not np.allclose(keys, clean.keys.astype(np.float32), atol=2e-3, rtol=2e-3):
                wrong.append(row["id"])
        assert wrong == []
        stored = sum(r["tokens_stored"] for r in rows)
        assert mem.count() == stored
        for s in stats:  # what each API shows is what the collection holds
            assert (s["entries"], s["tokens_stored"]) == (stored, stored), s
    finally:
        mem.close()
        engine.close()
