"""Ingest throughput with 1 and with N `memlm worker` processes on one data directory.

For each configuration: a fresh data directory and a fresh PostgreSQL schema (or SQLite
file), the workers started and polling first (model load not timed), then the same news
articles queued at once; timed until every article is `done`. Configurations alternate
(1, N, 1, N, ...) so a change in the machine's load hits both; the best repetition of
each is reported, with the worst beside it.

    python benchmarks/bench_workers.py --docs 12 --workers 1,2 --repeat 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import alternating, load_average, markdown_table
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_database(kind: str) -> tuple[str, Any]:
    """A migrated empty database URL and a cleanup function."""
    from memlm.db.migrate import upgrade

    if kind == "sqlite":
        path = Path(tempfile.mkdtemp(prefix="bench-workers-db-")) / "memlm.sqlite"
        url = f"sqlite:///{path}"
        upgrade(url)
        return url, lambda: None
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_SERVER)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG_SERVER}?options=-csearch_path%3D{schema}"
    upgrade(url)

    def drop() -> None:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    return url, drop


def run_once(n_workers: int, args: argparse.Namespace, docs: list[Any]) -> dict[str, float]:
    from memlm.db.models import Document
    from memlm.db.repositories import DocumentRepository, NewDocument
    from memlm.db.session import make_engine, make_sessionmaker
    from memlm.locks import held_elsewhere

    url, drop = fresh_database(args.db)
    data = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    env = {
        **os.environ,
        "MEMLM_DATA_DIR": str(data),
        "MEMLM_DATABASE_URL": url,
        "MEMLM_MODEL": args.model,
        "MEMLM_THREADS": str(args.threads),
        "MEMLM_WORKER_POLL_SECONDS": "0.2",
        "MEMLM_LOG_LEVEL": "WARNING",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "memlm.cli", "worker"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n_workers)
    ]
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    try:
        deadline = time.monotonic() + 600
        while sum(held_elsewhere(f) for f in (data / "workers").glob("*.lock")) < n_workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(
                    "workers did not start: "
                    + "".join(p.stderr.read() for p in procs if p.stderr and p.poll() is not None)
                )
            time.sleep(0.2)
        t0 = time.perf_counter()
        with sessions.begin() as s:
            ids = [
                a.id
                for a in DocumentRepository(s).add_many(
                    NewDocument(
                        text=d.text, published_at=d.published_at, source=d.source, title=d.title
                    )
                    for d in docs
                )
            ]
        while True:
            with sessions() as s:
                rows = [s.get(Document, i) for i in ids]
                if all(r is not None and r.status in ("done", "failed") for r in rows):
                    seconds = time.perf_counter() - t0
                    tokens = sum(r.tokens_seen or 0 for r in rows if r is not None)
                    stored = sum(r.tokens_stored or 0 for r in rows if r is not None)
                    failed = sum(r.status == "failed" for r in rows if r is not None)
                    break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
        db.dispose()
        drop()
    from memlm.datastore import Datastore

    with Datastore.open(data / "memory" / "datastore", readonly=True) as ds:
        entries = len(ds)
    shutil.rmtree(data, ignore_errors=True)
    if entries != stored:
        raise SystemExit(
            f"{n_workers} worker(s): datastore holds {entries}, documents say {stored}"
        )
    return {"seconds": seconds, "tokens": tokens, "stored": stored, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--docs", type=int, default=12, help="news articles ingested per run")
    ap.add_argument("--workers", default="1,2", help="worker counts to compare")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    args = ap.parse_args()

    from memlm.corpus import load_news

    docs = [d for d in load_news() if d.published_at >= dt.date(2017, 2, 13)][: args.docs]
    counts = [int(x) for x in args.workers.split(",")]
    load_before = load_average()

    def progress(rep: int, n: int, r: dict[str, float]) -> None:
        print(
            f"repetition {rep + 1}, {n} worker(s): {r['tokens']:.0f} tokens in "
            f"{r['seconds']:.1f} s ({r['tokens'] / r['seconds']:.0f} tokens/s)",
            flush=True,
        )

    results = alternating(counts, args.repeat, lambda n: run_once(n, args, docs), report=progress)
    base = max(r["tokens"] / r["seconds"] for r in results[counts[0]])
    print()
    print(f"model {args.model}, {args.threads} thread(s) per worker, database {args.db}")
    print(
        f"{len(docs)} news articles from 2017-02-13, {results[counts[0]][0]['tokens']:.0f} "
        f"tokens, MoNIM; {args.repeat} alternating repetitions, best (worst) shown"
    )
    print(f"load average before: {load_before}; after: {load_average()}; cores: {os.cpu_count()}")
    print()
    table = []
    for n in counts:
        rates = [r["tokens"] / r["seconds"] for r in results[n]]
        best = max(range(len(rates)), key=rates.__getitem__)
        r = results[n][best]
        table.append(
            (
                n,
                f"{r['seconds']:.1f} ({max(x['seconds'] for x in results[n]):.1f})",
                f"{rates[best]:.0f} ({min(rates):.0f})",
                f"{rates[best] / base:.2f}x",
                f"{r['stored']:.0f}",
                f"{r['failed']:.0f}",
            )
        )
    header = ["workers", "seconds", "tokens/s", "vs 1 worker", "entries stored (= datastore)"]
    print(markdown_table([*header, "failed"], table, align="rrrrrr"))


if __name__ == "__main__":
    main()
