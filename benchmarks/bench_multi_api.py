"""POST /predict requests/s with one and with two API processes (issue 32, item 6).

Each API is ``memlm serve`` with its embedded ingest worker on a data directory of its
own; the processes of one configuration share only a PostgreSQL schema and a Milvus
collection (both made fresh per configuration and dropped at the end). A few news
articles are memorised through the first API, then ``--clients`` clients (one asyncio
loop, hand-written keep-alive HTTP/1.1: ``bench_load.Conn``), spread round-robin over the
APIs, send /predict with ~128-token news contexts for ``--duration`` s, honouring
Retry-After after a 429. Prints, per configuration: 200s, 429s, other answers, 200s per
second, p50 / p99 latency of the 200s, and the load average (the machine is shared).

    MEMLM_TEST_MILVUS=127.0.0.1:19530 python benchmarks/bench_multi_api.py \\
        --clients 8 --duration 30 --apis 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

from _common import load_average, markdown_table, percentile
from bench_load import CONTEXT_CHARS, ROOT, Conn, Server, memorise, wait_ready

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_schema() -> tuple[str, str]:
    """(schema, URL whose connections use it)."""
    from sqlalchemy import create_engine, text

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    eng = create_engine(PG)
    with eng.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    eng.dispose()
    return schema, f"{PG}?options=-csearch_path%3D{schema}"


def drop_schema(schema: str) -> None:
    from sqlalchemy import create_engine, text

    eng = create_engine(PG)
    with eng.begin() as c:
        c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    eng.dispose()


async def load(
    bases: list[str], bodies: list[bytes], clients: int, duration: float
) -> dict[str, Any]:
    conns = []
    for k in range(clients):
        host, port = bases[k % len(bases)].removeprefix("http://").split(":")
        conns.append(Conn(host, int(port)))
    lat: list[float] = []
    codes: dict[int, int] = {}
    t0 = time.monotonic()
    stop = t0 + duration
    last = [t0]

    async def one(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            s = time.monotonic()
            try:
                code, headers = await conns[k].send("POST", "/predict", bodies[i % len(bodies)])
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                code, headers = 0, {}
                conns[k].close()
            i += clients
            e = time.monotonic()
            last[0] = max(last[0], e)
            codes[code] = codes.get(code, 0) + 1
            if code == 200:
                lat.append(e - s)
            elif code == 429:
                wait = int(headers.get("retry-after", "1"))
                await asyncio.sleep(min(wait, max(0.0, stop - time.monotonic())))

    await asyncio.gather(*(one(k) for k in range(clients)))
    for c in conns:
        c.close()
    seconds = last[0] - t0
    ok = codes.pop(200, 0)
    return {
        "200": ok,
        "429": codes.pop(429, 0),
        "other": sum(codes.values()),
        "requests/s": ok / seconds,
        "p50 ms": 1000 * percentile(lat, 50) if lat else float("nan"),
        "p99 ms": 1000 * percentile(lat, 99) if lat else float("nan"),
        "load": load_average(),
    }


async def configuration(
    n: int, args: argparse.Namespace, bodies: list[bytes], docs: list[Any]
) -> dict[str, Any]:
    import httpx

    from memlm.memory import open_milvus

    schema, db_url = fresh_schema()
    memory_url = f"milvus://{args.milvus}/bench_multi_{uuid.uuid4().hex[:10]}"
    servers = []
    try:
        for i in range(n):
            s = Server(ROOT, args, f"{n}api-{i}")
            s.env.update(
                MEMLM_DATABASE_URL=db_url,
                MEMLM_MEMORY_URL=memory_url,
                MEMLM_PRECISION="float32",
                MEMLM_DEVICE="cpu",
            )
            s.start()
            servers.append(s)
        bases = [f"http://127.0.0.1:{s.port}" for s in servers]
        for s, base in zip(servers, bases, strict=True):
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                await wait_ready(client, s)
        async with httpx.AsyncClient(base_url=bases[0], timeout=600) as client:
            await memorise(client, docs)
        for base in bases:  # warm-up: the admission control times its first requests
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                for b in bodies[:3]:
                    (
                        await client.post(
                            "/predict", content=b, headers={"Content-Type": "application/json"}
                        )
                    ).raise_for_status()
        row = await load(bases, bodies, args.clients, args.duration)
        return {"API processes": n, "clients": args.clients, **row}
    finally:
        for s in servers:
            s.stop()
        drop_schema(schema)
        mem = open_milvus(memory_url, None)
        mem.drop()
        mem.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--apis", default="1,2", help="API processes per configuration")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--docs", type=int, default=3, help="news articles memorised first")
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--milvus", default=os.environ.get("MEMLM_TEST_MILVUS", "127.0.0.1:19530"))
    args = ap.parse_args()
    args.budget = None  # bench_load.Server's options
    from memlm.corpus import load_news

    news = load_news()
    docs, rest = news[: args.docs], news[args.docs :]
    bodies = []
    for d in rest:
        if len(d.text) >= CONTEXT_CHARS:
            cut = d.text[:CONTEXT_CHARS]
            bodies.append(json.dumps({"context": cut[: cut.rfind(" ")]}).encode())
    print(f"# load average before: {load_average()}; {os.cpu_count()} cores", flush=True)
    rows = []
    for n in [int(x) for x in args.apis.split(",")]:
        rows.append(asyncio.run(configuration(n, args, bodies, docs)))
        print(rows[-1], flush=True)
    cols = list(rows[0])
    cells = [
        [f"{v:.1f}" if isinstance(v, float) else v for v in (r[c] for c in cols)] for r in rows
    ]
    print(
        f"\nmodel {args.model}, {args.threads} torch thread(s) per process, {args.duration:g} s, "
        f"PostgreSQL + Milvus shared, Retry-After honoured"
    )
    print(markdown_table(cols, cells, align="r" * (len(cols) - 1) + "l"))


if __name__ == "__main__":
    main()
