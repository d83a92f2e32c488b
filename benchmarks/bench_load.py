"""Overload of POST /predict: throughput and latency at 32, 64 and 128 concurrent clients.

Starts the API (`memlm serve`, from this checkout or another one) in a subprocess on
127.0.0.1 with a fresh data directory, memorises a few news articles through it, then
for each level runs N clients on one asyncio loop (uvloop when installed; plain HTTP/1.1
keep-alive connections written by hand, cheaper than an HTTP library) for ``--duration`` s.
Each client sends /predict with a ~128-token news context (its own article each time),
waits for the answer, and sends the next; after a 429 it sleeps the Retry-After the
server asked for (a well-behaved client), or, with ``--hammer``, retries at once. After the duration no new request is sent,
and the requests in flight are awaited (their latency counts). A prober sends
GET /healthz every 50 ms meanwhile. Between levels the server's queue drains.

Prints per level: clients, requests sent, 200s, 429s, other answers, successful
requests/s (200s over the time from the first request to the last answer), p50 / p99
latency of the 200s, p99 of /healthz, and the machine's load average.

    python benchmarks/bench_load.py                                  # tiny-gpt2, 3 x 20 s
    python benchmarks/bench_load.py --model smollm2-135m --duration 30
    python benchmarks/bench_load.py --baseline /path/to/a/checkout/of/main

``--baseline`` runs the same load against another checkout first (its own server
process, its own data directory) and prints both tables. Loopback only; the server is
stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import free_port, load_average, markdown_table, percentile

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_CHARS = 600  # about 128 tokens of English news for the bundled tokenizer
KEEP_ALIVE_S = 4.0  # reconnect after this long idle: uvicorn closes idle connections at 5 s


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Level:
    clients: int
    sent: int = 0
    ok: int = 0
    refused: int = 0
    other: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, 200s only
    health: list[float] = field(default_factory=list)
    retry_after: list[int] = field(default_factory=list)
    other_codes: dict[int, int] = field(default_factory=dict)  # status (0: no answer): count
    seconds: float = 0.0  # first request to last answer
    load: str = ""
    cpu_client: float = 0.0  # CPU seconds of this process during the level
    cpu_server: float = 0.0  # ... and of the server process

    def cells(self) -> tuple[object, ...]:
        rate = self.ok / self.seconds if self.seconds else 0.0
        ra = f"{min(self.retry_after)}-{max(self.retry_after)}" if self.retry_after else "-"
        return (
            self.clients,
            self.sent,
            self.ok,
            self.refused,
            self.other,
            f"{rate:.1f}",
            f"{percentile(self.latencies, 50) * 1000:.0f}",
            f"{percentile(self.latencies, 99) * 1000:.0f}",
            ra,
            f"{percentile(self.health, 99) * 1000:.1f}",
            f"{self.cpu_server:.1f}",
            f"{self.cpu_client:.1f}",
        )


HEADER = [
    "clients",
    "sent",
    "200",
    "429",
    "other",
    "ok/s",
    "p50 ms",
    "p99 ms",
    "Retry-After",
    "healthz p99 ms",
    "server CPU s",
    "client CPU s",
]


class Server:
    """`memlm serve` from ``checkout`` in a subprocess, on a fresh data directory."""

    def __init__(self, checkout: Path, args: argparse.Namespace, label: str) -> None:
        self.checkout = checkout
        self.port = free_port()
        self.data = Path(tempfile.mkdtemp(prefix=f"bench-load-{label}-"))
        self.env = {
            **os.environ,
            "MEMLM_DATA_DIR": str(self.data),
            "MEMLM_MODEL": args.model,
            "MEMLM_THREADS": str(args.threads),
            "MEMLM_INDEX_POLL_SECONDS": "3600",
            "MEMLM_EMBEDDED_WORKER": "true",
            "MEMLM_LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(checkout),
        }
        if args.budget is not None:
            self.env["MEMLM_QUEUE_BUDGET_S"] = str(args.budget)
        self.log = self.data / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cli = [sys.executable, "-m", "memlm.cli"]
        subprocess.run(
            [*cli, "db", "upgrade"],
            cwd=self.checkout,
            env=self.env,
            check=True,
            capture_output=True,
        )
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [*cli, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=self.checkout,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def wait_ready(client: Any, server: Server, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.proc is not None and server.proc.poll() is not None:
            raise SystemExit(f"the server exited; see {server.log}")
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server was not ready in {timeout} s; see {server.log}")


async def memorise(client: Any, docs: list[Any], timeout: float = 600) -> None:
    body = {
        "documents": [
            {"text": d.text, "published_at": str(d.published_at), "source": d.source} for d in docs
        ]
    }
    token = {"Authorization": "Bearer change-me"}  # the development token: ingest and reads
    r = await client.post("/ingest", json=body, headers=token)
    r.raise_for_status()
    ids = [d["id"] for d in r.json()["documents"]]
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        states = [
            (await client.get(f"/documents/{i}", headers=token)).json()["status"] for i in ids
        ]
        if all(s in ("done", "failed") for s in states):
            return
        await asyncio.sleep(1)
    raise SystemExit("the memory articles were not memorised in time")


async def queue_depth(client: Any) -> float:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("memlm_queue_depth "):
            return float(line.split()[1])
    return 0.0


class Conn:
    """One keep-alive HTTP/1.1 connection, spoken by hand: the load generator shares the
    machine with the server, so it must spend as little CPU per request as it can."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.used = 0.0

    async def send(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str]]:
        if self.writer is not None and time.monotonic() - self.used > KEEP_ALIVE_S:
            self.close()  # uvicorn has closed it by now (timeout_keep_alive, 5 s)
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        await self.reader.readexactly(int(headers.get("content-length", "0")))
        self.used = time.monotonic()
        return status, headers

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_level(
    base: str,
    contexts: list[str],
    clients: int,
    duration: float,
    drain: float,
    pid: int,
    hammer: bool,
) -> Level:
    import httpx

    level = Level(clients)
    host, port = base.removeprefix("http://").split(":")
    bodies = [json.dumps({"context": c}).encode() for c in contexts]
    probe = Conn(host, int(port))
    conns = [Conn(host, int(port)) for _ in range(clients)]
    cpu0, server0 = cpu_seconds(), cpu_seconds(pid)
    t0 = time.monotonic()
    stop = t0 + duration
    last = [t0]

    async def one(k: int) -> None:
        i, conn = k, conns[k]
        while time.monotonic() < stop:
            body = bodies[i % len(bodies)]
            i += clients
            s = time.monotonic()
            level.sent += 1
            try:
                code, headers = await conn.send("POST", "/predict", body)
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                code, headers = 0, {}
                conn.close()
                conns[k] = conn = Conn(host, int(port))
            e = time.monotonic()
            last[0] = max(last[0], e)
            if code == 200:
                level.ok += 1
                level.latencies.append(e - s)
            elif code == 429:
                level.refused += 1
                wait = int(headers.get("retry-after", "1"))
                level.retry_after.append(wait)
                if not hammer:
                    await asyncio.sleep(min(wait, max(0.0, stop - time.monotonic())))
            else:
                level.other += 1
                level.other_codes[code] = level.other_codes.get(code, 0) + 1

    async def health() -> None:
        while time.monotonic() < stop:
            s = time.monotonic()
            await probe.send("GET", "/healthz")
            level.health.append(time.monotonic() - s)
            await asyncio.sleep(0.05)

    await asyncio.gather(health(), *(one(k) for k in range(clients)))
    level.seconds = last[0] - t0
    level.load = load_average()
    level.cpu_client = cpu_seconds() - cpu0
    level.cpu_server = cpu_seconds(pid) - server0
    for c in conns:
        c.close()
    # let the server's queue drain before the next level
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        t1 = time.monotonic()
        while time.monotonic() - t1 < drain and await queue_depth(client) > 0:
            await asyncio.sleep(0.5)
    probe.close()
    return level


