"""How long `memlm backup` pauses ingest, against real `memlm worker` processes.

A fresh data directory and database (PostgreSQL schema or SQLite file), N worker
processes polling, D documents queued at once; while they ingest, this process takes a
backup after another (as `memlm backup` would, from its own process) and reads from each
backup's manifest how long it held the datastore's write lock (``paused_ingest_seconds``:
the longest any worker's append-and-commit step waited for it), and how long the whole
backup took (copying happens outside the lock).

    python benchmarks/bench_backup.py --db postgresql --workers 2 --docs 120
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import load_average, markdown_table, stats_ms, stopwatch
from bench_workers import fresh_database

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", choices=["sqlite", "postgresql"], default="postgresql")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()

    from memlm.backup import backup
    from memlm.db.repositories import DocumentRepository, NewDocument
    from memlm.db.session import make_engine, make_sessionmaker
    from memlm.settings import Settings

    print(f"load average before: {load_average()}")
    url, drop = fresh_database("sqlite" if args.db == "sqlite" else "pg")
    data = Path(tempfile.mkdtemp(prefix="bench-backup-"))
    env = {
        **os.environ,
        "MEMLM_ENV": "development",
        "MEMLM_MODEL": args.model,
        "MEMLM_DATA_DIR": str(data / "data"),
        "MEMLM_DATABASE_URL": url,
        "MEMLM_THREADS": "1",
        "MEMLM_WORKER_POLL_SECONDS": "0.2",
        "MEMLM_POLICY": "fullmem",
        "MEMLM_PRECISION": "float32",
    }
    settings = Settings(_env_file=None, data_dir=data / "data", database_url=url)  # type: ignore[call-arg]
    sessions = make_sessionmaker(make_engine(url))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "memlm.cli", "worker"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(args.workers)
    ]
    paused: list[float] = []
    took: list[float] = []
    done_at: list[int] = []
    try:
        with sessions.begin() as s:
            DocumentRepository(s).add_many(
                NewDocument(
                    text=f"Report {i}: the harbour authority in Port {i} announced {i + 3} new "
                    f"ferry routes for the summer, and the council said pier {i} would reopen "
                    "in May after repairs costing several million.",
                    published_at=dt.date(2017, 2, 7),
                    source="bench",
                )
                for i in range(args.docs)
            )
        while True:  # the first document done: the workers are up (model load not timed)
            with sessions() as s:
                counts = DocumentRepository(s).counts_by_status()
            if counts.get("done"):
                break
            time.sleep(0.2)
        n = 0
        while counts.get("pending", 0) + counts.get("processing", 0):
            dest = data / f"backup-{n}"
            with stopwatch() as t:
                m = backup(settings, dest)
            paused.append(m.paused_ingest_seconds)
            took.append(t.seconds)
            done_at.append(m.memory["entries"])
            shutil.rmtree(dest)
            n += 1
            with sessions() as s:
                counts = DocumentRepository(s).counts_by_status()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        drop()
        shutil.rmtree(data, ignore_errors=True)
    print(
        f"{len(paused)} backups while {args.workers} `memlm worker` processes ingested "
        f"{args.docs} documents ({args.model}, {args.db}); datastore entries in them: "
        f"{min(done_at, default=0)} to {max(done_at, default=0)}"
    )
    p, w = stats_ms(paused), stats_ms(took)
    print(
        markdown_table(
            ["", "p50 ms", "p99 ms", "mean ms", "max ms"],
            [
                ("ingest paused (write lock held)", *p.values()),
                ("whole backup", *w.values()),
            ],
        )
    )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
