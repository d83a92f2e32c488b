"""What the benchmark scripts share: the machine's state, timing, "same run, interleaved", tables.

Every script under ``benchmarks/`` runs as ``python benchmarks/NAME.py`` (its folder is
then ``sys.path[0]``), so it imports this module as ``from _common import ...``:

    from _common import interleaved, load_average, markdown_table, stats_ms, stopwatch

    print(f"load average before: {load_average()}")
    with stopwatch() as t:                     # one timed block
        build()
    print(f"built in {t.seconds:.1f} s")

    # paths compared side by side in one run: round i calls every path once, so a change
    # in the machine's load hits every row alike (never a timed assertion in a test)
    times = interleaved({"old": old, "new": new}, rounds=50, warmup=5)   # seconds per call
    rows = [(name, *stats_ms(s).values()) for name, s in times.items()]
    print(markdown_table(["path", "p50 ms", "p99 ms", "mean ms", "max ms"], rows))

    # whole configurations (a fresh process or data directory each) alternated A, B, A, B
    results = alternating([1, 2], repeat=2, run=lambda n: run_once(n))

The API, all of it:

- :func:`load_average`: ``"0.52 0.61 0.70"`` (1, 5, 15 min): print it before and after;
- :func:`free_port`: a free TCP port on 127.0.0.1 for a server started by the benchmark;
- :func:`stopwatch`: ``with stopwatch() as t: ...`` then ``t.seconds`` (``perf_counter``);
- :func:`interleaved`: per-call seconds of several paths, called in turn round by round;
- :func:`best_of`: the fastest of ``interleaved``'s samples per path (throughput rows);
- :func:`alternating`: results of whole runs of several configurations, alternated;
- :func:`percentile` and :func:`stats_ms`: p50 / p99 / mean / max of samples;
- :func:`mean_sd`: mean and sample standard deviation (over seeds);
- :func:`recall`: the share of the exact top-k ids a search found;
- :func:`markdown_table`: one Markdown table, numbers right-aligned;
- :func:`open_served_engine`: settings over a fresh data directory and SQLite database,
  migrated, and the engine the service would open on them;
- :func:`memorise`: queue documents and let an in-process ingest worker memorise them
  and build the index (what a served engine holds before it is timed); :func:`rebuild`:
  one more build;
- :func:`serving`: ``with serving(app) as base_url:`` a real uvicorn in a thread;
- :func:`hf_generate`: greedy tokens of the bare LM by Hugging Face ``generate`` (the
  baseline /generate's rows are compared with).
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; a server binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Stopwatch:
    """Seconds between entering and leaving a ``with stopwatch()`` block."""

    start: float
    seconds: float = 0.0

    @property
    def ms(self) -> float:
        return self.seconds * 1000


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """Time the block with ``time.perf_counter``; ``.seconds`` is set when it ends."""
    sw = Stopwatch(time.perf_counter())
    try:
        yield sw
    finally:
        sw.seconds = time.perf_counter() - sw.start


def interleaved(
    paths: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 0,
    before_round: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each path, ``rounds`` samples each, the paths interleaved.

    Round i calls ``before_round()`` (e.g. to pick the round's input, so every path sees
    the same one) and then every path once, in order; ``warmup`` rounds run first,
    untimed.  A change in the machine's load during the run thus hits every path alike.
    """
    for _ in range(warmup):
        if before_round is not None:
            before_round()
        for fn in paths.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        if before_round is not None:
            before_round()
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t)
    return out


