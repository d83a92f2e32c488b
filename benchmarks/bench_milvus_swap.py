"""POST /predict while a build re-creates the Milvus index: failed requests and latency
during the switch against before and after it.

One served app (a real uvicorn, the engine of ``--model``) over a Milvus memory of
``--entries`` random keys of the model's width (put straight into the memory, as
documents of 10,000 entries), unbuilt: a FLAT index. ``--clients`` threads POST
``/predict`` without pause for ``--outside`` seconds, then while ``engine.rebuild``
(what the builder thread runs) re-creates the index (FLAT -> IVF_PQ, the size's
parameters; ``--retrain`` builds once more, IVF_PQ -> IVF_PQ trained again), then
``--outside`` seconds more (a build that fails is reported, and the run goes on). Each answer is counted in the phase it ended in: a 5xx (or
any answer but 200 and 429) is a failure; a 429 (admission under load) is counted
apart, and the client waits its Retry-After (at most 1 s), as a client should.

    MEMLM_THREADS=1 python benchmarks/bench_milvus_swap.py --milvus 127.0.0.1:19530 \\
        --entries 60000 --clients 4 --outside 20

The same script in a checkout of another commit measures that commit (it puts its own
checkout first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import load_average, markdown_table, percentile, serving

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's memlm and service, not an installed copy

CONTEXTS = [
    "The harbour authority said on Monday that the new ferry routes would",
    "Shares in the company fell sharply after the chief executive told investors that",
    "The council voted to close the library, and residents who had campaigned for",
    "Scientists at the university found that the number of birds nesting on the",
    "The minister told parliament that the government had no plans to raise",
    "After three days of talks, the unions and the employers agreed to",
    "The storm brought down power lines across the north of the country, and",
    "Police said the man, who was arrested at the airport on Friday, had",
]


class Hammer:
    """``clients`` threads POSTing /predict until stopped; every answer timed."""

    def __init__(self, base: str, clients: int) -> None:
        self.base = base
        self.answers: list[tuple[float, float, int]] = []  # (ended, seconds, status)
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        import httpx

        with httpx.Client(base_url=self.base, timeout=120) as c:
            n = i
            while not self.stop.is_set():
                body = {"context": CONTEXTS[n % len(CONTEXTS)], "top_n": 5}
                n += 1
                t = time.perf_counter()
                r = c.post("/predict", json=body)
                end = time.perf_counter()
                with self.lock:
                    self.answers.append((end, end - t, r.status_code))
                    if r.status_code not in (200, 429) and len(self.errors) < 5:
                        self.errors.append(f"{r.status_code} {r.text[:200]}")
                if r.status_code == 429:
                    time.sleep(min(1.0, float(r.headers.get("Retry-After", "1"))))

    def __enter__(self) -> Hammer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def phase_row(name: str, answers: list[tuple[float, float, int]], a: float, b: float) -> list[Any]:
    got = [x for x in answers if a <= x[0] < b]
    ok = [x[1] * 1000 for x in got if x[2] == 200]
    failed = sum(x[2] not in (200, 429) for x in got)
    refused = sum(x[2] == 429 for x in got)
    return [
        name,
        round(b - a, 1),
        len(got),
        failed,
        refused,
        percentile(ok, 50),
        percentile(ok, 99),
        max(ok, default=float("nan")),
    ]


def prefill(memory: Any, entries: int, seed: int) -> None:
    """``entries`` random keys (10,000 a document) with random next tokens."""
    rng = np.random.default_rng(seed)
    dim = memory.dim
    for doc, a in enumerate(range(0, entries, 10_000), start=1):
        n = min(10_000, entries - a)
        keys = rng.standard_normal((n, dim)).astype(np.float32)
        memory.put_document(doc, keys, rng.integers(0, 30_000, n), np.arange(n), 17_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--milvus", default="127.0.0.1:19530", help="host:port of the server")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--entries", type=int, default=60_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--outside", type=float, default=20.0, help="seconds before and after")
    ap.add_argument("--retrain", action="store_true", help="a second, retraining build")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", "1")))
    ap.add_argument("--keep", action="store_true", help="keep the collection afterwards")
    args = ap.parse_args()

    from _common import open_served_engine

    from service.app import create_app

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    name = f"bench_swap_{os.getpid()}"
    url = f"milvus://{args.milvus}/{name}?timeout=600"
    print(f"# commit {commit or '?'} ({ROOT}); {url}; load average {load_average()}", flush=True)
    settings, engine, opened = open_served_engine(
        "bench-swap", model=args.model, memory_url=url, threads=args.threads
    )
    print(f"# engine opened in {opened:.1f} s; prefilling {args.entries:,} entries", flush=True)
    t = time.perf_counter()
    prefill(engine.memory, args.entries, seed=0)
    print(f"# prefilled in {time.perf_counter() - t:.1f} s: {engine.memory.count():,} entries")
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    rows: list[list[Any]] = []
    builds: list[dict[str, Any]] = []
    try:
        with serving(app) as base:
            import httpx

            with httpx.Client(base_url=base, timeout=120) as c:  # the admission times one
                assert c.post("/predict", json={"context": CONTEXTS[0]}).status_code == 200
            with Hammer(base, args.clients) as h:
                t0 = time.perf_counter()
                time.sleep(args.outside)
                marks = [("before", t0, time.perf_counter())]
                for i, retrain in enumerate([False] + ([True] if args.retrain else [])):
                    a = time.perf_counter()
                    try:
                        info = engine.rebuild(retrain=retrain)
                        done: dict[str, Any] = info.record()
                    except Exception as exc:  # noqa: BLE001 - a failed build is a result too
                        done = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    b = time.perf_counter()
                    marks.append((f"during build {i + 1}", a, b))
                    builds.append({"seconds": round(b - a, 1), **done})
                    print(f"# build {i + 1}: {builds[-1]}", flush=True)
                a = time.perf_counter()
                time.sleep(args.outside)
                marks.append(("after", a, time.perf_counter()))
            rows = [phase_row(n, h.answers, a, b) for n, a, b in marks]
            errors = h.errors
    finally:
        if not args.keep:
            engine.memory.drop()
        engine.memory.close()
    print()
    print(
        markdown_table(
            ["phase", "s", "requests", "failed", "429", "p50 ms", "p99 ms", "max ms"], rows
        )
    )
    print(f"\n# load average after: {load_average()}")
    for e in errors:
        print(f"# a failed answer: {e}")


if __name__ == "__main__":
    main()
