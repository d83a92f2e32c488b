"""One live ``memlm up`` for the tests of the OpenAI-compatible API and of
lm-evaluation-harness against it: started once per session (a subprocess, the tiny random
Llama, reads protected by a read token), with one news sentence memorised."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.processes import free_port, memlm_env, start_memlm, stop

MODEL = "tiny-llama"
READ_TOKEN = "read-token-for-the-openai-tests-0001"
INGEST_TOKEN = "change-me"  # the development default of `memlm up`
TEXT = (
    "The central bank of Ireland raised its key interest rate on Tuesday, citing "
    "stronger growth in Dublin and a tight labour market across the country."
)


@dataclass(frozen=True)
class LiveServer:
    url: str
    log: Path

    def read(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {READ_TOKEN}"}


@pytest.fixture(scope="session")
def memlm_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from memlm.client import Client

    tmp = tmp_path_factory.mktemp("memlm-up")
    port = free_port()
    env = memlm_env(
        MEMLM_DATA_DIR=str(tmp / "data"),
        MEMLM_INDEX_POLL_SECONDS="0.5",
        MEMLM_WORKER_POLL_SECONDS="0.2",
        MEMLM_PROTECT_READ="true",
        MEMLM_READ_TOKEN=READ_TOKEN,
        MEMLM_DATABASE_URL=None,
        MEMLM_ENV=None,
    )
    log = tmp / "up.log"
    with log.open("w") as out:
        proc = start_memlm(["up", "--port", str(port)], env, out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "memlm up not ready in 240 s"
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        with Client(url, token=INGEST_TOKEN, timeout=120) as c:
            [acc] = c.ingest([{"text": TEXT, "published_at": "2017-02-07", "source": "rte"}])
            [done] = c.wait([acc.id], timeout=120)
            assert done.status == "done", done
        yield LiveServer(url, log)
    finally:
        try:
            stop(proc)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
