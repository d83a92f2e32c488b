"""Ingest throughput without and with an index build running beside it, in one process.

One real engine and one ingest worker over a SQLite database, the datastore pre-filled
with ``--prefill`` random keys (owned by one committed placeholder document, so the
worker's start-up keeps them) so that a build takes a while. Side by side, in one run:

- ``alone``: documents memorised with no build running;
- ``build thread``: the same number of documents memorised while the builder thread
  (``workers.builder.start_builder``, what ``memlm worker`` and the API's worker run)
  builds the index; timed from the build's start to whichever ends last;
- ``inline`` (the old loop, ``--inline``): the build in the ingest step, so no document
  moves until it ends; reported as the tokens memorised during the build (none, by
  construction) and the time of a second build.

``alone`` runs before and after ``build thread`` so a change in the machine's load shows.
Tokens/s counts tokens seen (every scored token), as the worker's log does.

    MEMLM_THREADS=1 python benchmarks/bench_ingest_during_build.py --model tiny-llama
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import load_average, markdown_table, stopwatch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's memlm and workers, not an installed copy


def queue(sessions: Any, texts: list[str], tag: str) -> list[int]:
    from memlm.db.repositories import DocumentRepository, NewDocument

    with sessions.begin() as s:
        return [
            a.id
            for a in DocumentRepository(s).add_many(
                NewDocument(text=t, published_at=dt.date(2017, 2, 7), source=tag) for t in texts
            )
        ]


def ingest(worker: Any, n: int, until: Any = None) -> tuple[int, int, float]:
    """Step until ``n`` documents are done (and ``until()`` is true); (docs, tokens, s)."""
    from workers.ingest import Processed

    docs, tokens = 0, 0
    with stopwatch() as t:
        while docs < n or (until is not None and not until()):
            out = worker.step(build=False)
            if isinstance(out, Processed) and out.status == "done":
                docs, tokens = docs + 1, tokens + out.tokens_seen
            elif out is None:
                time.sleep(0.01)
    return docs, tokens, t.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--docs", type=int, default=24, help="news articles per measured phase")
    ap.add_argument("--during", type=int, default=200, help="articles queued for the build")
    ap.add_argument("--inline", action="store_true", help="also time the old inline build")
    ap.add_argument("--prefill", type=int, default=200_000, help="random entries before")
    args = ap.parse_args()

    from memlm.corpus import load_news
    from memlm.db.migrate import upgrade
    from memlm.db.models import Document
    from memlm.db.repositories import BuildRepository
    from memlm.db.session import make_engine, make_sessionmaker
    from memlm.engine import open_engine, policy_factory
    from memlm.settings import Settings
    from workers.builder import enqueue_rebuild, run_queued_build, start_builder
    from workers.ingest import IngestWorker

    data = Path(tempfile.mkdtemp(prefix="bench-ingest-build-"))
    url = f"sqlite:///{data / 'memlm.sqlite'}"
    upgrade(url)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        data_dir=data,
        database_url=url,
        model=args.model,
        policy="fullmem",
        calibrator_training=False,
        threads=int(os.environ.get("MEMLM_THREADS", "1")),
    )
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    engine: Any = open_engine(settings)
    dim = engine.encoder.dim
    rng = np.random.default_rng(0)
    n = args.prefill
    with engine.exclusive():
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            engine.memory.datastore.append(
                rng.standard_normal((m, dim)).astype(np.float16),
                rng.integers(0, 1000, m).astype(np.int32),
                np.zeros(m, np.int64),
                np.arange(start, start + m, dtype=np.int64),
                np.full(m, 17000, np.int32),
            )
        engine.memory.index.refresh()
    with sessions.begin() as s:  # the placeholder owning the random entries
        s.add(
            Document(
                source="prefill",
                text="prefill",
                content_hash="0" * 64,
                published_at=dt.date(2017, 1, 1),
                meta={},
                status="done",
                entry_start=0,
                entry_end=n,
            )
        )
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    worker.start(timeout=5)
    # the batch memorised during the build is larger, so it cannot run dry before the end
    sizes = [args.docs, args.docs, args.during, args.docs]
    texts = [d.text for d in load_news()][: sum(sizes)]
    ends = np.cumsum([0, *sizes])
    batches = [texts[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]
    print(
        f"model {args.model} (dim {dim}), {n} prefilled entries, load {load_average()}",
        flush=True,
    )

    rows: list[tuple[str, int, int, float, float | None]] = []
    queue(sessions, batches[0], "warm")
    ingest(worker, args.docs)  # warm-up: first forwards, page cache

    def phase_alone(name: str, batch: list[str]) -> None:
        queue(sessions, batch, name)
        docs, tokens, secs = ingest(worker, len(batch))
        rows.append((name, docs, tokens, secs, None))
        print(f"{name}: {docs} documents, {tokens} tokens, {secs:.1f} s", flush=True)

    phase_alone("alone", batches[1])

    # the build in the builder thread while the worker memorises the next batch
    row, _ = enqueue_rebuild(sessions, key="bench", requested_by="bench")
    build_id = row.id

    def built() -> bool:
        with sessions() as s:
            return BuildRepository(s).get(build_id).status in ("done", "failed")

    queue(sessions, batches[2], "during")
    thread, stop = start_builder(engine, sessions, poll=0.05)
    docs, tokens, secs = ingest(worker, 1, until=built)  # as many as fit in the build
    if docs >= len(batches[2]):
        raise SystemExit(f"all {docs} articles done before the build ended: raise --during")
    stop.set()
    thread.join(60)
    with sessions() as s:
        b = BuildRepository(s).get(build_id)
        build_secs, status = float(b.seconds or 0.0), b.status
    rows.append(("build thread", docs, tokens, secs, build_secs))
    print(f"during the build ({build_secs:.1f} s): {docs} documents, {tokens} tokens", flush=True)
    phase_alone("alone again", batches[3])

    if args.inline:  # the old loop: the build is one step of the ingest loop
        enqueue_rebuild(sessions, key="bench-inline", requested_by="bench")
        with stopwatch() as t:
            run_queued_build(engine, sessions)
        inline_secs = t.seconds
        rows.append(("inline (old)", 0, 0, inline_secs, inline_secs))

    print(f"build {status}")
    table = []
    for name, docs, tokens, secs, bsecs in rows:
        rate = tokens / secs if secs else 0.0
        build_s = "" if bsecs is None else f"{bsecs:.1f}"
        table.append((name, docs, tokens, f"{secs:.1f}", f"{rate:.0f}", build_s))
    header = ["phase", "documents", "tokens", "seconds", "tokens/s", "build s"]
    print(markdown_table(header, table))
    print(f"load average after: {load_average()}")
    worker.lock.release()
    db.dispose()
    shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
