"""Run the forget-racing-consolidation flow of tests/test_consolidation.py on a Milvus
server, many times and several at once, and report each time a forgotten document's
entries are found again after the next build (docs/memory.md, "A build deletes again").

    python scripts/stress_milvus_forget.py --server 127.0.0.1:19530 --runs 10 --at-once 4

Start a server first (``memlm.memory.embedded.start_embedded``). A failure probes the
search again after 3, 10 and 30 s and prints the count of the document's rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_consolidation import DIM, forget_racing_consolidation  # noqa: E402

from memlm.memory import open_memory  # noqa: E402


def one(server: str, results: list[str]) -> None:
    url = f"milvus://{server}/s_{uuid.uuid4().hex[:10]}?consistency=Strong&timeout=60"
    mem = open_memory(url, Path(tempfile.mkdtemp()) / "data", DIM)
    try:
        docs, _ = forget_racing_consolidation(mem)
        info = mem.build()
        mem.reload()
        probes = []
        for wait in (0, 3, 10, 30):
            time.sleep(wait)
            ids = mem.search(docs[1][0], 4).ids
            found = mem.provenance(ids[ids >= 0]).documents.tolist()
            if wait == 0 and 1 not in found:
                results.append("ok")
                print("ok", info.details.get("deletes_reapplied"), flush=True)
                return
            probes.append((wait, sorted(found), mem.count()))
        results.append("found")
        print("FOUND the forgotten document:", probes, info.details, flush=True)
    finally:
        mem.drop()
        mem.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:19530")
    ap.add_argument("--runs", type=int, default=10, help="runs of each of the --at-once")
    ap.add_argument("--at-once", type=int, default=4)
    args = ap.parse_args()
    results: list[str] = []

    def loop() -> None:
        for _ in range(args.runs):
            try:
                one(args.server, results)
            except Exception as exc:  # noqa: BLE001 - counted and shown, the others go on
                results.append("error")
                print("ERROR", repr(exc), flush=True)

    threads = [threading.Thread(target=loop) for _ in range(args.at_once)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(
        f"{len(results)} runs: {results.count('ok')} ok, {results.count('found')} found the "
        f"forgotten document, {results.count('error')} errors"
    )


if __name__ == "__main__":
    main()