def best_of(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The fastest sample of each path (``interleaved``'s output): the least disturbed."""
    return {name: min(s) for name, s in samples.items()}


def alternating(
    configs: Sequence[K],
    repeat: int,
    run: Callable[[K], R],
    *,
    report: Callable[[int, K, R], None] | None = None,
) -> dict[K, list[R]]:
    """``run(config)`` for every config, ``repeat`` times, alternated (A, B, A, B, ...).

    For configurations that need a whole run each (processes, data directories): a change
    in the machine's load during the benchmark hits every configuration.  ``report(rep,
    config, result)`` is called after each run (progress lines).
    """
    out: dict[K, list[R]] = {c: [] for c in configs}
    for rep in range(repeat):
        for c in configs:
            result = run(c)
            out[c].append(result)
            if report is not None:
                report(rep, c, result)
    return out


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (1..99, inclusive method); NaN when empty, the value when one."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    """``{"p50", "p99", "mean", "max"}`` of samples in seconds, in milliseconds."""
    if not seconds:
        return dict.fromkeys(("p50", "p99", "mean", "max"), float("nan"))
    ms = [s * 1000 for s in seconds]
    return {
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms),
        "max": max(ms),
    }


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def recall(found: Any, truth: Any) -> float:
    """Share of the exact top-k ids ``truth`` (nq, k) that a search found (``found``
    (nq, k'), -1 for no neighbour), over all queries."""
    import numpy as np

    hits = sum(len(np.intersect1d(f[f >= 0], t)) for f, t in zip(found, truth, strict=True))
    return hits / np.asarray(truth).size


def _cell(x: object, digits: int) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    align: str | None = None,
    digits: int = 1,
) -> str:
    """A Markdown table; floats get ``digits`` decimals, other cells ``str()``.

    ``align``: one letter per column, ``l`` or ``r``; by default the first column is
    left-aligned and the others right-aligned (names, then numbers).  Cells are padded so
    that the table also reads as plain text.
    """
    body = [[_cell(x, digits) for x in row] for row in rows]
    n = len(header)
    if any(len(r) != n for r in body):
        raise ValueError(f"every row needs {n} cells")
    align = align or "l" + "r" * (n - 1)
    if len(align) != n or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l'/'r' per column, got {align!r}")
    width = [max(3, len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(cells, width, align, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            "-" * (w + 2) if a == "l" else "-" * (w + 1) + ":"
            for w, a in zip(width, align, strict=True)
        )
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in body)])


def open_served_engine(
    prefix: str, *, writer: bool = True, **settings: Any
) -> tuple[Any, Any, float]:
    """``(settings, engine, seconds to open it)`` over a fresh temp data directory.

    ``settings``: ``memlm.settings.Settings`` fields (model, threads, policy...; a
    ``data_dir`` of its own to serve an existing memory); the index is not polled and no
    worker runs beside the API unless they say otherwise. ``writer=False`` opens the
    engine read-only, as an API whose workers are other processes.
    """
    import tempfile
    from pathlib import Path

    from memlm.db.migrate import upgrade
    from memlm.engine import open_engine
    from memlm.settings import Settings

    fields: dict[str, Any] = {
        "data_dir": Path(tempfile.mkdtemp(prefix=f"{prefix}-")),
        "index_poll_seconds": 3600,
        "embedded_worker": False,
        **settings,
    }
    config = Settings(_env_file=None, **fields)  # type: ignore[call-arg]
    upgrade(config.db_url)
    with stopwatch() as t:
        engine = open_engine(config, writer=writer)
    return config, engine, t.seconds


def memorise(engine: Any, settings: Any, docs: Iterable[Any], *, build: bool = True) -> float:
    """Queue ``docs`` (``memlm.corpus.Document``), memorise them with an in-process ingest
    worker (the settings' policy), then build the index unless ``build`` is False;
    returns the seconds it took."""
    from memlm.db.repositories import BuildRepository, DocumentRepository, NewDocument

    with _worker(engine, settings) as (worker, sessions):
        with sessions.begin() as s:
            DocumentRepository(s).add_many(
                NewDocument(
                    text=d.text, published_at=d.published_at, source=d.source, title=d.title
                )
                for d in docs
            )
        with stopwatch() as t:
            while worker.step() is not None:
                pass
            if build:
                with sessions.begin() as s:
                    BuildRepository(s).request(None, "bench")
                worker.step()
    return t.seconds


def rebuild(engine: Any, settings: Any) -> float:
    """One build requested as ``POST /admin/rebuild`` would, run by an in-process worker."""
    from memlm.db.repositories import BuildRepository

    with _worker(engine, settings) as (worker, sessions), stopwatch() as t:
        with sessions.begin() as s:
            BuildRepository(s).request(None, "bench")
        worker.step()
    return t.seconds


@contextmanager
def _worker(engine: Any, settings: Any) -> Iterator[tuple[Any, Any]]:
    """An in-process ingest worker on the settings' database, and its session factory."""
    from memlm.db.session import make_engine, make_sessionmaker
    from memlm.engine import policy_factory
    from workers.ingest import IngestWorker

    db = make_engine(settings.db_url)
    sessions = make_sessionmaker(db)
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    worker.start(timeout=5)
    try:
        yield worker, sessions
    finally:
        worker.lock.release()
        db.dispose()


@contextmanager
def serving(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """``app`` served by uvicorn from a daemon thread on a free port: yields its base URL."""
    import uvicorn

    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def hf_generate(encoder: Any, ids: Sequence[int], n: int) -> list[int]:
    """Exactly ``n`` greedy new tokens of ``encoder``'s model after ``ids`` by Hugging Face
    ``generate`` (attention cache on, no end-of-text stop): the bare LM's generation, the
    baseline of the ``/generate`` rows."""
    import torch

    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        out = encoder.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=encoder.tokenizer.eos_token_id,
        )
    return [int(t) for t in out[0, x.shape[1] :]]