async def bench(checkout: Path, args: argparse.Namespace, label: str) -> list[Level]:
    import httpx

    from memlm.corpus import load_news

    news = load_news()
    memory, rest = news[: args.docs], news[args.docs :]
    contexts = []
    for d in rest:
        if len(d.text) >= CONTEXT_CHARS:
            cut = d.text[:CONTEXT_CHARS]
            contexts.append(cut[: cut.rfind(" ")])
    server = Server(checkout, args, label)
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            t0 = time.monotonic()
            await wait_ready(client, server)
            ready_s = time.monotonic() - t0
            await memorise(client, memory)
            for ctx in contexts[:5]:  # warm-up (and the first timings of the new executor)
                (await client.post("/predict", json={"context": ctx})).raise_for_status()
            print(
                f"[{label}] {checkout}: ready in {ready_s:.0f} s, {len(memory)} articles "
                f"memorised, load average {load_average()}",
                flush=True,
            )
        levels = []
        for n in args.levels:
            assert server.proc is not None
            lv = await run_level(
                base, contexts, n, args.duration, args.drain, server.proc.pid, args.hammer
            )
            print(f"[{label}] {n} clients done, load average {lv.load}", flush=True)
            levels.append(lv)
        return levels
    finally:
        server.stop()


def table(label: str, levels: list[Level]) -> str:
    peak = max((lv.ok / lv.seconds if lv.seconds else 0.0) for lv in levels)
    lines = [label, markdown_table(HEADER, [lv.cells() for lv in levels], align="r" * len(HEADER))]
    for lv in levels:
        if lv.other_codes:
            lines.append(
                f"{lv.clients} clients, other answers by status (0: none): {lv.other_codes}"
            )
    last = levels[-1]
    rate = last.ok / last.seconds if last.seconds else 0.0
    lines.append(
        f"at {last.clients} clients: {rate / peak:.0%} of the peak successful throughput"
        if peak
        else "no successful request"
    )
    return "\n".join(lines)


def run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--levels", default="32,64,128", help="concurrent clients, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per level")
    ap.add_argument("--drain", type=float, default=180.0, help="longest wait between levels")
    ap.add_argument("--docs", type=int, default=3, help="news articles memorised first")
    ap.add_argument("--budget", type=float, default=None, help="MEMLM_QUEUE_BUDGET_S")
    ap.add_argument(
        "--hammer", action="store_true", help="clients ignore Retry-After and retry at once"
    )
    ap.add_argument("--checkout", type=Path, default=ROOT, help="the code to serve")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, run first")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]

    started = time.monotonic()
    print(f"load average before: {load_average()}", flush=True)
    runs: list[tuple[str, list[Level]]] = []
    if args.baseline is not None:
        runs.append(("baseline", run(bench(args.baseline.resolve(), args, "baseline"))))
    runs.append(("this", run(bench(args.checkout.resolve(), args, "this"))))
    print()
    print(
        f"model {args.model}, {args.threads} torch thread(s), {args.duration:g} s per level, "
        f"{'Retry-After ignored' if args.hammer else 'Retry-After honoured'}, "
        f"contexts of ~128 tokens, {os.cpu_count()} cores; "
        f"{time.monotonic() - started:.0f} s in all; load average after: {load_average()}"
    )
    for label, levels in runs:
        checkout = args.baseline if label == "baseline" else args.checkout
        print()
        print(table(f"{label}: {checkout.resolve()}", levels))


if __name__ == "__main__":
    main()
