"""memlm.client and `memlm ingest` against a live `memlm up` (a subprocess, tiny random
Llama): ingest, wait, predict, generate (whole and streamed), stats, rebuild, forget."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from memlm.client import Client, GeneratedTokenOut, NotFound
from tests.processes import ROOT, free_port, memlm_env

TOKEN = "change-me"  # the development default of `memlm up`
TEXT = (
    "The central bank of Ireland raised its key interest rate on Tuesday, citing "
    "stronger growth in Dublin and a tight labour market across the country."
)


def test_client_and_cli_against_memlm_up(tmp_path: Path) -> None:
    port = free_port()
    env = memlm_env(
        MEMLM_DATA_DIR=str(tmp_path / "data"),
        MEMLM_INDEX_POLL_SECONDS="0.5",
        MEMLM_WORKER_POLL_SECONDS="0.2",
        MEMLM_DATABASE_URL=None,  # the embedded SQLite of the data directory
        MEMLM_ENV=None,
    )
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed in the finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", "up", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.5)
        docs = tmp_path / "docs.jsonl"
        docs.write_text(
            json.dumps({"text": TEXT, "published_at": "2017-02-07", "source": "rte", "id": "r1"})
            + "\n"
        )
        cli = subprocess.run(
            [sys.executable, "-m", "memlm.cli", "ingest", str(docs), "--wait", "--url", url],
            env={**env, "MEMLM_TOKEN": TOKEN, "COLUMNS": "200"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli.returncode == 0, cli.stderr + cli.stdout
        assert "1 new, 0 already there" in cli.stdout and "processed: 1 done" in cli.stdout

        with Client(url, token=TOKEN, timeout=120) as c:
            again = c.ingest([{"text": TEXT, "published_at": "2017-02-07", "source": "rte",
                               "external_id": "r1"}])  # fmt: skip
            assert [(a.id, a.duplicate) for a in again] == [(1, True)]
            [done] = c.wait([1], timeout=120)
            assert done.status == "done" and done.external_id == "r1"
            assert c.stats().entries == done.tokens_stored
            pred = c.predict("The central bank of Ireland raised", neighbours=1)
            assert pred.neighbours[0].document_id == 1
            gen = c.generate("The central bank of Ireland", max_tokens=6, neighbour=True)
            assert gen.text.startswith(" raised its key")
            assert gen.tokens[0].neighbour is not None and gen.tokens[0].neighbour.document_id == 1
            events = list(c.generate_stream("The central bank of Ireland", max_tokens=6))
            tokens = [e for e in events if isinstance(e, GeneratedTokenOut)]
            assert "".join(t.text for t in tokens) == gen.text and len(events) == 7
            build = c.rebuild(key="client-up", wait=True, timeout=240)
            assert build.status == "done" and build.version is not None
            forgotten = c.forget(1)
            assert forgotten.id == 1
            try:
                c.forget(99)
            except NotFound as e:
                assert e.body["error"] == "not_found"
            else:
                raise AssertionError("forgetting an unknown document must raise NotFound")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
